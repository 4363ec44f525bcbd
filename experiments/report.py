"""Prints the markdown tables of experiments/results/exp_*.json and bench_decode.json (pasted into the README).

    python experiments/report.py            # the SmolLM2 pair (exp_smollm2_*.json)
    python experiments/report.py --pair tiny
    python experiments/report.py --aot       # aot_real_shapes.json and bench_sharded.json only
"""

from __future__ import annotations

import argparse
import json
import pathlib

RESULTS = pathlib.Path(__file__).resolve().parent / "results"


def _load(name):
    p = RESULTS / name
    return json.loads(p.read_text()) if p.is_file() else None


def _table(header, rows):
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def _same(r) -> str:
    return {True: "yes", False: "NO", None: "-"}[r.get("matches_ar")]


def plot_training() -> None:
    """The SmolLM2 drafter's loss curves (train_smollm2_drafter.json) as train_smollm2_drafter.png; a run warm
    started from an earlier drafter is drawn after the earlier stages' curves (train_smollm2_drafter_stageN.json,
    N = 1, 2, ...)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    last = _load("train_smollm2_drafter.json")
    earlier = []
    if last["recipe"].get("init"):
        stages = {int(n): f for f in RESULTS.glob("train_smollm2_drafter_stage*.json")
                  if (n := f.stem.removeprefix("train_smollm2_drafter_stage")).isdigit()}
        earlier = [json.loads(stages[n].read_text()) for n in sorted(stages)]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
    offset = 0
    for i, d in enumerate([*earlier, last]):
        steps = [offset + s for s in d["steps"]]
        for key, label, color in (("kd_base", "KD, base rows", "C0"), ("kd_final", "KD, corrected rows", "C1"),
                                  ("loss", "objective", "C2")):
            a.plot(steps, d[key], label=None if i else label, lw=1, color=color)
        a.axvline(offset + d["recipe"]["backbone_steps"], color="gray", ls=":",
                  label=None if i else "head steps start")
        b.plot(steps, d["top1"], lw=1, color="C0")
        if i:
            for ax in (a, b):
                ax.axvline(offset, color="k", ls="--", lw=1, label="warm start" if ax is a and i == 1 else None)
        offset += d["step"]
    a.set_yscale("log")
    a.set_xlabel("step")
    a.set_ylabel("nats")
    a.legend(fontsize=8)
    b.set_xlabel("step")
    b.set_ylabel("top-1 agreement (training batches)")
    fig.tight_layout()
    fig.savefig(RESULTS / "train_smollm2_drafter.png", dpi=110)


def aot_tables() -> None:
    """The AOT compile / memory table (aot_real_shapes.json) and the sharded-run overhead (bench_sharded.json)."""
    d = _load("aot_real_shapes.json")
    if d:
        from experiments.aot_real_shapes import table

        m = d["machine"]
        print(f"### Whole dominotree generation compiled for chips ({m['cpu_cores']} CPU cores, jax {m['jax']})\n")
        print(table(d["rows"]))
        print()
    d = _load("bench_sharded.json")
    if d:
        print(f"### Sharded run overhead at the tiny shapes ({d['machine']})\n")
        print(_table(["method", "batch", "mesh", "seconds", "vs one device", "output = one device"],
                     [[r["method"], r["batch"], r["mesh"], f"{r['seconds']:.3f}", f"{r['ratio']:.2f}x",
                       "yes" if r["same_tokens"] else "NO"] for r in d["rows"]]))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pair", choices=("smollm2", "tiny"), default="smollm2")
    p.add_argument("--plot-training", action="store_true", help="also draw the SmolLM2 drafter's loss curves")
    p.add_argument("--aot", action="store_true", help="only the AOT real-shapes and sharded-overhead tables")
    a = p.parse_args(argv)
    if a.aot:
        return aot_tables()
    prefix = "" if a.pair == "tiny" else "smollm2_"
    if a.plot_training:
        plot_training()
    for part, title in (("budgets", "tau and tokens/s vs budget"), ("sampled", "the same at temperature 0.7")):
        d = _load(f"exp_{prefix}{part}.json")
        if d:
            bs = d["rows"][0]["batch"]
            print(f"### {title} (batch {bs}, {d['rows'][0].get('prompts', bs)} prompts)\n")
            print(_table(["method", "budget", "tau", "tokens/s", "speedup vs ar", "output = ar"],
                         [[r["method"], r["budget"] or "-", f"{r['tau']:.2f}", f"{r['tokens_per_second']:.1f}",
                           f"{r['speedup_vs_ar']:.2f}x", _same(r)] for r in d["rows"]]))
            print()
    for name, title, col in ((f"exp_{prefix}width.json", "candidate width M (dominotree)", "corr_topm"),
                             (f"exp_{prefix}ladder.json", "conditioning ladder", "method")):
        d = _load(name)
        if d:
            print(f"\n### {title}, budget {d['budget']}\n")
            print(_table([col, "tau", "tokens/s", "output = ar"],
                         [[("full" if r.get(col) == 0 else r.get(col)), f"{r['tau']:.2f}",
                           f"{r['tokens_per_second']:.1f}", _same(r)] for r in d["rows"]]))
    d = _load(f"exp_{prefix}goodput.json")
    if d:
        trees = [r for r in d["rows"] if r["method"] != "ar"]
        budgets = sorted({r["budget"] for r in trees if not r.get("auto")})
        batches = sorted({r["batch"] for r in d["rows"]})
        rows = []
        for bs in batches:
            fixed = {r["budget"]: r for r in trees if r["batch"] == bs and not r.get("auto")}
            auto = next(r for r in trees if r["batch"] == bs and r.get("auto"))
            ar = next((r for r in d["rows"] if r["batch"] == bs and r["method"] == "ar"), None)
            rows.append([bs, f"{ar['tokens_per_second']:.1f}" if ar else "-"]
                        + [f"{fixed[b]['tokens_per_second']:.1f}" for b in budgets]
                        + [f"{auto['tokens_per_second']:.1f} "
                           + ("(ar)" if auto.get("ran") == "ar" else f"(budget {auto['budget']})"),
                           f"{auto['auto_vs_best']:.2f}",
                           f"{auto['auto_vs_best_or_ar']:.2f}" if "auto_vs_best_or_ar" in auto else "-",
                           "yes" if all(r.get("matches_ar") is not False for r in d["rows"] if r["batch"] == bs)
                           else "NO"])
        print("\n### goodput (generated tokens/s over the batch) vs batch size, dominotree\n")
        print(_table(["batch", "ar"] + [f"budget {b}" for b in budgets]
                     + ["auto", "auto / best fixed", "auto / best of fixed and ar", "outputs = ar"], rows))
    d = _load("bench_decode.json") if not prefix else None
    if d:
        print("\n### bench_decode\n")
        print(_table(["method", "budget", "tau", "tokens/s", "speedup vs ar", "target passes / token", "output = ar"],
                     [[r["method"], r["budget"] or "-", f"{r['tau']:.2f}", f"{r['tokens_per_second']:.0f}",
                       f"{r['speedup_vs_ar']:.2f}x", f"{r['target_passes_per_token']:.3f}",
                       "yes" if r["matches_ar"] else "NO"] for r in d["rows"]]))


if __name__ == "__main__":
    main()
