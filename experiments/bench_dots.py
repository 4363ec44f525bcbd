"""SmolLM2-135M's dense dots alone, at the rows a round uses: 30 layers' seven projections (q, k, v, o, gate, up,
down; 538 MB of fp32 with the head) and the 49,152-wide output head, baked in as generations compile, with
XLA's dots (YNNPACK) and with the few-row kernel (``dtree_jax.cpu_dot``), at 1 row (an ``ar`` step) and at a
verify's 5 / 9 / 17 rows.  No attention, norms or trees: what the dots cost against their one-row price.

    python experiments/bench_dots.py --rows 1,5,9,17 --repeats 20
    python experiments/bench_dots.py --dtype bfloat16 --out experiments/results/bench_dots_bf16.json

``--dtype bfloat16``: a bf16 model's dots (bf16 weights and inputs): XLA's bf16 dots, the kernel on the weights'
own bf16 panels, and the kernel on fp32 panels of the same values (``kernel_fp32``: twice the bytes).

Random weights (the dots' cost does not depend on the values); a layer's input is the previous layer's output, as
in the model.  Every program runs once per repeat, interleaved; medians, and ratios to the same dots at 1 row.
Writes experiments/results/bench_dots.json (``kernel`` says which build of the kernel ran).
"""

from __future__ import annotations

import argparse
import json
import operator
import pathlib
import statistics
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from dtree_jax import cpu_dot, cpu_options  # noqa: E402
from experiments.bench_round import time_interleaved  # noqa: E402
from experiments.run_experiments import RESULTS, machine  # noqa: E402

LAYERS, HIDDEN, KV_WIDTH, MLP_WIDTH, VOCAB = 30, 576, 192, 1536, 49152
SHAPES = dict(q=(HIDDEN, HIDDEN), k=(HIDDEN, KV_WIDTH), v=(HIDDEN, KV_WIDTH), o=(HIDDEN, HIDDEN),
              gate=(HIDDEN, MLP_WIDTH), up=(HIDDEN, MLP_WIDTH), down=(MLP_WIDTH, HIDDEN))


def dense_dots(layers, head, x, dot=operator.matmul):  # x [R, HIDDEN] -> [R] (the head's row maxima)
    """The model's dense dots, ``dot(x, w)`` each (``@``: XLA's dots, or the kernel for packed weights)."""
    for w in layers:
        q, k, v = dot(x, w["q"]), dot(x, w["k"]), dot(x, w["v"])
        x = x + dot(q + jnp.concatenate([k, v, k], -1), w["o"])
        x = x + dot(jax.nn.silu(dot(x, w["gate"])) * dot(x, w["up"]), w["down"])
    return jnp.max(dot(x, head), -1)


def parse_dot_args(parser: argparse.ArgumentParser, argv, out: str, repeats: int, rows_always=()):
    """The dense-dot benchmarks' shared flags (--rows, --repeats, --dtype, --out): (args, sorted row counts);
    usage errors, or a host without the kernel, end in one line."""
    always = f" ({', '.join(map(str, rows_always))} always included)" if rows_always else ""
    parser.add_argument("--rows", default="1,5,9,17", help="comma-separated row counts" + always)
    parser.add_argument("--repeats", type=int, default=repeats)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="the weights' dtype")
    parser.add_argument("--out", default=str(RESULTS / out))
    args = parser.parse_args(argv)
    try:
        rows = sorted({*rows_always, *(int(r) for r in args.rows.split(","))})
    except ValueError:
        parser.error(f"--rows wants comma-separated integers, got {args.rows!r}")
    if rows[0] < 1 or args.repeats < 1:
        parser.error("--rows and --repeats must be positive")
    if not cpu_dot.available():
        parser.error(f"this benchmark times the few-row kernel: {cpu_dot.status()}")
    return args, rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    args, rows = parse_dot_args(parser, argv, "bench_dots.json", repeats=20, rows_always=(1,))  # 1 row: the ratios

    rng = np.random.default_rng(0)
    dtype = jnp.dtype(args.dtype)
    layers = [{name: jnp.asarray(rng.normal(size=shape) * 0.02, dtype) for name, shape in SHAPES.items()}
              for _ in range(LAYERS)]
    head = jnp.asarray(rng.normal(size=(HIDDEN, VOCAB)) * 0.02, dtype)
    packed = lambda cast: ([{n: cpu_dot.pack(cast(w)) for n, w in layer.items()} for layer in layers],  # noqa: E731
                           cpu_dot.pack(cast(head)))
    weights = {"ynn": (layers, head), "kernel": packed(lambda w: w)}
    if dtype != jnp.float32:
        weights["kernel_fp32"] = packed(lambda w: w.astype(jnp.float32))
    programs = {}
    for r in rows:
        x = jnp.asarray(rng.normal(size=(r, HIDDEN)), dtype)
        for dots, baked in weights.items():
            program = cpu_options.compile_baked(dense_dots, baked, x)
            jax.block_until_ready(program(x))
            programs[f"{dots}, {r} rows"] = (program, (x,), None)
    times = time_interleaved(programs, args.repeats)

    table = {}
    print("| rows | " + " | ".join(f"{dots} ms | x its 1 row" for dots in weights) + " | kernel / ynn |")
    print("|---|" + "---|---|" * len(weights) + "---|")
    for r in rows:
        ms = {dots: 1e3 * statistics.median(times[f"{dots}, {r} rows"]) for dots in weights}
        one = {dots: 1e3 * statistics.median(times[f"{dots}, 1 rows"]) for dots in weights}
        table[r] = {k: v for dots in weights for k, v in ((f"{dots}_ms", ms[dots]),
                                                          (f"{dots}_x_1_row", ms[dots] / one[dots]))}
        print(f"| {r} | " + " | ".join(f"{ms[dots]:.1f} | {ms[dots] / one[dots]:.2f}x" for dots in weights)
              + f" | {ms['kernel'] / ms['ynn']:.2f} |")
    payload = dict(machine=machine(), kernel=cpu_dot.status(), dtype=args.dtype, repeats=args.repeats, rows=table,
                   times_s=times)
    pathlib.Path(args.out).write_text(json.dumps(payload, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
