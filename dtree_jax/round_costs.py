"""Seconds per round on this machine, measured the first time a pair runs here and cached (``budget="auto"``).

A drafter's ``calibration.json`` carries tau per budget: a property of the drafter and its target.  What a
round costs belongs to the machine, its jax, this code and the program (weights baked in or not, which dots:
``cpu_options``), so ``budget="auto"`` measures it here: plain ``ar`` (budget 0) and a round of the method at
each candidate budget, at the request's batch, compiled as the generation compiles them, for each way of
compiling it compares (the few-row kernel's dots and XLA's), every program timed in pairs with one reference ar
step (``measure``).  The result is cached under ``<cache>/round-costs/`` (``convert.cache_dir()``) by machine,
jax version, the code's digest, programs and batch, so later runs decide at once.  The context length is not
part of the key: at these lengths a round's cost is the weights' read, and the first request's shapes are the
ones measured (recorded in the file).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import jax

from dtree_jax import cpu_dot, cpu_options, loop

REPEATS = 5
TIMING = "tree rounds interleaved with ar steps"  # how ``measure`` times; part of the cache key
clock = time.perf_counter


def machine() -> dict:
    """What the costs belong to: the CPU model and count, the backend and its devices, jax's version."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return dict(cpu=cpu, cpus=os.cpu_count(), backend=jax.default_backend(), device=jax.devices()[0].device_kind,
                devices=jax.device_count(), jax=jax.__version__)


def program_key(spec: loop.Spec, batch: int, baked: bool) -> dict:
    """The parts of a generation that set its round's cost (the context length, stop ids and output length
    left out: see the module docstring; the implementations by name, not by where they are installed)."""
    name = lambda impl: getattr(impl, "__name__", type(impl).__name__)  # noqa: E731
    fields = dataclasses.replace(spec, target=name(spec.target), drafter=name(spec.drafter), max_new_tokens=0,
                                 cache_len=0, stop_ids=(), budget=0, stream=False, mesh=None)
    dots = cpu_dot.status() if baked and spec.cpu_kernel else "xla"  # the few-row kernel (its build), or XLA's
    if dots != "xla" and not cpu_options.kernel_attention():
        dots += " + XLA's attention"
    return dict(spec=repr(fields), batch=batch, baked=baked, dots=dots, mesh=repr(spec.mesh))


def cache_file(cache: Path, key: dict) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]
    return cache / "round-costs" / f"{digest}.json"


def round_program(spec: loop.Spec, tparams, dparams, inputs: tuple) -> Callable[[], Any]:
    """One round of ``spec`` from the state after prefilling ``inputs``, compiled as generations compile it and
    run once untimed (a fresh program's first run is slower); returns the call that runs it."""
    dp = dparams if spec.record.drafts else None
    state = loop.prefill_on_device(spec, tparams, dp, *inputs)
    program = cpu_options.compile_here(loop.decode_round, spec, (tparams, dp), inputs[-1], state, mesh=spec.mesh,
                                       bake=functools.partial(loop.unshared_heads, spec), kernel=spec.cpu_kernel)
    run = lambda: jax.block_until_ready(program(tparams, dp, inputs[-1], state))  # noqa: E731
    run()
    return run


