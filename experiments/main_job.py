"""The main job as a user runs it, several times: ``dtree-jax generate --json`` (the default request, or the
chat requests given) in fresh processes from another directory, each printing the speedup over ``ar`` from
interleaved timed pairs (``--timing-pairs``), with ``--budget auto`` (the default) or a fixed budget.

    python experiments/main_job.py                               # 3 runs of the default request
    python experiments/main_job.py --runs 2 --budget 4 --prompt "Write a Python class for a stack."

The first run may measure this machine's round costs for ``--budget auto`` (cached afterwards, under a fresh
``DTREE_JAX_CACHE`` unless ``--keep-cache``).  Writes experiments/results/main_job.json (every run's JSON line,
including all its timings) and prints one line per run.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "experiments" / "results"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--budget", default="auto")
    parser.add_argument("--prompt", action="append", help="chat request (repeatable; default: the default request)")
    parser.add_argument("--timing-pairs", type=int, default=5)
    parser.add_argument("--keep-cache", action="store_true", help="use the user's cache (round costs measured before)")
    parser.add_argument("--out", default=str(RESULTS / "main_job.json"))
    args = parser.parse_args(argv)
    env = dict(os.environ, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"))
    cache = None
    if not args.keep_cache:
        cache = tempfile.mkdtemp(prefix="dtree-jax-cache-")
        env["DTREE_JAX_CACHE"] = cache
    try:
        rows = []
        for prompt in args.prompt or [None]:
            for run in range(args.runs):
                cmd = [sys.executable, "-m", "dtree_jax.cli", "generate", "--json", "--budget", args.budget,
                       "--timing-pairs", str(args.timing_pairs)] + (["--prompt", prompt] if prompt else [])
                t0 = time.perf_counter()
                out = subprocess.run(cmd, capture_output=True, text=True, cwd=tempfile.gettempdir(), env=env)
                wall = time.perf_counter() - t0
                if out.returncode != 0:
                    print(out.stderr[-2000:], file=sys.stderr)
                    return 1
                row = json.loads(out.stdout.strip().splitlines()[-1])
                row.update(run=run, wall_seconds=wall)
                rows.append(row)
                ar = sorted(r[0] for r in row["timing"]["ar_tokens_per_second"])
                low, high = row["speedup_spread"]
                print(f"run {run}: {row['method']} budget {row['budget']}, tau {row['tau']:.2f}, "
                      f"{row['speedup_vs_ar']:.2f}x ar (spread {low:.2f}-{high:.2f}; "
                      f"ar median {ar[len(ar) // 2]:.1f} tok/s; dots {row['cpu_dots']}, ar's {row['ar_cpu_dots']}), "
                      f"same output as ar: "
                      f"{'yes' if row['same_output_as_ar'] else 'NO'}, {wall:.0f} s wall | {row['auto']}", flush=True)
        os.environ.update(env)  # the machine record names the runs' backend (unprobed) and their dots
        from dtree_jax import cpu_dot
        from experiments.run_experiments import machine

        payload = dict(machine=machine(), kernel=cpu_dot.status(), budget=args.budget,
                       timing_pairs=args.timing_pairs, fresh_cache=cache is not None, runs=rows)
        pathlib.Path(args.out).write_text(json.dumps(payload, indent=1))
    finally:
        if cache is not None:
            shutil.rmtree(cache, ignore_errors=True)  # these runs' converted GGUF and round costs
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
