"""What a generation returns: ``Generation`` (tokens, per-request statistics, timings) and ``collect``, which
reads it off the loop's final state."""

from __future__ import annotations

import dataclasses

from dtree_jax import loop
from dtree_jax.models import sharding


@dataclasses.dataclass
class Generation:
    tokens: list[list[int]]  # generated ids per request (stop token included, nothing after it)
    # per request: generated, rounds, tau, seconds (until this request stopped: the batch's wall time times
    # its share of the rounds), tokens_per_second, stop_reason, method (the one run: "ar" where budget "auto"
    # chose not to speculate), budget (tree methods)
    stats: list[dict]
    compile_seconds: float  # 0.0 when this generation was already compiled in this process
    seconds: float  # wall time of the whole batch (goodput = sum of generated / seconds)
    stage_seconds: dict | None = None  # instrumented mode: mean seconds per round of each stage
    # Instrumented mode: per round, per request: active, lens (committed length), the tree's tokens and
    # parents (node 0 = the root) and the number of tokens emitted.
    round_trees: list[dict] | None = None
    texts: list[str] | None = None  # text prompts only: ``tokens`` decoded (special tokens skipped)
    auto: str | None = None  # budget="auto": what it chose and why, in one line
    cpu_dots: str = "xla"  # the dense dots that ran: "kernel" (``cpu_dot``'s, baked CPU programs) or "xla"
    ar_cpu_dots: str = "xla"  # those a fair plain-ar baseline runs here (budget="auto": its fastest measured step)


def collect(state: loop.DecodeState, spec: loop.Spec, *, seconds: float) -> tuple[list[list[int]], list[dict]]:
    """Each request's generated ids and statistics from the final state; ``seconds`` is the batch's wall time
    (a request's share: rounds run in lockstep, so it was done after its own rounds of the batch's)."""
    out, out_len = sharding.to_host(state.out), sharding.to_host(state.out_len)
    rounds, reasons = sharding.to_host(state.rounds), sharding.to_host(state.stop_reason)
    tokens, stats = [], []
    for i in range(len(out)):
        toks = out[i, : out_len[i]].tolist()
        tokens.append(toks)
        own = seconds * (int(rounds[i]) + 1) / (int(rounds.max()) + 1)  # its rounds (+ the prefill)
        stats.append(dict(
            generated=len(toks),
            rounds=int(rounds[i]),
            tau=float((len(toks) - 1) / rounds[i]) if rounds[i] else float("nan"),
            seconds=own,
            tokens_per_second=len(toks) / own if own > 0 else float("nan"),
            stop_reason=loop.STOP_REASONS[int(reasons[i])],
            method=spec.method,
            budget=spec.budget if spec.record.tree else None,
        ))
    return tokens, stats
