"""The paper's analyses on a shipped pair, side by side in one process, on held-out prompts.

    python experiments/run_experiments.py --pair smollm2   # SmolLM2-135M + its drafter (about 1 h, 2 CPU cores)
    python experiments/run_experiments.py --pair tiny      # the byte-level pair (about 20-30 minutes)
    python experiments/run_experiments.py --pair smollm2 --only budgets,ladder

Parts (each writes experiments/results/exp_<part>.json, and figures under experiments/results/*.png):
  budgets      tau and tokens/s vs node budget (8, 16, 32, 64) for dominotree and ddtree, next to the domino and
               dflash chains and ar
  width        the candidate-width ablation: dominotree with M = 16, 64 and the full vocabulary (M = 0)
  ladder       the conditioning ladder at one budget: marginal (ddtree on Domino's base logits) -> condstatic
               (correction once per depth along the greedy chain) -> conditional (dominotree)
  goodput      goodput (generated tokens/s over the whole batch) vs batch size 1..64 for fixed budgets and
               ``budget="auto"``; auto is fed a calibration measured first on *other* held-out prompts
               (tau per budget at batch 1, seconds per round per batch and budget; plain ar as budget 0, so auto
               may decline to speculate), saved beside the drafter
  sampled      the budgets table (fewer budgets) at temperature 0.7 (same seed for every method)
Every method's greedy output is checked against ar (a mismatch is reported, not hidden).  SmolLM2 prompts are
the held-out chat and continuation prompts of experiments/train_smollm2.py (files no training prompt saw),
decoded one request at a time (batch 1) unless a part says otherwise, all in one prompt bucket (one
compilation per configuration).  Results: ``exp_<pair>_<part>.json`` and ``<pair>_<part>.png`` (the tiny
pair keeps its historical names, ``exp_<part>.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402

from dtree_jax.api import generate, load_model  # noqa: E402
from dtree_jax.cost import CALIBRATION_FILE  # noqa: E402
from experiments.bench_decode import heldout_prompts  # noqa: E402

RESULTS = ROOT / "experiments" / "results"


def cpu_model() -> str:
    """The processor's model name (Linux ``/proc/cpuinfo``; hosts of our kind differ: AMD EPYC, Intel Xeon)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        name = ""
    return name or platform.processor() or platform.machine()


def machine() -> dict:
    return dict(platform=platform.platform(), processor=cpu_model(), cpus=os.cpu_count(), jax=jax.__version__,
                backend=jax.default_backend())


class Runner:
    """Runs ``generate`` over the prompts in batches of ``batch`` (cycling prompts to fill the last batch):
    one untimed call compiles, then ``repeats`` timed passes (median of the summed seconds).  Greedy outputs
    are checked against ``ar`` on the same prompts (``ar`` runs first)."""

    def __init__(self, target, drafter, prompts, max_new, repeats, batch=None, prompt_bucket=None, stop_ids=()):
        self.target, self.drafter, self.prompts = target, drafter, prompts
        self.max_new, self.repeats, self.batch = max_new, repeats, batch or len(prompts)
        self.knobs = dict(prompt_bucket=prompt_bucket, stop_ids=stop_ids, max_new_tokens=max_new)
        self.ar_tokens = []  # ar's greedy tokens per prompt

    def __call__(self, method, batch=None, **kw) -> dict:
        bs = batch or self.batch
        n = -(-len(self.prompts) // bs) * bs
        prompts = [self.prompts[i % len(self.prompts)] for i in range(n)]
        chunks = [prompts[i : i + bs] for i in range(0, n, bs)]
        run = lambda chunk: generate(self.target, chunk, method, self.drafter, **self.knobs, **kw)  # noqa: E731
        run(chunks[0])  # compiles
        times, tokens, gen, rounds, budget, ran = [], [], 0, 0, None, method
        for _ in range(self.repeats):
            seconds, tokens, gen, rounds = 0.0, [], 0, 0
            for chunk in chunks:
                res = run(chunk)
                seconds += res.seconds
                tokens += res.tokens
                gen += sum(s["generated"] for s in res.stats)
                rounds += sum(s["rounds"] for s in res.stats)
                budget, ran = res.stats[0]["budget"], res.stats[0]["method"]
            times.append(seconds)
        sec = statistics.median(times)
        knobs = {k: v for k, v in kw.items() if k not in ("calibration", "budget")}
        row = dict(method=method, batch=bs, prompts=n, generated=gen, rounds=rounds, seconds=sec,
                   tokens_per_second=gen / sec, tau=(gen - n) / max(rounds, 1), budget=budget, **knobs)
        if kw.get("budget") == "auto":
            row.update(auto=True, ran=ran)  # ran: "ar" where auto declined to speculate
        if kw.get("temperature", 0.0) == 0.0:  # sampled outputs follow the target's distribution, not ar's draws
            if method == "ar":
                self.ar_tokens = tokens
            want = self.ar_tokens
            row["matches_ar"] = None if not want else tokens == [want[i % len(want)] for i in range(n)]
        print(f"  {method:<11} {json.dumps({k: row[k] for k in row if k not in ('method',)}, default=str)}",
              flush=True)
        return row


PREFIX = ""  # "smollm2_" for the SmolLM2 pair (set by main)


def save(name: str, payload: dict) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"exp_{PREFIX}{name}.json").write_text(json.dumps(payload, indent=2, default=str) + "\n")


