"""Verify attention over [committed prefix of per-request length | new tokens with a local mask].

The cache already holds the new tokens' K/V at rows ``[lens, lens + T)`` of each request.  Query ``t`` sees
every cache row below ``lens`` and the new row ``lens + s`` iff ``local_mask[t, s]``: the ancestor-or-self
mask of a draft tree, the causal mask for prefill, or all-true for the drafter's non-causal block.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def reference_tree_attention(
    q: jax.Array,  # [B, T, H, D] queries, RoPE applied
    k: jax.Array,  # [B, S, Hkv, D] key cache (new tokens written at [lens, lens + T))
    v: jax.Array,  # [B, S, Hkv, D] value cache
    lens: jax.Array,  # [B] int32 committed length before the T new tokens
    local_mask: jax.Array,  # [B, T, T] bool visibility among the new tokens
    *,
    scale: float,
) -> jax.Array:  # [B, T, H, D]
    """Pure-jnp GQA attention with fp32 softmax; the XLA path and the oracle of the Pallas kernels."""
    b, t, h, d = q.shape
    s, hkv = k.shape[1], k.shape[2]
    g = h // hkv
    cols = jnp.arange(s, dtype=jnp.int32)[None, :]  # [1, S]
    lens = jnp.asarray(lens, jnp.int32)[:, None]  # [B, 1]
    rel = cols - lens  # [B, S] index into the new tokens
    in_new = (rel >= 0) & (rel < t)
    local = jnp.take_along_axis(
        local_mask.astype(bool), jnp.broadcast_to(jnp.clip(rel, 0, t - 1)[:, None, :], (b, t, s)), axis=2
    )  # [B, T, S]
    visible = (cols < lens)[:, None, :] | (in_new[:, None, :] & local)  # [B, T, S]
    qg = q.reshape(b, t, hkv, g, d)
    logits = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32) * scale
    logits = jnp.where(visible[:, None, None], logits, -jnp.inf)
    probs = jax.nn.softmax(logits, axis=-1)
    probs = jnp.where(jnp.isnan(probs), 0.0, probs)  # a row with nothing visible yields zeros
    out = jnp.einsum("bkgts,bskd->btkgd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out.reshape(b, t, h, d).astype(q.dtype)
