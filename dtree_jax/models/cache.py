"""Per-layer attention K/V cache shared by the target and the drafter.

Lengths are not stored here: callers carry ``lens [B]`` (rows committed per request) and advance it
themselves, so dropping rows ("crop") is just not advancing ``lens`` over them.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from dtree_jax.models.config import Qwen3Config


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    k: tuple[jax.Array, ...]  # per layer [B, S, Hkv, D], RoPE applied
    v: tuple[jax.Array, ...]  # per layer [B, S, Hkv, D]

    @property
    def capacity(self) -> int:
        return self.k[0].shape[1]


def init_kv_cache(cfg: Qwen3Config, batch: int, max_len: int) -> KVCache:
    """Zero cache for ``cfg.num_layers`` layers, ``max_len`` rows per request, dtype ``cfg.dtype``."""
    if batch < 1 or max_len < 1:
        raise ValueError(f"batch and max_len must be positive, got {batch}, {max_len}")
    shape = (batch, max_len, cfg.num_kv_heads, cfg.head_dim)
    zeros = lambda: tuple(jnp.zeros(shape, cfg.dtype) for _ in range(cfg.num_layers))
    return KVCache(k=zeros(), v=zeros())
