"""The paper's analyses on the shipped pair, side by side in one process, on held-out prompts.

    python experiments/run_experiments.py            # everything (about 20-30 minutes on 2 CPU cores)
    python experiments/run_experiments.py --only budgets,ladder

Parts (each writes experiments/results/exp_<part>.json, and figures under experiments/results/*.png):
  budgets      tau and tokens/s vs node budget (8, 16, 32, 64) for dominotree and ddtree, next to the domino and
               dflash chains and ar
  width        the candidate-width ablation: dominotree with M = 16, 64 and the full vocabulary (M = 0)
  ladder       the conditioning ladder at one budget: marginal (ddtree on Domino's base logits) -> condstatic
               (correction once per depth along the greedy chain) -> conditional (dominotree)
  goodput      goodput (generated tokens/s over the whole batch) vs batch size 1..64 for fixed budgets and
               ``budget="auto"``; auto is fed a calibration measured first on *other* held-out prompts
               (tau per budget at batch 1, seconds per round per batch and budget), saved beside the drafter
Every method's greedy output is checked against ar (a mismatch is reported, not hidden).
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
import numpy as np  # noqa: E402

from dtree_jax import decode  # noqa: E402
from dtree_jax.decode import _as_model, generate  # noqa: E402
from experiments.bench_decode import heldout_prompts  # noqa: E402

RESULTS = ROOT / "experiments" / "results"


def machine() -> dict:
    return dict(platform=platform.platform(), cpus=os.cpu_count(), jax=jax.__version__, backend=jax.default_backend())


class Runner:
    """Runs generate once to compile/warm up, then ``repeats`` timed runs; checks greedy output against ar."""

    def __init__(self, target, drafter, prompts, max_new, repeats):
        self.target, self.drafter, self.prompts = target, drafter, prompts
        self.max_new, self.repeats = max_new, repeats
        self.ar_tokens = None

    def __call__(self, method, prompts=None, **kw) -> dict:
        prompts = prompts or self.prompts
        times, res = [], None
        for r in range(self.repeats + 1):
            res = generate(self.target, prompts, method, self.drafter, max_new_tokens=self.max_new, stop_ids=(), **kw)
            if r:
                times.append(res.stats[0]["seconds"])
        gen = sum(s["generated"] for s in res.stats)
        rounds = sum(s["rounds"] for s in res.stats)
        sec = statistics.median(times)
        row = dict(method=method, batch=len(prompts), generated=gen, rounds=rounds, seconds=sec,
                   tokens_per_second=gen / sec, tau=(gen - len(prompts)) / max(rounds, 1),
                   budget=res.stats[0]["budget"], **{k: v for k, v in kw.items() if k not in ("calibration", "budget")})
        if kw.get("budget") == "auto":
            row["auto"] = True
        if prompts is self.prompts:
            if method == "ar":
                self.ar_tokens = res.tokens
            row["matches_ar"] = None if self.ar_tokens is None else res.tokens == self.ar_tokens
        print(f"  {method:<11} {json.dumps({k: row[k] for k in row if k not in ('method',)}, default=str)}",
              flush=True)
        return row


def save(name: str, payload: dict) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"exp_{name}.json").write_text(json.dumps(payload, indent=2, default=str) + "\n")


def plot(name: str, draw) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = draw(plt)
    fig.tight_layout()
    fig.savefig(RESULTS / f"{name}.png", dpi=110)
    plt.close(fig)


def part_budgets(run: Runner, budgets) -> list[dict]:
    rows = [run("ar"), run("dflash"), run("domino")]
    for method in ("ddtree", "dominotree"):
        rows += [run(method, budget=b) for b in budgets]
    ar = rows[0]["tokens_per_second"]
    for r in rows:
        r["speedup_vs_ar"] = r["tokens_per_second"] / ar
    plot_budgets(rows)
    return rows


def plot_budgets(rows: list[dict]) -> None:
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

    plot("budgets", draw)


def part_width(run: Runner, budget) -> list[dict]:
    return [run("dominotree", budget=budget, corr_topm=m) for m in (16, 64, 0)]


def part_ladder(run: Runner, budget) -> list[dict]:
    return [run(m, budget=budget) for m in ("ddtree", "condstatic", "dominotree")]


def calibrate(target, drafter, prompts, budgets, batches, max_new) -> dict:
    """tau per budget (batch 1, calibration prompts) and seconds per round per (batch, budget)."""
    taus, seconds = {}, {}
    for bs in batches:
        seconds[bs] = {}
        batch = [prompts[i % len(prompts)] for i in range(bs)]
        for b in budgets:
            generate(target, batch, "dominotree", drafter, budget=b, max_new_tokens=max_new, stop_ids=())  # warm
            res = generate(target, batch, "dominotree", drafter, budget=b, max_new_tokens=max_new, stop_ids=())
            rounds = max(s["rounds"] for s in res.stats)
            seconds[bs][b] = res.stats[0]["seconds"] / max(rounds, 1)
            if bs == batches[0]:
                gen = sum(s["generated"] for s in res.stats)
                taus[b] = (gen - len(batch)) / sum(s["rounds"] for s in res.stats)
            print(f"  calibrate batch {bs} budget {b}: {seconds[bs][b] * 1e3:.1f} ms/round"
                  + (f", tau {taus[b]:.2f}" if bs == batches[0] else ""), flush=True)
    return dict(tau_by_budget=taus, round_seconds=seconds, measured_on=machine(), prompts=len(prompts),
                max_new_tokens=max_new, method="dominotree")


def part_goodput(target, drafter, eval_prompts, calib_prompts, budgets, batches, max_new, repeats) -> dict:
    t0 = time.perf_counter()
    cal = calibrate(target, drafter, calib_prompts, budgets, batches, max_new)
    cal_seconds = time.perf_counter() - t0
    if drafter.path:
        (pathlib.Path(drafter.path) / decode.CALIBRATION_FILE).write_text(json.dumps(cal, indent=2) + "\n")
    rows = []
    for bs in batches:
        batch = [eval_prompts[i % len(eval_prompts)] for i in range(bs)]
        run = Runner(target, drafter, batch, max_new, repeats)
        fixed = [run("dominotree", budget=b) for b in budgets]
        auto = run("dominotree", budget="auto", calibration=cal)
        best = max(fixed, key=lambda r: r["tokens_per_second"])
        rows += fixed + [dict(auto, best_fixed_budget=best["budget"],
                              auto_vs_best=auto["tokens_per_second"] / best["tokens_per_second"])]

    def draw(plt):
        fig, ax = plt.subplots(figsize=(6, 4))
        for b in budgets:
            xs = [r for r in rows if r.get("budget") == b and not r.get("auto")]
            ax.plot([r["batch"] for r in xs], [r["tokens_per_second"] for r in xs], "o-", label=f"budget {b}")
        xs = [r for r in rows if r.get("auto")]
        ax.plot([r["batch"] for r in xs], [r["tokens_per_second"] for r in xs], "k*--", ms=10, label="auto")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size")
        ax.set_ylabel("goodput (generated tokens/s, CPU)")
        ax.legend(fontsize=8)
        return fig, ax

    plot("goodput", draw)
    return dict(calibration=cal, calibration_seconds=cal_seconds, rows=rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default=str(ROOT / "checkpoints" / "tiny-target"))
    p.add_argument("--drafter", default=str(ROOT / "checkpoints" / "tiny-domino"))
    p.add_argument("--only", default="budgets,width,ladder,goodput")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=96)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--budgets", default="8,16,32,64")
    p.add_argument("--ablation-budget", type=int, default=32)
    p.add_argument("--goodput-budgets", default="4,8,16,32")
    p.add_argument("--batches", default="1,4,16,64")
    a = p.parse_args(argv)
    target, drafter = _as_model(a.target), _as_model(a.drafter)
    prompts = heldout_prompts(a.prompts, a.prompt_len, seed=0)
    calib = heldout_prompts(a.prompts + 4, a.prompt_len, seed=1)[-4:]
    parts = a.only.split(",")
    run = Runner(target, drafter, prompts, a.max_new_tokens, a.repeats)
    common = dict(machine=machine(), prompts=len(prompts), prompt_len=a.prompt_len, max_new_tokens=a.max_new_tokens,
                  target=a.target, drafter=a.drafter)
    if "budgets" in parts or "width" in parts or "ladder" in parts:
        run("ar")  # the reference output every greedy run is checked against
    if "budgets" in parts:
        print("budgets", flush=True)
        save("budgets", dict(common, rows=part_budgets(run, [int(x) for x in a.budgets.split(",")])))
    if "width" in parts:
        print("width", flush=True)
        save("width", dict(common, budget=a.ablation_budget, rows=part_width(run, a.ablation_budget)))
    if "ladder" in parts:
        print("ladder", flush=True)
        save("ladder", dict(common, budget=a.ablation_budget, rows=part_ladder(run, a.ablation_budget)))
    if "goodput" in parts:
        print("goodput", flush=True)
        out = part_goodput(target, drafter, prompts, calib, [int(x) for x in a.goodput_budgets.split(",")],
                           [int(x) for x in a.batches.split(",")], a.max_new_tokens // 2 + 16, a.repeats)
        save("goodput", dict(common, **out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