def plot(name: str, draw) -> None:
    """Draws ``RESULTS/<name>.png``; without matplotlib (the ``experiments`` extra) says so and draws nothing,
    so a part's results are never lost to a missing plotting library."""
    try:
        import matplotlib
    except ModuleNotFoundError:
        print(f"  (no {PREFIX}{name}.png: matplotlib is not installed; pip install -e '.[experiments]')", flush=True)
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = draw(plt)
    fig.tight_layout()
    fig.savefig(RESULTS / f"{PREFIX}{name}.png", dpi=110)
    plt.close(fig)


def part_budgets(run: Runner, budgets, name="budgets", **kw) -> list[dict]:
    rows = [run("ar", **kw), run("dflash", **kw), run("domino", **kw)]
    for method in ("ddtree", "dominotree"):
        rows += [run(method, budget=b, **kw) for b in budgets]
    ar = rows[0]["tokens_per_second"]
    for r in rows:
        r["speedup_vs_ar"] = r["tokens_per_second"] / ar
    plot_budgets(rows, name)
    return rows


def plot_budgets(rows: list[dict], name: str) -> None:
    """tau and tokens/s vs budget for the trees, with the chains and ar as horizontal lines."""

    def draw(plt):
        fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
        for method, style in (("dominotree", "o-"), ("ddtree", "s--")):
            xs = [r for r in rows if r["method"] == method]
            a.plot([r["budget"] for r in xs], [r["tau"] for r in xs], style, label=method)
            b.plot([r["budget"] for r in xs], [r["tokens_per_second"] for r in xs], style, label=method)
        for r, c in zip(rows[:3], ("gray", "tab:green", "tab:red")):
            a.axhline(r["tau"], color=c, ls=":", label=r["method"])
            b.axhline(r["tokens_per_second"], color=c, ls=":", label=r["method"])
        for ax, yl in ((a, "tau (tokens per round)"), (b, f"tokens/s (batch {rows[0]['batch']}, CPU)")):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("node budget")
            ax.set_ylabel(yl)
            ax.legend(fontsize=8)
        return fig, (a, b)

    plot(name, draw)


def plot_goodput(rows: list[dict], budgets) -> None:
    """Goodput vs batch for each fixed budget and for auto."""

    def draw(plt):
        fig, ax = plt.subplots(figsize=(6, 4))
        for b in budgets:
            xs = [r for r in rows if r.get("budget") == b and not r.get("auto") and r["method"] != "ar"]
            ax.plot([r["batch"] for r in xs], [r["tokens_per_second"] for r in xs], "o-", label=f"budget {b}")
        xs = [r for r in rows if r.get("auto")]
        ax.plot([r["batch"] for r in xs], [r["tokens_per_second"] for r in xs], "k*--", ms=10, label="auto")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size")
        ax.set_ylabel("goodput (generated tokens/s, CPU)")
        ax.legend(fontsize=8)
        return fig, ax

    plot("goodput", draw)


def replot(parts) -> None:
    """Redraws the figures of ``parts`` from their saved ``exp_<pair>_<part>.json`` (no runs)."""
    for part in parts:
        path = RESULTS / f"exp_{PREFIX}{part}.json"
        if not path.is_file():
            raise SystemExit(f"error: no {path} to plot; run the part first")
        rows = json.loads(path.read_text())["rows"]
        if part in ("budgets", "sampled"):
            plot_budgets(rows, part)
        elif part == "goodput":
            plot_goodput(rows, sorted({r["budget"] for r in rows if isinstance(r.get("budget"), int)}))


