"""The gated delta rule's per-token math (fp32): l2 normalisation of q/k, the head map onto the v-heads and one
recurrent step.  Shared by the tree-GDN kernel's oracle and by the models' GDN layers."""

from __future__ import annotations

import jax
import jax.numpy as jnp

HIGHEST = jax.lax.Precision.HIGHEST  # GDN state math is fp32; keep TPU matmuls at full precision
L2NORM_EPS = 1e-6


def fp32_einsum(spec: str, *xs: jax.Array) -> jax.Array:
    """``jnp.einsum`` at full precision with an fp32 result."""
    return jnp.einsum(spec, *xs, precision=HIGHEST, preferred_element_type=jnp.float32)


def l2norm(x: jax.Array, eps: float = L2NORM_EPS) -> jax.Array:  # [..., d] -> [..., d] fp32
    """``x * rsqrt(sum(x^2) + eps)`` over the last axis, in fp32 (eps inside the rsqrt, as FLA/HF)."""
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def normalize_qk(
    q: jax.Array,  # [..., Hk, dk]
    k: jax.Array,  # [..., Hk, dk]
    num_v_heads: int,
) -> tuple[jax.Array, jax.Array]:  # ([..., Hv, dk], [..., Hv, dk]) fp32
    """l2-normalises q and k, scales q by ``dk**-0.5``, maps them onto the v-heads (``h // (Hv // Hk)``)."""
    hk, dk = q.shape[-2:]
    if k.shape != q.shape:
        raise ValueError(f"q and k must have the same shape, got {q.shape} and {k.shape}")
    if num_v_heads % hk:
        raise ValueError(f"num_v_heads ({num_v_heads}) must be a multiple of the number of q/k heads ({hk})")
    rep = num_v_heads // hk
    q = jnp.repeat(l2norm(q) * dk**-0.5, rep, axis=-2)  # repeat = repeat_interleave on the head axis
    k = jnp.repeat(l2norm(k), rep, axis=-2)
    return q, k


def gdn_step(
    state: jax.Array,  # [..., dk, dv] fp32
    q: jax.Array,  # [..., dk] normalised and scaled (normalize_qk)
    k: jax.Array,  # [..., dk] normalised
    v: jax.Array,  # [..., dv]
    g: jax.Array,  # [...] log-decay
    beta: jax.Array,  # [...]
) -> tuple[jax.Array, jax.Array]:  # (new state [..., dk, dv], o [..., dv]) fp32
    """One token of the gated delta rule: decay, delta update from the decayed state, read the new state."""
    s = state * jnp.exp(g)[..., None, None]
    u = beta[..., None] * (v.astype(jnp.float32) - fp32_einsum("...kv,...k->...v", s, k))
    s = s + k[..., :, None] * u[..., None, :]
    return s, fp32_einsum("...kv,...k->...v", s, q)
