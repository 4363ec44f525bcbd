"""Do a few rows of a matmul use both cores on XLA:CPU?  SmolLM2-135M's 30 MLPs (up [576, 1536], tanh, down
[1536, 576], fp32, one layer after the other), baked in with YNNPACK as generations compile
(``dtree_jax.cpu_options``), at 1 and 5 rows: each layer's weights whole, or split along the inner dimension
into two halves (two independent up-tanh-down chains per layer, the same sum, that XLA:CPU's runtime may run
on two cores at once; the layers stay sequential, as in the model).

    python experiments/bench_dot_split.py --repeats 40

A 5-row verify of SmolLM2 costs 0.9-1.0x an ``ar`` step on one host of our kind and 1.37x on another
(``bench_round.py``); if the multi-row dots run on one core, the second host's single-core memory bandwidth
would explain it, and halves would run faster there.  Interleaved repeats, medians, ratios to the whole
weights at 1 row.  Writes experiments/results/bench_dot_split.json.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from dtree_jax import cpu_options  # noqa: E402
from experiments.run_experiments import RESULTS, machine  # noqa: E402

LAYERS, HIDDEN, WIDTH = 30, 576, 1536


def mlps(layers, x):  # layers: per layer a tuple of (up [H, w], down [w, H]) parts; x [R, H] -> [R, H]
    for parts in layers:
        x = x + sum(jnp.tanh(x @ up) @ down for up, down in parts)
    return x


def programs(rows: tuple[int, ...], rng: np.random.Generator) -> dict:
    def weight(*shape):
        return jnp.asarray(rng.normal(size=shape) * 0.02, jnp.float32)

    whole = tuple(((weight(HIDDEN, WIDTH), weight(WIDTH, HIDDEN)),) for _ in range(LAYERS))
    half = WIDTH // 2
    halves = tuple(((up[:, :half], down[:half]), (up[:, half:], down[half:])) for ((up, down),) in whole)
    out = {}
    for r in rows:
        x = jnp.asarray(rng.normal(size=(r, HIDDEN)), jnp.float32)
        for name, layers in (("whole", whole), ("halves", halves)):
            program = cpu_options.compile_baked(mlps, (layers,), x)
            jax.block_until_ready(program(x))
            out[f"{name}, {r} row{'s' if r > 1 else ''}"] = (program, x)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--out", default=str(RESULTS / "bench_dot_split.json"))
    args = parser.parse_args(argv)
    compiled = programs((1, 5), np.random.default_rng(0))
    times = {name: [] for name in compiled}
    for _ in range(args.repeats):
        for name, (program, x) in compiled.items():
            t0 = time.perf_counter()
            jax.block_until_ready(program(x))
            times[name].append(time.perf_counter() - t0)
    base = statistics.median(times["whole, 1 row"])
    rows = {name: dict(ms=1e3 * statistics.median(ts), x_whole_1_row=statistics.median(ts) / base)
            for name, ts in times.items()}
    print("| weights, rows | ms (median) | x whole at 1 row |\n|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {r['ms']:.2f} | {r['x_whole_1_row']:.2f}x |")
    payload = dict(machine=machine(), layers=LAYERS, shape=[HIDDEN, WIDTH], repeats=args.repeats, rows=rows,
                   times_s=times)
    pathlib.Path(args.out).write_text(json.dumps(payload, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
