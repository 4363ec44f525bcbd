"""Prints the markdown tables of experiments/results/exp_*.json and bench_decode.json (pasted into the README)."""

from __future__ import annotations

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


def main() -> None:
    d = _load("exp_budgets.json")
    if d:
        print(f"### tau and tokens/s vs budget (a batch of {d['rows'][0]['batch']} prompts)\n")
        print(_table(["method", "budget", "tau", "tokens/s", "speedup vs ar", "output = ar"],
                     [[r["method"], r["budget"] or "-", f"{r['tau']:.2f}", f"{r['tokens_per_second']:.0f}",
                       f"{r['speedup_vs_ar']:.2f}x", "yes" if r.get("matches_ar") else "NO"] for r in d["rows"]]))
    for name, title, col in (("exp_width.json", "candidate width M (dominotree)", "corr_topm"),
                             ("exp_ladder.json", "conditioning ladder", "method")):
        d = _load(name)
        if d:
            print(f"\n### {title}, budget {d['budget']}\n")
            print(_table([col, "tau", "tokens/s", "output = ar"],
                         [[("full" if r.get(col) == 0 else r.get(col)), f"{r['tau']:.2f}", f"{r['tokens_per_second']:.0f}",
                           "yes" if r.get("matches_ar") else "NO"] for r in d["rows"]]))
    d = _load("exp_goodput.json")
    if d:
        budgets = sorted({r["budget"] for r in d["rows"] if not r.get("auto")})
        batches = sorted({r["batch"] for r in d["rows"]})
        rows = []
        for bs in batches:
            fixed = {r["budget"]: r for r in d["rows"] if r["batch"] == bs and not r.get("auto")}
            auto = next(r for r in d["rows"] if r["batch"] == bs and r.get("auto"))
            rows.append([bs] + [f"{fixed[b]['tokens_per_second']:.0f}" for b in budgets]
                        + [f"{auto['tokens_per_second']:.0f} (budget {auto['budget']})", f"{auto['auto_vs_best']:.2f}"])
        print("\n### goodput (generated tokens/s over the batch) vs batch size, dominotree\n")
        print(_table(["batch"] + [f"budget {b}" for b in budgets] + ["auto", "auto / best fixed"], rows))
    d = _load("bench_decode.json")
    if d:
        print("\n### bench_decode\n")
        print(_table(["method", "budget", "tau", "tokens/s", "speedup vs ar", "target passes / token", "output = ar"],
                     [[r["method"], r["budget"] or "-", f"{r['tau']:.2f}", f"{r['tokens_per_second']:.0f}",
                       f"{r['speedup_vs_ar']:.2f}x", f"{r['target_passes_per_token']:.3f}",
                       "yes" if r["matches_ar"] else "NO"] for r in d["rows"]]))


if __name__ == "__main__":
    main()