def part_width(run: Runner, budget, widths) -> list[dict]:
    return [run("dominotree", budget=budget, corr_topm=m) for m in widths]


def part_ladder(run: Runner, budget) -> list[dict]:
    return [run(m, budget=budget) for m in ("ddtree", "condstatic", "dominotree")]


def calibrate(runner: Runner, budgets, batches) -> dict:
    """tau per budget (batch 1) and seconds per round per (batch, budget), on the runner's prompts; budget 0 is
    plain ar (tau 1, seconds per token), so that ``auto`` can decline to speculate."""
    taus, seconds = {0: 1.0}, {}
    for bs in batches:
        seconds[bs] = {}
        for b in (0, *budgets):
            row = runner("ar", batch=bs) if b == 0 else runner("dominotree", batch=bs, budget=b)
            chunk_rounds = row["rounds"] / bs  # rows of a batch run the same rounds up to their stops
            seconds[bs][b] = row["seconds"] / max(chunk_rounds, 1)
            if bs == batches[0] and b:  # ar's tau is 1 by definition
                taus[b] = row["tau"]
            print(f"  calibrate batch {bs} {f'budget {b}' if b else 'ar'}: {seconds[bs][b] * 1e3:.1f} ms/round"
                  + (f", tau {taus[b]:.2f}" if bs == batches[0] else ""), flush=True)
    return dict(tau_by_budget=taus, round_seconds=seconds, measured_on=machine(), prompts=len(runner.prompts),
                max_new_tokens=runner.max_new, method="dominotree")


def _store_round_seconds(file: pathlib.Path, cal: dict) -> None:
    """Writes ``cal`` into the drafter's calibration file, but keeps a tau per budget that
    ``eval_drafter.py --calibrate`` measured there (``tau_measured``): that one comes from more prompts."""
    old = json.loads(file.read_text()) if file.is_file() else {}
    kept = {k: old[k] for k in ("tau_by_budget", "tau_measured") if "tau_measured" in old}
    file.write_text(json.dumps({**cal, **kept}, indent=2) + "\n")


def part_goodput(run: Runner, calib: Runner, drafter, budgets, batches) -> dict:
    t0 = time.perf_counter()
    cal = calibrate(calib, budgets, batches)
    cal_seconds = time.perf_counter() - t0
    if drafter.path:
        _store_round_seconds(pathlib.Path(drafter.path) / CALIBRATION_FILE, cal)
    rows = []
    for bs in batches:
        ar = run("ar", batch=bs)
        fixed = [run("dominotree", batch=bs, budget=b) for b in budgets]
        auto = run("dominotree", batch=bs, budget="auto", calibration=cal)
        best = max(fixed, key=lambda r: r["tokens_per_second"])
        for r in fixed + [auto]:
            r["speedup_vs_ar"] = r["tokens_per_second"] / ar["tokens_per_second"]
        rows += [ar] + fixed + [dict(auto, best_fixed_budget=best["budget"],
                                     auto_vs_best=auto["tokens_per_second"] / best["tokens_per_second"],
                                     auto_vs_best_or_ar=auto["tokens_per_second"]
                                     / max(best["tokens_per_second"], ar["tokens_per_second"]))]

    plot_goodput(rows, budgets)
    return dict(calibration=cal, calibration_seconds=cal_seconds, rows=rows)


def smollm2_heldout(target, n: int, offset: int = 0) -> tuple[list, list[list[int]]]:
    """Held-out prompts ``offset .. offset + n`` (``distill.Prompt``) and their token ids (chat ones rendered
    with the chat template)."""
    from dtree_jax import distill

    held = json.loads((RESULTS / "smollm2_heldout_prompts.json").read_text())
    prompts = [distill.Prompt(p["kind"], p["text"], p["source"]) for p in held]
    kept, ids = distill.encode_prompts(target.path, prompts, max_tokens=PROMPT_TOKENS)
    if len(ids) < offset + n:
        raise ValueError(f"only {len(ids)} held-out prompts fit {PROMPT_TOKENS} tokens; asked for {offset + n}")
    return kept[offset : offset + n], ids[offset : offset + n]


def smollm2_prompts(target, n: int, offset: int = 0) -> list[list[int]]:
    """Token ids of held-out prompts ``offset .. offset + n``."""
    return smollm2_heldout(target, n, offset)[1]


