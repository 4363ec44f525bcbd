"""Per-layer attention K/V cache shared by the target and the drafter, and its compaction after a verify.

Lengths are not stored here: callers carry ``lens [B]`` (rows committed per request) and advance it
themselves, so dropping rows ("crop") is just not advancing ``lens`` over them.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from dtree_jax.models.config import DecoderConfig
from dtree_jax.models.sharding import axes


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    # per layer [B, S, Hkv * kv_head_repeat, D], RoPE applied
    k: tuple[jax.Array, ...] = axes("batch", None, "cache_kv_heads", None)
    v: tuple[jax.Array, ...] = axes("batch", None, "cache_kv_heads", None)  # per layer [B, S, Hkv * kv_head_repeat, D]

    @property
    def capacity(self) -> int:
        return self.k[0].shape[1]


def init_kv_cache(cfg: DecoderConfig, batch: int, max_len: int) -> KVCache:
    """Zero cache for ``cfg.num_layers`` layers, ``max_len`` rows per request, dtype ``cfg.dtype``."""
    if batch < 1 or max_len < 1:
        raise ValueError(f"batch and max_len must be positive, got {batch}, {max_len}")
    shape = (batch, max_len, cfg.cache_kv_heads, cfg.head_dim)
    zeros = lambda: tuple(jnp.zeros(shape, cfg.dtype) for _ in range(cfg.num_layers))
    return KVCache(k=zeros(), v=zeros())


def causal_prefill(forward, params, cfg, tokens: jax.Array, cache, taps: tuple[int, ...] = ()):
    """The prompt pass of a KV-cache model: one causal ``forward`` of the right-padded ``tokens [B, P]`` from
    row 0.  Outputs at padded positions are garbage, and their K/V rows are never committed (the caller's
    ``lens = prompt_lens``), so no per-request end is needed."""
    b, p = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
    causal = jnp.broadcast_to(jnp.tri(p, dtype=bool), (b, p, p))
    return forward(params, cfg, tokens, positions, cache, jnp.zeros((b,), jnp.int32), causal, taps)


def compact_kv(cache, lens: jax.Array, path: jax.Array, num_emitted: jax.Array):
    """Moves the accepted tree entries to contiguous rows right after each request's prefix.

    Every leaf of ``cache`` is ``[B, L, ...]`` and holds the verified tree's entries at rows
    ``[lens, lens + N)``.  Rows ``lens + path[b, j]`` for ``j < num_emitted[b]`` (root and accepted nodes,
    in path order) are written to ``lens + j``; every other row is unchanged.  The caller then advances
    ``lens`` by ``num_emitted``.
    """
    lens = jnp.asarray(lens, jnp.int32)  # [B]
    path = jnp.asarray(path, jnp.int32)  # [B, N]
    num_emitted = jnp.asarray(num_emitted, jnp.int32)  # [B]
    if path.ndim != 2 or lens.shape != path.shape[:1] or num_emitted.shape != lens.shape:
        raise ValueError(f"need lens [B], path [B, N], num_emitted [B]; got {lens.shape}, {path.shape}, "
                         f"{num_emitted.shape}")
    n = path.shape[1]
    j = jnp.arange(n)
    keep = j[None, :] < num_emitted[:, None]  # [B, N]
    dst = lens[:, None] + j[None, :]
    src = lens[:, None] + jnp.clip(path, 0)

    def move(leaf):
        if leaf.ndim < 2 or leaf.shape[0] != lens.shape[0]:
            raise ValueError(f"cache leaves must be [B, L, ...] with B = {lens.shape[0]}, got {leaf.shape}")
        length = leaf.shape[1]
        take = lambda rows: jnp.take_along_axis(
            leaf, jnp.clip(rows, 0, length - 1).reshape(rows.shape + (1,) * (leaf.ndim - 2)), axis=1
        )
        moved = take(src)
        old = take(dst)
        sel = keep.reshape(keep.shape + (1,) * (leaf.ndim - 2))
        new = jnp.where(sel, moved, old)
        rows = jnp.where(keep, dst, length)  # out-of-range rows are dropped
        return jax.vmap(lambda l, r, v: l.at[r].set(v, mode="drop"))(leaf, rows, new)

    return jax.tree_util.tree_map(move, cache)
