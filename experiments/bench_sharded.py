"""Sharded-run overhead at the tiny shapes: the shipped tiny pair on one device and on meshes of 8 forced host
devices, side by side in one process (each generation compiled first, then timed; best of ``--repeats``).

    python experiments/bench_sharded.py        # -> experiments/results/bench_sharded.json

The meshes exist to prove correctness on a CPU (8 "devices" share 2 cores here), not speed; the figure of merit
is the ratio to one device, and every row's tokens must equal the one-device run's.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402

from dtree_jax import api, cli  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "bench_sharded.json"
PROMPT = "def fibonacci(n):\n    "


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--methods", nargs="+", default=["ar", "dominotree"])
    p.add_argument("--meshes", nargs="+", default=["data=1,model=8", "data=2,model=4", "data=8,model=1"])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, default=RESULTS)
    a = p.parse_args(argv)
    root = cli.checkpoints_dir()
    target, drafter = api.load_model(root / "tiny-target"), api.load_model(root / "tiny-domino")
    prompts = [list((PROMPT + str(i)).encode()) for i in range(a.batch)]
    rows = []
    for method in a.methods:
        base = None
        for mesh in [None] + a.meshes:
            run = lambda: api.generate(target, prompts, method, drafter, budget=8, stop_ids=(),  # noqa: E731
                                       max_new_tokens=a.max_new_tokens, mesh=mesh)
            first = run()
            best = min(run().seconds for _ in range(a.repeats))
            if mesh is None:
                base = (first.tokens, best)
            rows.append(dict(method=method, batch=a.batch, mesh=mesh or "one device", seconds=best,
                             ratio=best / base[1], same_tokens=first.tokens == base[0]))
            print(f"{method:11s} {rows[-1]['mesh']:16s} {best:.3f} s  {rows[-1]['ratio']:.2f}x  "
                  f"same: {rows[-1]['same_tokens']}", file=sys.stderr, flush=True)
    machine = f"{os.cpu_count()} CPU cores, {len(jax.devices())} host devices, jax {jax.__version__}, " \
              f"{platform.processor() or platform.machine()}"
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(dict(machine=machine, rows=rows), indent=1) + "\n")
    return 0 if all(r["same_tokens"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