def measure(variants: dict[str, dict[int, loop.Spec]], tparams, dparams, inputs: tuple, taus: dict[int, float],
            repeats: int = REPEATS, log=sys.stderr) -> dict[str, dict[int, float]]:
    """Median seconds of one round per variant and budget (each variant's ``specs[0]`` is its plain ar step; a
    variant is one way of compiling, e.g. the few-row kernel's dots or XLA's), from the state after prefilling
    ``inputs`` (prompts, lengths, keys, temperature).

    One program is the reference: the first variant's ar step.  Every other program (each tree round, the other
    variants' ar steps) is timed in pairs with it (reference, program, reference, program, ...), and its seconds
    are the median ratio of its pairs times the median of every reference step.  Other work on the machine while
    one program is timed slows both sides of its pairs, not that program alone, so budgets and variants compare
    on one footing.  Each variant's tree budgets are measured in increasing order, and its measuring stops at
    the first whose expected rate ``tau / seconds`` falls below its previous tree's (a wider tree costs more a
    round and gains less tau each step)."""

    def timed(run) -> float:
        t0 = clock()
        run()
        return clock() - t0

    programs = [(name, budget) for name, specs in variants.items() for budget in sorted(specs)]
    first = programs[0]
    reference = round_program(variants[first[0]][first[1]], tparams, dparams, inputs)
    reference_times = [timed(reference) for _ in range(repeats)]
    ratios = {name: {} for name in variants}
    stopped, best = set(), dict.fromkeys(variants, 0.0)
    for i, (name, budget) in enumerate(programs[1:], 2):
        if name in stopped:
            continue
        if log is not None:
            what = f"{name}, " if len(variants) > 1 else ""
            print(f"\rbudget auto: measuring this machine's round costs (once): {what}"
                  f"{'ar' if budget == 0 else f'budget {budget}'} ({i}/{len(programs)})", end="", file=log, flush=True)
        run = round_program(variants[name][budget], tparams, dparams, inputs)
        pairs = [(timed(reference), timed(run)) for _ in range(repeats)]
        reference_times += [a for a, _ in pairs]
        ratios[name][budget] = statistics.median(t / a for a, t in pairs)
        if budget:
            rate = taus[budget] / ratios[name][budget]
            if rate < best[name]:
                stopped.add(name)
            best[name] = max(best[name], rate)
    if log is not None:
        print("\r" + " " * 100 + "\r", end="", file=log, flush=True)
    seconds = statistics.median(reference_times)
    ratios[first[0]][0] = 1.0
    return {name: {b: r * seconds for b, r in sorted(rs.items())} for name, rs in ratios.items()}


@functools.cache
def code_digest() -> str:
    """A digest of the package's source (its Python, C++ and Pallas files, by path inside the package and
    content): costs measured by one version of the code are not read by another."""
    digest = hashlib.sha256()
    for package in ("dtree_jax", "pallas_kernels"):
        root = Path(importlib.import_module(package).__file__).parent
        for path in sorted(p for p in root.rglob("*") if p.suffix in (".py", ".cc", ".h") and p.is_file()):
            digest.update(f"{package}/{path.relative_to(root).as_posix()}\0".encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def seconds_per_round(variants: dict[str, dict[int, loop.Spec]], tparams, dparams, inputs: tuple,
                      taus: dict[int, float], cache: Path | None) -> tuple[dict[str, dict[int, float]], str]:
    """``measure``'s result for this machine, this code and these programs, from the cache when measured
    before; with where it came from ("measured now" or the cache file).  The variants are measured together and
    cached as one entry, so they are never compared across measurements taken at different times."""
    batch = int(inputs[0].shape[0])
    baked = cpu_options.bakes_weights(next(iter(variants.values()))[0].mesh, tparams, dparams)
    key = dict(machine=machine(), code=code_digest(), timing=TIMING,
               programs={name: program_key(specs[max(specs)], batch, baked) for name, specs in variants.items()},
               budgets={name: sorted(specs) for name, specs in variants.items()})
    file = cache_file(cache, key) if cache is not None else None
    if file is not None and file.is_file():
        try:
            seconds = json.loads(file.read_text())["seconds"]
            got = {name: {int(b): float(s) for b, s in seconds[name].items()} for name in variants}
            if all(0 in got[name] for name in variants):
                return got, str(file)
        except (ValueError, KeyError, TypeError, AttributeError):
            pass  # a damaged entry is measured again and replaced
    seconds = measure(variants, tparams, dparams, inputs, taus)
    if file is not None:
        file.parent.mkdir(parents=True, exist_ok=True)
        cache_len = max(specs[max(specs)].cache_len for specs in variants.values())
        payload = dict(key, seconds=seconds, cache_len=cache_len, measured=time.time())
        tmp = file.with_suffix(f".tmp-{os.getpid()}")
        tmp.write_text(json.dumps(payload, indent=1))
        os.replace(tmp, file)  # atomic: concurrent first runs each write a whole file
    return seconds, "measured now"
