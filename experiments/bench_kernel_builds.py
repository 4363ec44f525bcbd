"""Two versions of the few-row kernel side by side in one process: ``cpu_dot.cc`` at a git revision against the
working tree's, each built and registered under its own FFI names (with ``--avx2``, their AVX2 builds too), timed
on SmolLM2's dense dots (``bench_dots.py``'s program) at the rows a round uses, interleaved.  Separate processes
differ by more than a kernel change on our shared 2-core hosts; one process sees the same host for both.

    python experiments/bench_kernel_builds.py --against 098e6a2 --avx2 --repeats 25
    python experiments/bench_kernel_builds.py --against HEAD --dtype bfloat16 --out /tmp/builds_bf16.json

Every build must give the same outputs, bit for bit (the kernel's sums do not depend on its blocking): the head's
logits and the program's (its random layers overflow in some rows; those compare as NaN); the run stops if they
differ.  Writes experiments/results/bench_kernel_builds.json (medians in ms and all times).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from dtree_jax import cpu_dot, cpu_options  # noqa: E402
from experiments.bench_dots import HIDDEN, LAYERS, SHAPES, VOCAB, dense_dots, parse_dot_args  # noqa: E402
from experiments.bench_round import time_interleaved  # noqa: E402
from experiments.run_experiments import machine  # noqa: E402


def source_at(revision: str, into: pathlib.Path) -> pathlib.Path:
    """``dtree_jax/cpu_dot.cc`` as of ``revision``, written into ``into``."""
    done = subprocess.run(["git", "-C", str(ROOT), "show", f"{revision}:dtree_jax/cpu_dot.cc"], capture_output=True)
    if done.returncode != 0:
        why = (done.stderr.decode(errors="replace").strip().splitlines() or ["git failed"])[-1]
        raise SystemExit(f"bench_kernel_builds.py: no cpu_dot.cc at {revision!r}: {why}")
    path = into / f"cpu_dot_{revision.replace('/', '_')}.cc"
    path.write_bytes(done.stdout)
    return path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", default="HEAD", help="the git revision whose cpu_dot.cc is the baseline")
    parser.add_argument("--avx2", action="store_true", help="also both versions' AVX2 builds")
    args, rows = parse_dot_args(parser, argv, "bench_kernel_builds.json", repeats=25)

    with tempfile.TemporaryDirectory() as tmp:
        sources = {args.against: source_at(args.against, pathlib.Path(tmp)), "working tree": cpu_dot.SOURCE}
        arches = {"": cpu_dot.NATIVE_FLAGS, **({", AVX2": cpu_dot.AVX2_FLAGS} if args.avx2 else {})}
        builds = {}  # label -> {panel dtype: FFI target}
        for isa, arch in arches.items():
            for version, source in sources.items():
                builds[version + isa] = cpu_dot.register_build(f"_build{len(builds)}", source, arch)

    rng = np.random.default_rng(0)
    dtype = jnp.dtype(args.dtype)
    weight = lambda shape: cpu_dot.pack(jnp.asarray(rng.normal(size=shape) * 0.02, dtype))  # noqa: E731
    layers = [{name: weight(shape) for name, shape in SHAPES.items()} for _ in range(LAYERS)]
    head = weight((HIDDEN, VOCAB))
    programs = {}
    for r in rows:
        x = jnp.asarray(rng.normal(size=(r, HIDDEN)), dtype)
        outputs = {}
        for build, targets in builds.items():
            dot = lambda a, w, targets=targets: cpu_dot.fewrow_dot(a, w, targets).astype(a.dtype)  # noqa: E731
            program = cpu_options.compile_baked(lambda *a, dot=dot: dense_dots(*a, dot=dot), (layers, head), x)
            logits = jax.jit(lambda a, targets=targets: cpu_dot.fewrow_dot(a, head, targets))(x)  # [r, VOCAB]
            outputs[build] = (np.asarray(logits), np.asarray(program(x)))
            programs[f"{build}, {r} rows"] = (program, (x,), None)
        first = next(iter(outputs.values()))
        differ = [b for b, out in outputs.items()
                  if not all(np.array_equal(o, f, equal_nan=True) for o, f in zip(out, first))]
        if differ:
            raise SystemExit(f"bench_kernel_builds.py: {differ} give other outputs than {next(iter(outputs))} "
                             f"at {r} rows: the sums must not depend on the version")
    times = time_interleaved(programs, args.repeats)

    table = {r: {b: 1e3 * statistics.median(times[f"{b}, {r} rows"]) for b in builds} for r in rows}
    print("| rows | " + " | ".join(f"{b} ms" for b in builds) + " |")
    print("|---|" + "---|" * len(builds))
    for r in rows:
        print(f"| {r} | " + " | ".join(f"{table[r][b]:.1f}" for b in builds) + " |")
    payload = dict(machine=machine(), against=args.against, dtype=args.dtype, repeats=args.repeats, ms=table,
                   times_s=times)
    pathlib.Path(args.out).write_text(json.dumps(payload, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
