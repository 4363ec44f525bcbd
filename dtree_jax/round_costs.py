"""Seconds per round on this machine, measured the first time a pair runs here and cached (``budget="auto"``).

A drafter's ``calibration.json`` carries tau per budget: a property of the drafter and its target.  What a
round costs belongs to the machine, its jax and the program (weights baked in or not, which dots:
``cpu_options``), so ``budget="auto"`` measures it here: plain ``ar`` (budget 0) and a round of the method at
each candidate budget, at the request's batch, compiled as the generation compiles them, each tree round timed
in pairs with an ar step (``measure``).  The result is cached under ``<cache>/round-costs/``
(``convert.cache_dir()``) by machine, jax version, program and batch, so later runs decide at once.  The context
length is not part of the key: at these lengths a round's cost is the weights' read, and the first request's
shapes are the ones measured (recorded in the file).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
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
    return dict(spec=repr(fields), batch=batch, baked=baked, dots=dots, mesh=repr(spec.mesh), timing=TIMING)


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


def measure(specs: dict[int, loop.Spec], tparams, dparams, inputs: tuple, taus: dict[int, float],
            repeats: int = REPEATS, log=sys.stderr, label: str = "") -> dict[int, float]:
    """Median seconds of one round per budget (``specs[0]`` is plain ar), from the state after prefilling
    ``inputs`` (prompts, lengths, keys, temperature).  Each tree round is timed in pairs with an ar step (ar,
    tree, ar, tree, ...), and its seconds are the median ratio of the pairs times the median of every ar step:
    other work on the machine while one budget is timed slows both sides of its pairs, not that budget alone.
    Tree budgets are measured in increasing order, and measuring stops at the first one whose expected rate
    ``tau / seconds`` falls below the previous tree's (a wider tree costs more a round and gains less tau each
    step); plain ar does not stop it.  ``label`` names what is measured in the progress line."""

    def timed(run) -> float:
        t0 = clock()
        run()
        return clock() - t0

    budgets = sorted(specs)
    ar_times, ratios, best = [], {}, 0.0
    for i, budget in enumerate(budgets):
        if log is not None:
            print(f"\rbudget auto: measuring this machine's round costs (once){label}: budget {budget} "
                  f"({i + 1}/{len(specs)})", end="", file=log, flush=True)
        run = round_program(specs[budget], tparams, dparams, inputs)
        if budget == 0:
            ar, ar_times = run, [timed(run) for _ in range(repeats)]
            continue
        pairs = [(timed(ar), timed(run)) for _ in range(repeats)]
        ar_times += [a for a, _ in pairs]
        ratios[budget] = statistics.median(t / a for a, t in pairs)
        rate = taus[budget] / ratios[budget]
        if rate < best:
            break
        best = rate
    if log is not None:
        print("\r" + " " * 100 + "\r", end="", file=log, flush=True)
    ar_seconds = statistics.median(ar_times)
    return {0: ar_seconds, **{b: r * ar_seconds for b, r in ratios.items()}}


def seconds_per_round(specs: dict[int, loop.Spec], tparams, dparams, inputs: tuple, taus: dict[int, float],
                      cache: Path | None, label: str = "") -> tuple[dict[int, float], str]:
    """``measure``'s result for this machine and program, from the cache when measured before; with where
    it came from ("measured now" or the cache file)."""
    batch = int(inputs[0].shape[0])
    baked = cpu_options.bakes_weights(specs[0].mesh, tparams, dparams)
    key = dict(machine=machine(), program=program_key(specs[max(specs)], batch, baked), budgets=sorted(specs))
    file = cache_file(cache, key) if cache is not None else None
    if file is not None and file.is_file():
        try:
            return {int(b): float(s) for b, s in json.loads(file.read_text())["seconds"].items()}, str(file)
        except (ValueError, KeyError, TypeError, AttributeError):
            pass  # a damaged entry is measured again and replaced
    seconds = measure(specs, tparams, dparams, inputs, taus, label=label)
    if file is not None:
        file.parent.mkdir(parents=True, exist_ok=True)
        payload = dict(key, seconds=seconds, cache_len=specs[max(specs)].cache_len, measured=time.time())
        tmp = file.with_suffix(f".tmp-{os.getpid()}")
        tmp.write_text(json.dumps(payload, indent=1))
        os.replace(tmp, file)  # atomic: concurrent first runs each write a whole file
    return seconds, "measured now"