PROMPT_TOKENS = 128  # the SmolLM2 prompts' bucket (the training data's prompt length)
PAIRS = dict(  # pair -> defaults
    tiny=dict(target=str(ROOT / "checkpoints" / "tiny-target"), drafter=str(ROOT / "checkpoints" / "tiny-domino"),
              prompts=4, max_new_tokens=96, budgets="8,16,32,64", ablation_budget=32, widths="16,64,0",
              goodput_budgets="4,8,16,32", batches="1,4,16,64", batch=None, sampled_budgets="8,32"),
    smollm2=dict(target=None, drafter=str(ROOT / "checkpoints" / "smollm2-domino"), prompts=20, max_new_tokens=64,
                 budgets="4,8,16,32", ablation_budget=8, widths="16,64,256,0", goodput_budgets="4,8,16,32",
                 batches="1,4,16", batch=1, sampled_budgets="8"),
)


def main(argv=None) -> int:
    global PREFIX
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pair", choices=sorted(PAIRS), default="smollm2")
    p.add_argument("--target", help="default: the pair's target")
    p.add_argument("--drafter", help="default: the pair's drafter")
    p.add_argument("--only", default="budgets,width,ladder,goodput,sampled")
    p.add_argument("--prompts", type=int, help="held-out prompts (default: the pair's)")
    p.add_argument("--prompt-len", type=int, default=96, help="tiny pair: prompt bytes")
    p.add_argument("--max-new-tokens", type=int)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--plot-only", action="store_true", help="redraw the parts' figures from their saved JSON")
    for knob in ("budgets", "ablation-budget", "widths", "goodput-budgets", "batches", "sampled-budgets"):
        p.add_argument(f"--{knob}")
    a = p.parse_args(argv)
    d = PAIRS[a.pair]
    pick = lambda name: getattr(a, name) if getattr(a, name) is not None else d[name]  # noqa: E731
    ints = lambda text: [int(x) for x in str(text).split(",")]  # noqa: E731
    if a.plot_only:
        PREFIX = "smollm2_" if a.pair == "smollm2" else ""
        replot(a.only.split(","))
        return 0
    if a.pair == "smollm2":
        from dtree_jax.gguf import smollm2_gguf

        PREFIX = "smollm2_"
        target = load_model(a.target or smollm2_gguf())
        prompts = smollm2_prompts(target, pick("prompts"))
        calib = smollm2_prompts(target, 4, offset=pick("prompts"))
        bucket = PROMPT_TOKENS
    else:
        target = load_model(pick("target"))
        prompts = heldout_prompts(pick("prompts"), a.prompt_len, seed=0)
        calib = heldout_prompts(pick("prompts") + 4, a.prompt_len, seed=1)[-4:]
        bucket = None
    drafter = load_model(pick("drafter"))
    max_new, budget = pick("max_new_tokens"), int(pick("ablation_budget"))
    parts = a.only.split(",")
    run = Runner(target, drafter, prompts, max_new, a.repeats, batch=d["batch"], prompt_bucket=bucket)
    common = dict(machine=machine(), pair=a.pair, prompts=len(prompts), max_new_tokens=max_new, batch=run.batch,
                  target=str(target.path), drafter=str(drafter.path))
    if "budgets" in parts or "width" in parts or "ladder" in parts:
        run("ar")  # the reference output every greedy run is checked against
    if "budgets" in parts:
        print("budgets", flush=True)
        save("budgets", dict(common, rows=part_budgets(run, ints(pick("budgets")))))
    if "width" in parts:
        print("width", flush=True)
        save("width", dict(common, budget=budget, rows=part_width(run, budget, ints(pick("widths")))))
    if "ladder" in parts:
        print("ladder", flush=True)
        save("ladder", dict(common, budget=budget, rows=part_ladder(run, budget)))
    if "goodput" in parts:
        print("goodput", flush=True)
        calib_run = Runner(target, drafter, calib, max_new // 2 + 16, 1, batch=1, prompt_bucket=bucket)
        goodput = Runner(target, drafter, prompts, max_new // 2 + 16, a.repeats, prompt_bucket=bucket)
        out = part_goodput(goodput, calib_run, drafter, ints(pick("goodput_budgets")), ints(pick("batches")))
        save("goodput", dict(common, **out))
    if "sampled" in parts:
        print("sampled (temperature 0.7)", flush=True)
        rows = part_budgets(run, ints(pick("sampled_budgets")), name="sampled", temperature=0.7, seed=1)
        save("sampled", dict(common, temperature=0.7, seed=1, rows=rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
