"""The full-attention decoder, functional JAX: Qwen3 (``Qwen3ForCausalLM``), Qwen3-MoE (``Qwen3MoeForCausalLM``:
``models.moe`` MLPs where ``moe_layers`` says), Llama (``LlamaForCausalLM``, with Llama 3.1 RoPE scaling) and
Qwen2 / Qwen2.5 (``Qwen2ForCausalLM``), one code path switched by ``DecoderConfig`` (this module was
``models/qwen3.py``; the hybrid GDN stack is ``models/qwen3_5.py``).

One ``forward`` serves every phase; the caller picks positions, ``lens`` and the local mask:
  * prefill: ``positions = arange(T)``, ``lens = 0``, causal ``local_mask`` (rows past a request's real length
    are written but harmless: the caller's ``lens`` never covers them);
  * tree verify: ``positions = lens + depth``, ``local_mask`` = ancestor-or-self mask of the tree;
  * decode: ``T = 1``.
The T new tokens' K/V are written at rows ``[lens, lens + T)``; advancing ``lens`` (after compacting the
accepted path) is the caller's job.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp

from dtree_jax import cpu_dot
from dtree_jax.models import moe
from dtree_jax.models.cache import KVCache, causal_prefill, compact_kv, init_kv_cache
from dtree_jax.models.config import DecoderConfig
from dtree_jax.models.layers import (
    LayerParams,
    Leaf,
    abstract_leaf,
    check_step_inputs,
    decoder_layer,
    hf_leaf,
    layer_hf_shapes,
    load_layer,
    rms_norm,
    rope_tables,
    swiglu,
    tap_features,
)
from dtree_jax.models.sharding import axes


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecoderParams:
    embed: jax.Array = axes("vocab", None)  # [V, H]
    layers: tuple[LayerParams, ...]
    final_norm: jax.Array = axes(None)  # [H]
    # [H, V]; None when tie_word_embeddings (embed.T is used; see lm_head)
    lm_head: jax.Array | None = axes(None, "vocab")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MoELayerParams(LayerParams):
    """An MoE layer (Qwen3-MoE): a decoder layer whose MLP is ``moe`` (its dense MLP fields are None).  Dense
    layers stay ``LayerParams``, so converted dense checkpoints keep their tree."""

    moe: moe.MoEParams


def config_from_hf(d: Mapping[str, Any], **overrides) -> DecoderConfig:
    """``DecoderConfig.from_hf``; ``overrides`` sets ``dtype`` / ``attention_impl``."""
    return DecoderConfig.from_hf(d, **overrides)


def hf_shapes(cfg: DecoderConfig) -> dict[str, tuple[int, ...]]:
    """Every HF checkpoint key -> HF shape (``lm_head.weight`` absent when tied)."""
    shapes = {"model.embed_tokens.weight": (cfg.vocab_size, cfg.hidden_size)}
    for i, sparse in enumerate(cfg.moe_layers):
        shapes.update({f"model.layers.{i}.{k}": s for k, s in layer_hf_shapes(cfg, not sparse).items()})
        if sparse:
            shapes.update(moe.hf_shapes(cfg, f"model.layers.{i}.mlp."))
    shapes["model.norm.weight"] = (cfg.hidden_size,)
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, cfg.hidden_size)
    return shapes


def build_params(cfg: DecoderConfig, leaf: Leaf) -> DecoderParams:
    """The params pytree with each leaf made by ``leaf(hf_key, transpose)``: real tensors, abstract shapes, or
    the HF key itself (``dtree_jax.train.hf_tensors`` uses that to export)."""
    def layer(i: int, sparse: bool) -> LayerParams:
        p = f"model.layers.{i}."
        dense = load_layer(leaf, p, cfg, dense_mlp=not sparse)
        if not sparse:
            return dense
        fields = {f.name: getattr(dense, f.name) for f in dataclasses.fields(dense)}
        return MoELayerParams(**fields, moe=moe.load(cfg, leaf, p + "mlp."))

    return DecoderParams(
        embed=leaf("model.embed_tokens.weight", False),
        layers=tuple(layer(i, sparse) for i, sparse in enumerate(cfg.moe_layers)),
        final_norm=leaf("model.norm.weight", False),
        lm_head=None if cfg.tie_word_embeddings else leaf("lm_head.weight", True),
    )


def params_from_hf(cfg: DecoderConfig, get: Callable[[str], Any], dtype) -> DecoderParams:
    """Params from HF tensors: ``get(key)`` is called once per key of ``hf_shapes(cfg)``."""
    return build_params(cfg, hf_leaf(hf_shapes(cfg), get, dtype))


def abstract_params(cfg: DecoderConfig, dtype) -> DecoderParams:
    """``DecoderParams`` of ``jax.ShapeDtypeStruct`` (for orbax restore and shape checks)."""
    return build_params(cfg, abstract_leaf(hf_shapes(cfg), dtype))


def init_cache(cfg: DecoderConfig, batch: int, max_len: int) -> KVCache:
    """Zero KV cache, per layer ``[batch, max_len, Hkv, D]`` in ``cfg.dtype``."""
    return init_kv_cache(cfg, batch, max_len)


def embed(params: DecoderParams, tokens: jax.Array) -> jax.Array:
    """Token embeddings ``tokens [...]`` -> ``[..., H]`` (the params' dtype)."""
    return jnp.take(params.embed, tokens, axis=0)


def embed_table(params: DecoderParams) -> jax.Array:  # [V, H]
    return params.embed


def lm_head(params: DecoderParams, cfg: DecoderConfig, x: jax.Array) -> jax.Array:
    """Output projection ``x [..., H]`` (already final-normed) -> fp32 logits ``[..., V]``: ``params.lm_head``
    when the params hold one (untied checkpoints, or a tied table given its own copy by ``api.cpu_layout``),
    else the embedding table."""
    if params.lm_head is None:
        return jnp.einsum("...h,vh->...v", x, params.embed, preferred_element_type=jnp.float32)
    return cpu_dot.matmul_fp32(x, params.lm_head)


def forward(
    params: DecoderParams,
    cfg: DecoderConfig,
    tokens: jax.Array,  # [B, T] int32
    positions: jax.Array,  # [B, T] int32 RoPE positions
    cache: KVCache,
    lens: jax.Array,  # [B] int32 rows already in the cache
    local_mask: jax.Array,  # [B, T, T] bool visibility among the new tokens
    taps: tuple[int, ...] = (),
) -> tuple[jax.Array, jax.Array, KVCache]:
    """Runs T new tokens per request; returns ``(logits [B, T, V] fp32, feats [B, T, len(taps) * H], cache)``.

    ``feats`` concatenates, in ``taps`` order, HF's ``output_hidden_states[id + 1]``: the residual stream after
    decoder layer ``id``, and for the last layer that stream after the final norm (what the reference drafters
    are trained on and fed).
    ``cfg`` and ``taps`` are static under ``jit``.  Requires ``lens + T <= cache capacity``.
    """
    check_step_inputs(tokens, positions, lens, local_mask, taps, cfg.num_layers, cache.capacity)
    x = embed(params, tokens).astype(cfg.dtype)
    cos, sin = rope_tables(positions, cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    ks, vs, tapped = [], [], {}
    for i, p in enumerate(params.layers):
        x, k, v = decoder_layer(p, cfg, x, cos, sin, cache.k[i], cache.v[i], lens, local_mask, mlp=_mlp(cfg))
        ks.append(k)
        vs.append(v)
        if i in taps:
            tapped[i] = x
    normed = rms_norm(x, params.final_norm, cfg.rms_norm_eps)
    feats = tap_features(tapped, normed, taps, cfg.num_layers)
    return lm_head(params, cfg, normed), feats, KVCache(k=tuple(ks), v=tuple(vs))


def _mlp(cfg: DecoderConfig):
    """A layer's MLP: its ``models.moe`` experts in an MoE layer, else the dense SwiGLU."""

    def mlp(p: LayerParams, x: jax.Array) -> jax.Array:  # [B, T, H] -> [B, T, H]
        return moe.mlp_for(cfg, p.moe, x) if isinstance(p, MoELayerParams) else swiglu(p, x)

    return mlp


def prefill(
    params: DecoderParams,
    cfg: DecoderConfig,
    tokens: jax.Array,  # [B, P] int32 right-padded prompts
    cache: KVCache,  # fresh (init_cache)
    prompt_lens: jax.Array,  # [B] int32 real prompt lengths (>= 1)
    taps: tuple[int, ...] = (),
) -> tuple[jax.Array, jax.Array, KVCache]:
    """Prompt pass (one causal ``forward`` from row 0): ``(logits [B, P, V] fp32, feats [B, P, len(taps) * H],
    cache)``; outputs at padded positions are garbage and the caller's ``lens = prompt_lens`` never covers
    their K/V rows."""
    del prompt_lens  # attention state needs no per-request end: padded rows are simply never committed
    return causal_prefill(forward, params, cfg, tokens, cache, taps)


def commit(
    cfg: DecoderConfig,
    cache: KVCache,  # from forward (the tree's K/V at rows [lens, lens + N))
    lens: jax.Array,  # [B] int32 committed length before the verify
    path: jax.Array,  # [B, N] int32 accepted node indices in path order (path[:, 0] = 0, the root)
    num_emitted: jax.Array,  # [B] int32 nodes of path to commit (root + accepted drafts)
) -> KVCache:
    """Commits the accepted path: its K/V rows compacted to ``[lens, lens + num_emitted)`` (``compact_kv``).
    The caller advances ``lens`` by ``num_emitted``."""
    del cfg
    return compact_kv(cache, lens, path, num_emitted)
