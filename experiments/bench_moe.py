"""The MoE MLP's cost at tree-verify widths on this CPU (issue 27): one Qwen3-30B-A3B layer (hidden 2048, 128
experts, top 8, expert width 768; fp32 on CPU, weights as arguments) at 1, 5 and 33 tokens, three ways of
running the routed experts (``models.moe.moe_mlp``'s ``grouping``; every token routed on its own, no capacity,
nothing dropped):

* ``ragged``: the token-expert pairs sorted by expert, ``lax.ragged_dot`` over the group sizes (TPU, GPU);
* ``gather``: each pair's expert weights gathered (``w[top_e]``, ``[T * k, H, I]``) and applied per pair;
* ``dense``: every expert on every token, weighted by the routing (zero for experts not chosen).

All three give the same output (checked).  Reported: median milliseconds over ``--repeats`` interleaved calls,
the ratio to one token, the distinct experts the tokens touch and the fp32 bytes those experts hold (what a
memory-bound step must read).  Results: ``experiments/results/bench_moe.json``.

``placement`` (no timing; a count over random routings): on a ``model`` axis of m devices, what the busiest
device must read of the routed experts' weights, in whole experts, when the experts are split by their
intermediate dimension (every device 1/m of every routed expert: ``models.moe``'s layout) and when they are
placed whole, E/m per device (expert parallelism: the device holding the most routed experts sets the step's
time), for Qwen3-30B-A3B (128 experts, top 8) and Qwen3.6-35B-A3B (256, top 8), each token routed uniformly.

    python experiments/bench_moe.py [--repeats 30]
    python experiments/bench_moe.py --placement   # only the placement counts (seconds), into the same file
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import statistics
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from dtree_jax.models import moe  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "bench_moe.json"
H, E, K, I = 2048, 128, 8, 768  # Qwen3-30B-A3B
WIDTHS = (1, 5, 33)
MODEL_AXIS = (4, 8, 16)


def placement(experts: int, top_k: int, trials: int = 2000, seed: int = 0) -> list[dict]:
    """Per verify width and model-axis size: the mean over ``trials`` uniform routings of the busiest device's
    read in whole experts, sliced (distinct routed experts / m) and whole (max routed experts on one device)."""
    rng = np.random.default_rng(seed)
    rows = []
    for width in WIDTHS:
        chosen = np.argsort(rng.random((trials, width, experts)), axis=-1)[..., :top_k].reshape(trials, -1)
        touched = np.zeros((trials, experts), bool)
        np.put_along_axis(touched, chosen, True, axis=1)
        for m in MODEL_AXIS:
            sliced = touched.sum(1) / m
            whole = touched.reshape(trials, m, experts // m).sum(2).max(1)
            rows.append(dict(tokens=width, model=m, sliced=float(sliced.mean()), whole=float(whole.mean()),
                             whole_vs_sliced=float((whole / sliced).mean())))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--placement", action="store_true", help="only the placement counts (no timing)")
    args = ap.parse_args(argv)
    placements = {"qwen3-30b-a3b": placement(128, 8), "qwen3.6-35b-a3b": placement(256, 8)}
    if args.placement:
        results = json.loads(args.out.read_text()) if args.out.is_file() else {}
        args.out.write_text(json.dumps(dict(results, placement=placements), indent=1) + "\n")
        return 0
    keys = jax.random.split(jax.random.key(0), 5)
    scale = lambda n: n ** -0.5  # noqa: E731
    p = moe.MoEParams(
        router=jax.random.normal(keys[0], (H, E)) * scale(H),
        w_gate=jax.random.normal(keys[1], (E, H, I)) * scale(H),
        w_up=jax.random.normal(keys[2], (E, H, I)) * scale(H),
        w_down=jax.random.normal(keys[3], (E, I, H)) * scale(I),
        shared=None, shared_gate=None,
    )
    ways = {g: jax.jit(functools.partial(moe.moe_mlp, top_k=K, norm_topk_prob=True, grouping=g))
            for g in moe.GROUPINGS}
    rows = []
    for m in WIDTHS:
        x = jax.random.normal(jax.random.fold_in(keys[4], m), (m, H))
        outs = {name: np.asarray(fn(p, x)) for name, fn in ways.items()}  # compiles; the outputs agree
        for name, out in outs.items():
            np.testing.assert_allclose(out, outs["ragged"], rtol=2e-3, atol=2e-3, err_msg=name)
        times = {name: [] for name in ways}
        for _ in range(args.repeats):  # interleaved
            for name, fn in ways.items():
                t0 = time.perf_counter()
                jax.block_until_ready(fn(p, x))
                times[name].append(time.perf_counter() - t0)
        touched = int(np.unique(np.asarray(moe.route(p, x, K, True)[1])).size)
        rows.append(dict(tokens=m, experts_touched=touched, touched_mib=touched * 3 * H * I * 4 / 2**20,
                         ms={name: 1e3 * statistics.median(t) for name, t in times.items()},
                         spread_ms={name: [1e3 * min(t), 1e3 * max(t)] for name, t in times.items()}))
        print(f"{m:3d} tokens, {touched:3d} experts ({rows[-1]['touched_mib']:.0f} MiB): " +
              ", ".join(f"{n} {v:.2f} ms" for n, v in rows[-1]["ms"].items()), flush=True)
    for r in rows:
        r["vs_one_token"] = {n: r["ms"][n] / rows[0]["ms"][n] for n in ways}
    machine = dict(host=platform.node(), cpu=platform.processor() or platform.machine(), cores=os.cpu_count(),
                   jax=jax.__version__)
    args.out.write_text(json.dumps(dict(machine=machine, layer=dict(hidden=H, experts=E, top_k=K, expert_width=I,
                                                                     dtype="float32"),
                                        repeats=args.repeats, rows=rows,
                                        placement=placements), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
