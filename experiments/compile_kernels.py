"""Compiles every kernel configuration we claim for every chip we claim, on this CPU, with the chips' own compilers
(``dtree_jax.aot.compile_kernel``), and records per configuration whether it compiles, the compile seconds and the
on-chip memory it allocates (TPU scoped VMEM, GPU shared memory per block).

    python experiments/compile_kernels.py            # the whole matrix (about 25 min on 2 cores), resumable
    python experiments/compile_kernels.py --table    # the README table from the results

Matrix: tree attention at head sizes 64 / 128 / 256 (``aot.ATTENTION_HEADS``), bf16 and fp32 caches, contexts 4K
and 32K, budgets 4 / 16 / 64 / 128 (nodes = budget + 1), batch 1 and 8, on TPU v4, v5e, v5p, v6e (one chip of
each) and H100 / H200; the tree-GDN kernel (Qwen3.6-27B's linear-attention shape) at the same dtypes, budgets and
batches on the TPUs (GPUs run its XLA path).  The on-chip memory depends on the tiles, not on the context or the
batch (those set the grid), so it is measured once per (chip, kernel, head size, dtype, budget).  Results:
``experiments/results/compile_kernels.json`` (rows are kept across runs; a row already there is not recompiled).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from dtree_jax import chips  # noqa: E402

chips.allow_compile_only()

import jax  # noqa: E402

from dtree_jax import aot  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "compile_kernels.json"
CHIPS = ("v4-8", "v5e-1", "v5p-8", "v6e-1", "h100", "h200")
BUDGETS = aot.KERNEL_MATRIX["budgets"]


def key(chip: str, c: aot.KernelConfig) -> str:
    return f"{chip}/{c.kernel}/d{c.head_dim}/{c.dtype}/n{c.nodes}/s{c.context}/b{c.batch}"


def run(args) -> int:
    old = json.loads(args.out.read_text()) if args.out.is_file() else {}
    rows = {r["key"]: r for r in old.get("rows", [])}
    todo = [(name, c) for name in args.chips for c in aot.kernel_configs(chips.get(name).platform)]
    measured = {r["measured_as"] for r in rows.values() if r.get("onchip_bytes") is not None}
    t0 = time.perf_counter()
    for i, (name, c) in enumerate(todo):
        k = key(name, c)
        if k in rows:
            continue
        tile = f"{name}/{c.kernel}/d{c.head_dim}/{c.dtype}/n{c.nodes}"  # what sets the on-chip memory
        row = aot.compile_kernel(c, name, measure=tile not in measured)
        if row.get("onchip_bytes") is not None:
            measured.add(tile)
        rows[k] = dict(key=k, chip=name, measured_as=tile, **dataclasses.asdict(c), **row)
        print(f"[{i + 1}/{len(todo)} {time.perf_counter() - t0:.0f} s] {k}: "
              f"{'compiles' if row['compiles'] else 'FAILS: ' + row['error']}"
              + (f", on-chip {row['onchip_bytes'] / 1024:.1f} KiB" if row.get("onchip_bytes") else ""), flush=True)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        machine = dict(cpu_cores=os.cpu_count(), jax=jax.__version__)
        args.out.write_text(json.dumps(dict(machine=machine, rows=sorted(rows.values(), key=lambda r: r["key"])),
                                       indent=1) + "\n")
    failed = [r["key"] for r in rows.values() if not r["compiles"]]
    print(f"{len(rows)} configurations, {len(failed)} refused" + (f": {failed}" if failed else ""))
    return 1 if failed else 0


def table(path: Path) -> str:
    """Markdown: per kernel, head size and dtype (rows) and chip (columns), the on-chip memory in KiB at budget
    4 and at budget 128, and how many configurations compiled."""
    rows = json.loads(path.read_text())["rows"]
    chips_seen = [c for c in CHIPS if any(r["chip"] == c for r in rows)]
    cells: dict = {}
    for r in rows:
        cell = cells.setdefault((r["kernel"], r["head_dim"], r["dtype"]), {}).setdefault(r["chip"], dict(ok=0, n=0))
        cell["n"] += 1
        cell["ok"] += r["compiles"]
        if r.get("onchip_bytes"):
            cell[r["nodes"] - 1] = r["onchip_bytes"] / 1024
    lo, hi = BUDGETS[0], BUDGETS[-1]
    lines = ["| kernel | head | dtype | " + " | ".join(chips_seen) + " |", "|---|---|---|" + "---|" * len(chips_seen)]
    for (kernel, d, dtype), per_chip in sorted(cells.items()):
        out = []
        for c in chips_seen:
            cell = per_chip.get(c)
            if cell is None:
                out.append("XLA path" if kernel == "tree_gdn" else "-")
                continue
            mem = f"{cell[lo]:.0f} / {cell[hi]:.0f}" if lo in cell and hi in cell else "?"
            out.append(mem + ("" if cell["ok"] == cell["n"] else f" ({cell['n'] - cell['ok']} refused)"))
        lines.append(f"| {kernel} | {d} | {dtype} | " + " | ".join(out) + " |")
    total = len(rows)
    ok = sum(r["compiles"] for r in rows)
    return "\n".join(lines) + f"\n\n{ok} of {total} configurations compiled."


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--chips", nargs="+", default=CHIPS, choices=CHIPS)
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--table", action="store_true", help="print the README table from --out and exit")
    args = p.parse_args(argv)
    if args.table:
        print(table(args.out))
        return 0
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
