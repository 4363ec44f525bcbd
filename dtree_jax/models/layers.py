"""Qwen3 building blocks shared by the target and the drafter: RMSNorm, RoPE, SwiGLU, the decoder layer.

Linear weights are stored ``[in, out]``.  Attention writes the T new tokens' K/V into a per-layer cache at
rows ``[lens, lens + T)`` of each request and attends with the tree-attention semantics of
``pallas_kernels.tree_attention`` (prefix rows ``< lens`` plus ``local_mask`` among the new tokens).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp

from dtree_jax.models.config import Qwen3Config
from pallas_kernels.tree_attention import reference_tree_attention

Leaf = Callable[[str, bool], Any]  # (hf_key, transpose) -> array or ShapeDtypeStruct


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LayerParams:
    attn_norm: jax.Array  # [H] input_layernorm
    wq: jax.Array  # [H, Hq*D]
    wk: jax.Array  # [H, Hkv*D]
    wv: jax.Array  # [H, Hkv*D]
    wo: jax.Array  # [Hq*D, H]
    q_norm: jax.Array  # [D]
    k_norm: jax.Array  # [D]
    mlp_norm: jax.Array  # [H] post_attention_layernorm
    w_gate: jax.Array  # [H, I]
    w_up: jax.Array  # [H, I]
    w_down: jax.Array  # [I, H]


# HF names of one decoder layer's tensors (relative to ``{prefix}layers.{i}.``), LayerParams field, and
# whether the HF tensor is an ``[out, in]`` Linear weight that must be transposed.
LAYER_KEYS = (
    ("input_layernorm.weight", "attn_norm", False),
    ("self_attn.q_proj.weight", "wq", True),
    ("self_attn.k_proj.weight", "wk", True),
    ("self_attn.v_proj.weight", "wv", True),
    ("self_attn.o_proj.weight", "wo", True),
    ("self_attn.q_norm.weight", "q_norm", False),
    ("self_attn.k_norm.weight", "k_norm", False),
    ("post_attention_layernorm.weight", "mlp_norm", False),
    ("mlp.gate_proj.weight", "w_gate", True),
    ("mlp.up_proj.weight", "w_up", True),
    ("mlp.down_proj.weight", "w_down", True),
)


def layer_hf_shapes(cfg: Qwen3Config) -> dict[str, tuple[int, ...]]:
    """HF shapes ``[out, in]`` of one decoder layer, keyed like ``LAYER_KEYS``."""
    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_heads * d, cfg.num_kv_heads * d
    return {
        "input_layernorm.weight": (h,),
        "self_attn.q_proj.weight": (q, h),
        "self_attn.k_proj.weight": (kv, h),
        "self_attn.v_proj.weight": (kv, h),
        "self_attn.o_proj.weight": (h, q),
        "self_attn.q_norm.weight": (d,),
        "self_attn.k_norm.weight": (d,),
        "post_attention_layernorm.weight": (h,),
        "mlp.gate_proj.weight": (i, h),
        "mlp.up_proj.weight": (i, h),
        "mlp.down_proj.weight": (h, i),
    }


def load_layer(leaf: Leaf, prefix: str) -> LayerParams:
    """Builds one layer from ``leaf(hf_key, transpose)`` with HF keys ``{prefix}{LAYER_KEYS name}``."""
    return LayerParams(**{field: leaf(prefix + key, t) for key, field, t in LAYER_KEYS})


def hf_leaf(shapes: dict[str, tuple[int, ...]], get: Callable[[str], Any], dtype) -> Leaf:
    """A ``leaf`` that reads one HF tensor with ``get(key)``, checks its shape, transposes ``[out, in]``
    Linear weights to ``[in, out]`` and casts at once (peak memory: the output plus one tensor)."""

    def leaf(key: str, transpose: bool) -> jax.Array:
        x = get(key)
        if tuple(x.shape) != shapes[key]:
            raise ValueError(f"{key}: expected HF shape {shapes[key]}, got {tuple(x.shape)}")
        return jnp.asarray(x.T if transpose else x, dtype)

    return leaf


def abstract_leaf(shapes: dict[str, tuple[int, ...]], dtype) -> Leaf:
    """A ``leaf`` giving the ``jax.ShapeDtypeStruct`` that ``hf_leaf`` would produce."""
    return lambda key, transpose: jax.ShapeDtypeStruct(shapes[key][::-1] if transpose else shapes[key], dtype)


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """HF Qwen3RMSNorm: normalise in fp32, cast back to ``x.dtype``, multiply by the plain weight ``w``."""
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (w * y.astype(x.dtype)).astype(x.dtype)


def rope_tables(positions: jax.Array, rotary_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """``positions [...]`` -> ``cos, sin [..., rotary_dim]`` (fp32; frequencies as ``cat(f, f)``)."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, rotary_dim, 2, dtype=jnp.float32) / rotary_dim))
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate-half RoPE on the first ``cos.shape[-1]`` dims of ``x [B, T, heads, D]`` (the rest pass through);
    ``cos, sin [B, T, rotary_dim]``, cast to ``x.dtype`` first as HF does."""
    rd = cos.shape[-1]
    cos = cos[:, :, None, :].astype(x.dtype)
    sin = sin[:, :, None, :].astype(x.dtype)
    xr, xp = x[..., :rd], x[..., rd:]
    half = rd // 2
    rotated = jnp.concatenate([-xr[..., half:], xr[..., :half]], axis=-1)
    return jnp.concatenate([xr * cos + rotated * sin, xp], axis=-1)


def swiglu(p: LayerParams, x: jax.Array) -> jax.Array:
    """``down(silu(gate(x)) * up(x))`` for ``x [..., H]``."""
    return (jax.nn.silu(x @ p.w_gate) * (x @ p.w_up)) @ p.w_down


def kv_project(
    p: LayerParams,
    cfg: Qwen3Config,
    x: jax.Array,  # [B, T, H] (already normed: input_layernorm output, or the drafter's projected context)
    cos: jax.Array,  # [B, T, D]
    sin: jax.Array,  # [B, T, D]
) -> tuple[jax.Array, jax.Array]:
    """K (k_proj, per-head k_norm, RoPE) and V (v_proj), each ``[B, T, Hkv, D]``."""
    b, t, _ = x.shape
    k = (x @ p.wk).reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
    v = (x @ p.wv).reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
    k = apply_rope(rms_norm(k, p.k_norm, cfg.rms_norm_eps), cos, sin)
    return k, v


def write_rows(cache: jax.Array, new: jax.Array, lens: jax.Array) -> jax.Array:
    """Writes ``new [B, T, ...]`` into ``cache [B, S, ...]`` at rows ``[lens, lens + T)`` of each request.

    Needs ``lens + T <= S``: beyond that ``dynamic_update_slice`` clamps the start and overwrites earlier rows.
    """
    new = new.astype(cache.dtype)
    return jax.vmap(lambda c, n, l: jax.lax.dynamic_update_slice_in_dim(c, n, l, axis=0))(
        cache, new, jnp.asarray(lens, jnp.int32)
    )


def attend(
    cfg: Qwen3Config,
    q: jax.Array,  # [B, T, Hq, D]
    k: jax.Array,  # [B, S, Hkv, D]
    v: jax.Array,  # [B, S, Hkv, D]
    lens: jax.Array,  # [B]
    local_mask: jax.Array,  # [B, T, T]
) -> jax.Array:  # [B, T, Hq, D]
    """Tree attention dispatched on ``cfg.attention_impl`` (the Pallas kernel is imported lazily)."""
    scale = cfg.head_dim**-0.5
    if cfg.attention_impl == "pallas":
        from pallas_kernels.tree_attention import tree_attention

        return tree_attention(
            q, k, v, lens, local_mask, scale=scale, interpret=jax.default_backend() == "cpu"
        )
    return reference_tree_attention(q, k, v, lens, local_mask, scale=scale)


def decoder_layer(
    p: LayerParams,
    cfg: Qwen3Config,
    x: jax.Array,  # [B, T, H] residual stream
    cos: jax.Array,  # [B, T, D] RoPE tables at the tokens' positions
    sin: jax.Array,  # [B, T, D]
    k_cache: jax.Array,  # [B, S, Hkv, D]
    v_cache: jax.Array,  # [B, S, Hkv, D]
    lens: jax.Array,  # [B] rows already in the cache
    local_mask: jax.Array,  # [B, T, T]
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One Qwen3 decoder layer; returns the new residual stream and the caches with the T new rows written."""
    b, t, _ = x.shape
    h = rms_norm(x, p.attn_norm, cfg.rms_norm_eps)
    q = (h @ p.wq).reshape(b, t, cfg.num_heads, cfg.head_dim)
    q = apply_rope(rms_norm(q, p.q_norm, cfg.rms_norm_eps), cos, sin)
    k, v = kv_project(p, cfg, h, cos, sin)
    k_cache = write_rows(k_cache, k, lens)
    v_cache = write_rows(v_cache, v, lens)
    o = attend(cfg, q, k_cache, v_cache, lens, local_mask)
    x = x + o.reshape(b, t, cfg.num_heads * cfg.head_dim) @ p.wo
    x = x + swiglu(p, rms_norm(x, p.mlp_norm, cfg.rms_norm_eps))
    return x, k_cache, v_cache
