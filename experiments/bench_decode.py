"""All decoding methods side by side in one process, on the same prompts and the same models.

    python experiments/bench_decode.py                      # the tiny pair, held-out stdlib prompts
    python experiments/bench_decode.py --budgets 8,16,32,64 --batch 4

Reports, per method: tau (mean tokens per round), tokens/s, speedup over ``ar``, and target forward passes
per generated token; every method's greedy output is checked against ``ar``.  Each configuration is
compiled and warmed up first, then timed over ``--repeats`` runs (median).  Writes
experiments/results/bench_decode.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import statistics
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402

from dtree_jax import train  # noqa: E402
from dtree_jax.api import load_model, generate  # noqa: E402


def heldout_prompts(n: int, length: int, seed: int = 0) -> list[list[int]]:
    """``n`` prompts of ``length`` bytes cut from held-out standard-library files (never trained on)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    files = train.stdlib_files("heldout")
    out = []
    for i in rng.permutation(len(files)):
        data = files[i].read_bytes()
        if len(data) < 4 * length:
            continue
        start = int(rng.integers(0, len(data) - 2 * length))
        start = data.rfind(b"\n", 0, start) + 1  # begin at a line start
        out.append([train.BOS] + list(data[start : start + length - 1]))
        if len(out) == n:
            return out
    raise RuntimeError("not enough held-out files for the requested prompts")


def run(target, drafter, prompts, method, budget, max_new, repeats) -> dict:
    """One generate call per repeat (after a compiling warm-up); median seconds."""
    times, res = [], None
    for r in range(repeats + 1):
        res = generate(target, prompts, method, drafter, budget=budget, max_new_tokens=max_new, stop_ids=())
        if r > 0:
            times.append(res.seconds)
    return dict(generated=sum(s["generated"] for s in res.stats), rounds=sum(s["rounds"] for s in res.stats),
                prefilled=len(prompts), seconds=statistics.median(times), tokens=res.tokens)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default=str(ROOT / "checkpoints" / "tiny-target"))
    p.add_argument("--drafter", default=str(ROOT / "checkpoints" / "tiny-domino"))
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=96)
    p.add_argument("--batch", type=int, default=1, help="requests per generate call (prompts are split)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--budgets", default="16,32")
    p.add_argument("--methods", default="ar,dflash,domino,ddtree,dominotree")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", default=str(ROOT / "experiments" / "results" / "bench_decode.json"))
    a = p.parse_args(argv)
    target, drafter = load_model(a.target), load_model(a.drafter)
    prompts = heldout_prompts(a.prompts, a.prompt_len)
    groups = [prompts[i : i + a.batch] for i in range(0, len(prompts), a.batch)]
    rows = []
    for method in a.methods.split(","):
        budgets = [int(b) for b in a.budgets.split(",")] if method in ("ddtree", "dominotree", "condstatic") else [0]
        for budget in budgets:
            parts = [run(target, drafter, g, method, max(budget, 1), a.max_new_tokens, a.repeats) for g in groups]
            gen, sec = sum(r["generated"] for r in parts), sum(r["seconds"] for r in parts)
            rounds, first = sum(r["rounds"] for r in parts), sum(r["prefilled"] for r in parts)
            row = dict(method=method, budget=budget or None, generated=gen, seconds=sec, tokens_per_second=gen / sec,
                       tau=(gen - first) / rounds, target_passes_per_token=(rounds + len(parts)) / gen,
                       tokens=[t for r in parts for t in r["tokens"]])
            rows.append(row)
            print(f"{method:<11} budget {str(row['budget']):>4}: tau {row['tau']:.2f}  {row['tokens_per_second']:.1f} tok/s",
                  flush=True)
    ar = next(r for r in rows if r["method"] == "ar")
    for r in rows:
        r["speedup_vs_ar"] = r["tokens_per_second"] / ar["tokens_per_second"]
        r["matches_ar"] = r["tokens"] == ar["tokens"]
    machine = dict(platform=platform.platform(), cpus=os.cpu_count(), jax=jax.__version__, backend=jax.default_backend())
    settings = dict(vars(a), machine=machine)
    out = pathlib.Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(settings=settings, rows=[{k: v for k, v in r.items() if k != "tokens"} for r in rows]),
                              indent=2) + "\n")
    print("\n| method | budget | tau | tokens/s | speedup vs ar | target passes / token | output = ar |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['method']} | {r['budget'] or '-'} | {r['tau']:.2f} | {r['tokens_per_second']:.1f} | "
              f"{r['speedup_vs_ar']:.2f}x | {r['target_passes_per_token']:.3f} | {'yes' if r['matches_ar'] else 'NO'} |")
    print(f"\n{machine['platform']}, {machine['cpus']} CPUs, jax {machine['jax']} ({machine['backend']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
