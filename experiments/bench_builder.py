"""Build time per round: host heap builder vs jitted frontier builder, side by side in one process.

Qwen3-4B Domino dimensions (H 2560, G 1024, E 256, V 151936) with random weights; k 8, M 64, P 1, K = D 16;
budgets 16/32/64/128 at batch 1 and 8 (the heap loops over the batch), plus a depth sweep at budget 32.
Each configuration is warmed up (compilation excluded), then timed over several rounds with fresh inputs.

    python experiments/bench_builder.py [--reps 3] [--budgets 16 32 64 128] [--batches 1 8]

Writes experiments/results/bench_builder.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from dtree_jax.builders import BUILDERS, DraftRound, build_tree, lane_widths
from dtree_jax.models.domino_head import DominoHead, gru_step

H, G, E, V, K = 2560, 1024, 256, 151936, 16
K_TOP, M, P, MASK = 8, 64, 1, 151669


def random_model(key) -> tuple[DominoHead, jax.Array]:
    ks = jax.random.split(key, 5)

    def w(k, shape):
        return jax.random.normal(k, shape, jnp.float32) / np.sqrt(shape[0])

    head = DominoHead(
        w(ks[0], (H, 3 * G)), w(ks[1], (G, 3 * G)), w(ks[2], (H + G, E)), w(ks[3], (V, E)) * 4.0
    )
    return head, jax.random.normal(ks[4], (V, H), jnp.float32) * 0.02


def random_round(head, embed, key, batch) -> DraftRound:
    ks = jax.random.split(key, 3)
    ph = jax.random.normal(ks[0], (batch, K, H), jnp.float32)
    base = jax.random.normal(ks[1], (batch, K, V), jnp.float32) * 3.0
    root = jax.random.randint(ks[2], (batch,), 0, V, dtype=jnp.int32)
    return DraftRound(ph, base, gru_step(head, jnp.zeros((batch, G)), embed[root]), root)


def time_builders(rounds, head, embed, budget, max_depth, reps):
    """Warm both builders up, then time them alternately (fair under background load): {builder: stats}."""

    def run(builder, rnd):
        tree = build_tree(
            "dominotree", rnd, head, embed, budget=budget, node_topk=K_TOP, corr_topm=M, pure_draft_prefix_len=P, max_depth=max_depth,
            mask_token_id=MASK, builder=builder,
        )
        return jax.block_until_ready(tree)

    stats = {}
    for builder in BUILDERS:
        t0 = time.perf_counter()
        stats[builder] = {"first_call_s": 0.0, "times_s": [], "tree": run(builder, rounds[0])}
        stats[builder]["first_call_s"] = time.perf_counter() - t0
    for i in range(reps):
        for builder in BUILDERS:
            t0 = time.perf_counter()
            stats[builder]["tree"] = run(builder, rounds[(i + 1) % len(rounds)])
            stats[builder]["times_s"].append(time.perf_counter() - t0)
    return stats


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--budgets", type=int, nargs="+", default=[16, 32, 64, 128])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--depths", type=int, nargs="+", default=[4, 8, 16], help="sweep at budget 32, batch 1")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "bench_builder.json"))
    args = ap.parse_args()

    head, embed = random_model(jax.random.key(0))
    machine = {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "jax": jax.__version__,
        "device": str(jax.devices()[0].device_kind),
        "backend": jax.default_backend(),
        "load_avg_at_start": os.getloadavg(),
    }
    print(json.dumps(machine))
    grid = [(b, bs, K) for bs in args.batches for b in args.budgets]
    grid += [(32, 1, d) for d in args.depths if d != K]
    rows = []
    print(f"{'batch':>5} {'budget':>6} {'D':>3} {'heap ms':>9} {'frontier ms':>11} {'ratio':>6} {'ratio(min)':>10}")
    for budget, batch, depth in grid:
        rounds = [random_round(head, embed, jax.random.key(100 + i), batch) for i in range(2)]
        st = time_builders(rounds, head, embed, budget, depth, args.reps)
        same = bool(np.array_equal(*(np.asarray(st[b]["tree"].tokens) for b in BUILDERS)))
        heap_s, fr_s = (float(np.median(st[b]["times_s"])) for b in ("heap", "frontier"))
        heap_min, fr_min = (float(np.min(st[b]["times_s"])) for b in ("heap", "frontier"))
        widths = lane_widths(budget, K_TOP, depth)
        row = {
            "batch": batch,
            "budget": budget,
            "max_depth": depth,
            "heap_s": heap_s,
            "frontier_s": fr_s,
            "speedup": heap_s / fr_s,
            "speedup_of_minima": heap_min / fr_min,
            "heap_times_s": st["heap"]["times_s"],
            "frontier_times_s": st["frontier"]["times_s"],
            "heap_first_call_s": st["heap"]["first_call_s"],
            "frontier_first_call_s": st["frontier"]["first_call_s"],
            "same_tokens": same,
            "heap_host_syncs_per_request": budget,
            "frontier_steps": len(widths),
            "heap_gru_steps_per_request": budget * K_TOP,
            "frontier_gru_steps_per_request": sum(widths[1:]),
        }
        rows.append(row)
        print(
            f"{batch:>5} {budget:>6} {depth:>3} {heap_s * 1e3:>9.1f} {fr_s * 1e3:>11.1f}"
            f" {heap_s / fr_s:>6.2f}"
            f" {heap_min / fr_min:>10.2f}{'' if same else '  (trees differ)'}",
            flush=True,
        )
    out = {
        "machine": machine,
        "config": {
            "H": H, "G": G, "E": E, "V": V, "K": K, "node_topk": K_TOP, "corr_topm": M, "pure_draft_prefix_len": P, "reps": args.reps,
            "weights": "random fp32",
            "timed": "build_tree('dominotree') incl. per-round scorer setup; builders alternate per rep",
        },
        "rows": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
