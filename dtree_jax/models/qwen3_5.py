"""Hybrid Gated-DeltaNet targets: Qwen3.5 / Qwen3.6 dense (``qwen3_5``, ``qwen3_5_text``), Qwen3.5 / Qwen3.6
MoE (``qwen3_5_moe``, ``qwen3_5_moe_text``) and Qwen3-Next (``qwen3_next``), functional JAX.

Every ``full_attention_interval``-th layer (or as ``layer_types`` says) is gated full attention (per-head
interleaved ``[q | gate]`` projection, zero-centred q/k norms, partial RoPE, ``o * sigmoid(gate)``); the
others are Gated DeltaNet token mixers (``models.gdn``; tree verify ``models.tree_gdn``).  MLPs are dense SwiGLU
or, for the MoE models, ``models.moe``'s top-k experts with a sigmoid-gated shared expert.  Layer norms, q/k
norms and the final norm are zero-centred (``1 + w``).  Qwen3-Next's per-key-head grouped ``in_proj_qkvz`` / ``in_proj_ba`` are
regrouped to the Qwen3.5 layout at load time, so one forward serves both.

Phases (``dtree_jax.loop`` drives them, through the ``TargetModel`` protocol):
  * ``prefill(params, cfg, tokens, cache, prompt_lens, taps)``: right-padded prompts, chunked GDN with the
    gates zeroed past each request's length, attention K/V at rows ``[0, P)``;
  * ``forward(...)`` = tree verify (decode is the 1-node tree): parents come from ``local_mask`` (the deepest
    proper ancestor), GDN runs along the tree from the committed conv/recurrent state without changing it, and
    the per-node data the commit needs is returned in ``cache.pending``;
  * ``commit(cfg, cache, lens, path, num_emitted)``: compacts the accepted attention K/V and sets each GDN
    layer's committed state to the one after node ``path[num_emitted - 1]`` (rows with ``num_emitted == 0``
    keep theirs); it clears ``pending``, so the cache keeps one pytree structure across decode rounds.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp

from dtree_jax.models import families, kernels, moe
from dtree_jax.models.cache import compact_kv
from dtree_jax.models.config import (
    ATTENTION_IMPLS,
    MAX_CONV_KERNEL,
    MAX_HEADS,
    MAX_LAYERS,
    _rope_theta,
    attention_fields,
    check_kernel_platform,
    check_kv_heads,
    check_moe,
    config_bool,
    config_dict,
    config_int,
    config_str,
    config_strs,
    moe_fields,
    repeat_kv,
    rope_parameter,
)
from dtree_jax.models.decoder import embed, embed_table, lm_head  # noqa: F401 (the protocol: same layout as dense)
from dtree_jax.models.gdn import causal_conv, chunk_gated_delta_rule, gated_rms_norm, gdn_gates, split_qkv
from dtree_jax.models.layers import (
    DenseMLP,
    Leaf,
    abstract_leaf,
    apply_rope,
    attend,
    check_step_inputs,
    derive,
    hf_leaf,
    rope_tables,
    swiglu,
    tap_features,
    write_rows,
)
from dtree_jax.models.sharding import axes
from dtree_jax.models.tree_gdn import TreeGDNStash, commit_tree_gdn, tree_gdn_mixer

FULL, LINEAR = "full_attention", "linear_attention"
FUSED_MODEL_TYPES = ("qwen3_next",)  # grouped in_proj_qkvz / in_proj_ba
MOE_MODEL_TYPES = ("qwen3_next", "qwen3_5_moe", "qwen3_5_moe_text")  # MoE MLPs (``models.moe``)


# ----------------------------------------------------------------------------------------------------------
# Config
# ----------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Qwen35Config:
    """A hybrid GDN / gated-attention decoder (static and hashable)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int  # dense MLP width (layers without MoE)
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rotary_dim: int  # int(head_dim * partial_rotary_factor): RoPE on the first rotary_dim dims only
    tie_word_embeddings: bool
    layer_types: tuple[str, ...]  # per layer "full_attention" or "linear_attention"
    linear_num_k_heads: int  # Hk
    linear_num_v_heads: int  # Hv
    linear_k_head_dim: int  # dk
    linear_v_head_dim: int  # dv
    linear_conv_kernel: int  # Kc
    fused_gdn_proj: bool = False  # checkpoint has qwen3_next's grouped in_proj_qkvz / in_proj_ba
    moe_layers: tuple[bool, ...] = ()  # per layer: MoE MLP (``models.moe``), else dense SwiGLU; () = all dense
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    dtype: str = "bfloat16"  # activations, K/V and conv state (the recurrent state is always fp32)
    attention_impl: str = "xla"  # "xla" or "pallas" (tree attention and the tree-GDN kernel)
    kernel_platform: str | None = None  # "tpu" | "gpu" | "cpu" (interpret mode); None: the runtime's platform
    max_position_embeddings: int | None = None  # positions the model was trained for (generate checks prompts)
    kv_head_repeat: int = 1  # the KV cache holds each KV head this many times (``sharding.for_mesh``)

    def __post_init__(self):
        object.__setattr__(self, "dtype", jnp.dtype(self.dtype).name)
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        check_moe(self)
        if self.attention_impl not in ATTENTION_IMPLS:
            raise ValueError(f"attention_impl must be one of {ATTENTION_IMPLS}, got {self.attention_impl!r}")
        check_kernel_platform(self.kernel_platform)
        if len(self.layer_types) != self.num_layers or set(self.layer_types) - {FULL, LINEAR}:
            raise ValueError(
                f"layer_types must be {self.num_layers} of {FULL!r}/{LINEAR!r}, got {self.layer_types}"
            )
        check_kv_heads(self)
        if self.linear_num_v_heads % self.linear_num_k_heads:
            raise ValueError(f"linear_num_value_heads={self.linear_num_v_heads} is not a multiple of "
                             f"linear_num_key_heads={self.linear_num_k_heads}")
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            raise ValueError(
                f"rotary_dim must be even and in (0, head_dim={self.head_dim}], got {self.rotary_dim}"
            )

    @property
    def attn_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == FULL)

    @property
    def gdn_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == LINEAR)

    @property
    def cache_kv_heads(self) -> int:
        """KV heads per attention layer in the cache: ``num_kv_heads * kv_head_repeat``."""
        return self.num_kv_heads * self.kv_head_repeat

    @property
    def conv_dim(self) -> int:
        """Conv channels ``C = 2 * Hk * dk + Hv * dv`` (packed ``[q | k | v]``)."""
        key_dim = self.linear_num_k_heads * self.linear_k_head_dim
        return 2 * key_dim + self.linear_num_v_heads * self.linear_v_head_dim

    @property
    def gdn_impl(self) -> str:
        """``tree_gdn_mixer``'s impl (``models.kernels.kernel_choice``): with attention_impl="pallas" the Pallas
        kernel on TPU ("mosaic"), interpret mode on CPU, the XLA path on GPU (no GPU kernel yet); else "xla"."""
        return kernels.kernel_choice("tree_gdn", self)


def config_from_hf(d: Mapping[str, Any], **overrides) -> Qwen35Config:
    """From an HF ``Qwen3_5Config`` (text fields under ``text_config``), ``Qwen3_5TextConfig`` or
    ``Qwen3NextConfig`` dict; ``overrides`` sets ``dtype`` / ``attention_impl`` (or any field)."""
    top = dict(d)
    text = dict(config_dict(top, "text_config") or top)
    model_type = top.get("model_type", text.get("model_type"))
    if model_type not in families.HYBRID.model_types:
        raise ValueError(f"model_type must be one of {families.HYBRID.model_types}, got {model_type!r}")
    if config_str(text, "hidden_act", default="silu") != "silu":
        raise ValueError(f"hidden_act must be silu, got {text['hidden_act']!r}")
    if config_bool(text, "attention_bias", False):
        raise ValueError("attention_bias=true is not supported")
    if not config_bool(text, "attn_output_gate", True):
        raise ValueError("attn_output_gate=false is not supported")
    shared = attention_fields(text)
    n = shared["num_layers"]
    types = config_strs(text, "layer_types", default=None, choices=(FULL, LINEAR), length=n)
    if types is None:
        interval = config_int(text, "full_attention_interval", default=4, high=MAX_LAYERS)
        types = tuple(FULL if (i + 1) % interval == 0 else LINEAR for i in range(n))
    tie = config_bool(top, "tie_word_embeddings", config_bool(text, "tie_word_embeddings", False))
    fields = dict(
        **shared,
        intermediate_size=config_int(text, "intermediate_size", default=0, low=0),
        rope_theta=_rope_theta(text),
        rotary_dim=int(shared["head_dim"] * rope_parameter(text, "partial_rotary_factor", default=0.25)),
        tie_word_embeddings=tie,
        layer_types=types,
        linear_num_k_heads=config_int(text, "linear_num_key_heads", high=MAX_HEADS),
        linear_num_v_heads=config_int(text, "linear_num_value_heads", high=MAX_HEADS),
        linear_k_head_dim=config_int(text, "linear_key_head_dim"),
        linear_v_head_dim=config_int(text, "linear_value_head_dim"),
        linear_conv_kernel=config_int(text, "linear_conv_kernel_dim", default=4, high=MAX_CONV_KERNEL),
        fused_gdn_proj=model_type in FUSED_MODEL_TYPES,
        **moe_fields(text, n, model_type in MOE_MODEL_TYPES),
    )
    fields.update(overrides)
    return Qwen35Config(**fields)


# ----------------------------------------------------------------------------------------------------------
# Params and the HF weight contract
# ----------------------------------------------------------------------------------------------------------


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class GDNParams:
    w_qkv: jax.Array = axes(None, "gdn_channels")  # [H, C] channels [q (Hk*dk) | k (Hk*dk) | v (Hv*dv)]
    w_z: jax.Array = axes(None, "v_heads")  # [H, Hv*dv]
    w_b: jax.Array = axes(None, "v_heads")  # [H, Hv]
    w_a: jax.Array = axes(None, "v_heads")  # [H, Hv]
    conv_w: jax.Array = axes("gdn_channels", None)  # [C, Kc]
    A_log: jax.Array = axes("v_heads")  # [Hv]
    dt_bias: jax.Array = axes("v_heads")  # [Hv]
    norm: jax.Array = axes(None)  # [dv] gated-norm weight (plain w)
    w_out: jax.Array = axes("v_heads", None)  # [Hv*dv, H]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttnParams:
    wq: jax.Array = axes(None, "heads")  # [H, Hq*2*D] per head [q_h | gate_h] (HF q_proj layout)
    wk: jax.Array = axes(None, "kv_heads")  # [H, Hkv*D]
    wv: jax.Array = axes(None, "kv_heads")  # [H, Hkv*D]
    wo: jax.Array = axes("heads", None)  # [Hq*D, H]
    q_norm: jax.Array = axes(None)  # [D] zero-centred
    k_norm: jax.Array = axes(None)  # [D] zero-centred


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class HybridLayer:
    attn_norm: jax.Array = axes(None)  # [H] input_layernorm (zero-centred)
    mixer: GDNParams | AttnParams
    mlp_norm: jax.Array = axes(None)  # [H] post_attention_layernorm (zero-centred)
    mlp: DenseMLP | moe.MoEParams


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Qwen35Params:
    embed: jax.Array = axes("vocab", None)  # [V, H]
    layers: tuple[HybridLayer, ...]
    final_norm: jax.Array = axes(None)  # [H] zero-centred
    lm_head: jax.Array | None = axes(None, "vocab")  # [H, V]; None when tie_word_embeddings


def _layer_hf_shapes(cfg: Qwen35Config, i: int) -> dict[str, tuple[int, ...]]:
    """HF shapes of layer ``i``'s tensors, relative to ``model.layers.{i}.``."""
    h, d = cfg.hidden_size, cfg.head_dim
    shapes = {"input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,)}
    if cfg.layer_types[i] == FULL:
        q, kv = cfg.num_heads * d, cfg.num_kv_heads * d
        shapes.update({
            "self_attn.q_proj.weight": (2 * q, h), "self_attn.k_proj.weight": (kv, h),
            "self_attn.v_proj.weight": (kv, h), "self_attn.o_proj.weight": (h, q),
            "self_attn.q_norm.weight": (d,), "self_attn.k_norm.weight": (d,),
        })
    else:
        hv, dv, c = cfg.linear_num_v_heads, cfg.linear_v_head_dim, cfg.conv_dim
        la = "linear_attn."
        if cfg.fused_gdn_proj:
            shapes.update(
                {f"{la}in_proj_qkvz.weight": (c + hv * dv, h), f"{la}in_proj_ba.weight": (2 * hv, h)}
            )
        else:
            shapes.update({f"{la}in_proj_qkv.weight": (c, h), f"{la}in_proj_z.weight": (hv * dv, h),
                           f"{la}in_proj_b.weight": (hv, h), f"{la}in_proj_a.weight": (hv, h)})
        shapes.update({
            f"{la}conv1d.weight": (c, 1, cfg.linear_conv_kernel), f"{la}dt_bias": (hv,), f"{la}A_log": (hv,),
            f"{la}norm.weight": (dv,), f"{la}out_proj.weight": (h, hv * dv),
        })
    if cfg.moe_layers[i]:
        shapes.update(moe.hf_shapes(cfg, "mlp."))
    else:
        shapes.update(moe.dense_shapes("mlp.", h, cfg.intermediate_size))
    return shapes


def hf_shapes(cfg: Qwen35Config) -> dict[str, tuple[int, ...]]:
    """Every canonical HF checkpoint key (``model.layers.*``; MoE experts per expert, as ``save_pretrained``
    writes them) -> HF shape; ``lm_head.weight`` absent when tied."""
    shapes = {"model.embed_tokens.weight": (cfg.vocab_size, cfg.hidden_size)}
    for i in range(cfg.num_layers):
        shapes.update({f"model.layers.{i}.{k}": s for k, s in _layer_hf_shapes(cfg, i).items()})
    shapes["model.norm.weight"] = (cfg.hidden_size,)
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, cfg.hidden_size)
    return shapes


def _regroup_qkvz(cfg: Qwen35Config, w: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Qwen3-Next ``in_proj_qkvz`` ``[Hk * (2dk + 2r dv), H]`` (grouped per key head, r = Hv / Hk) ->
    ``(w_qkv [H, C], w_z [H, Hv*dv])`` in the Qwen3.5 layout."""
    hk, dk, dv = cfg.linear_num_k_heads, cfg.linear_k_head_dim, cfg.linear_v_head_dim
    rdv = cfg.linear_num_v_heads // hk * dv
    g = w.reshape(hk, 2 * dk + 2 * rdv, -1)
    q, k, v, z = (g[:, a:b].reshape(-1, g.shape[-1]) for a, b in
                  ((0, dk), (dk, 2 * dk), (2 * dk, 2 * dk + rdv), (2 * dk + rdv, 2 * dk + 2 * rdv)))
    return jnp.concatenate([q, k, v], axis=0).T, z.T


def _regroup_ba(cfg: Qwen35Config, w: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Qwen3-Next ``in_proj_ba`` ``[Hk * 2r, H]`` -> ``(w_b [H, Hv], w_a [H, Hv])``."""
    hk, r = cfg.linear_num_k_heads, cfg.linear_num_v_heads // cfg.linear_num_k_heads
    g = w.reshape(hk, 2 * r, -1)
    return g[:, :r].reshape(-1, g.shape[-1]).T, g[:, r:].reshape(-1, g.shape[-1]).T


def _load_gdn(cfg: Qwen35Config, leaf: Leaf, p: str) -> GDNParams:
    if cfg.fused_gdn_proj:
        w_qkv, w_z = derive(lambda w: _regroup_qkvz(cfg, w), leaf(p + "in_proj_qkvz.weight", False))
        w_b, w_a = derive(lambda w: _regroup_ba(cfg, w), leaf(p + "in_proj_ba.weight", False))
    else:
        w_qkv, w_z = leaf(p + "in_proj_qkv.weight", True), leaf(p + "in_proj_z.weight", True)
        w_b, w_a = leaf(p + "in_proj_b.weight", True), leaf(p + "in_proj_a.weight", True)
    return GDNParams(
        w_qkv=w_qkv, w_z=w_z, w_b=w_b, w_a=w_a,
        conv_w=derive(lambda w: w[:, 0, :], leaf(p + "conv1d.weight", False)),
        A_log=leaf(p + "A_log", False),
        dt_bias=leaf(p + "dt_bias", False),
        norm=leaf(p + "norm.weight", False),
        w_out=leaf(p + "out_proj.weight", True),
    )


def _load_attn(leaf: Leaf, p: str) -> AttnParams:
    return AttnParams(
        wq=leaf(p + "q_proj.weight", True),
        wk=leaf(p + "k_proj.weight", True),
        wv=leaf(p + "v_proj.weight", True),
        wo=leaf(p + "o_proj.weight", True), q_norm=leaf(p + "q_norm.weight", False),
        k_norm=leaf(p + "k_norm.weight", False),
    )


def build_params(cfg: Qwen35Config, leaf: Leaf) -> Qwen35Params:
    layers = []
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        if cfg.layer_types[i] == FULL:
            mixer = _load_attn(leaf, p + "self_attn.")
        else:
            mixer = _load_gdn(cfg, leaf, p + "linear_attn.")
        mlp = moe.load(cfg, leaf, p + "mlp.") if cfg.moe_layers[i] else moe.load_dense(leaf, p + "mlp.")
        layers.append(HybridLayer(leaf(p + "input_layernorm.weight", False), mixer,
                                  leaf(p + "post_attention_layernorm.weight", False), mlp))
    return Qwen35Params(
        embed=leaf("model.embed_tokens.weight", False),
        layers=tuple(layers),
        final_norm=leaf("model.norm.weight", False),
        lm_head=None if cfg.tie_word_embeddings else leaf("lm_head.weight", True),
    )


def params_from_hf(cfg: Qwen35Config, get: Callable[[str], Any], dtype) -> Qwen35Params:
    """Params from HF tensors: ``get(key)`` is called once per key of ``hf_shapes(cfg)`` (Qwen3-Next's fused
    GDN projections are regrouped and MoE experts stacked here)."""
    return build_params(cfg, hf_leaf(hf_shapes(cfg), get, dtype))


def abstract_params(cfg: Qwen35Config, dtype) -> Qwen35Params:
    """``Qwen35Params`` of ``jax.ShapeDtypeStruct`` (for orbax restore and shape checks)."""
    return build_params(cfg, abstract_leaf(hf_shapes(cfg), dtype))


# ----------------------------------------------------------------------------------------------------------
# Cache
# ----------------------------------------------------------------------------------------------------------


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PendingVerify:
    """Per-node data of the last tree verify that ``commit`` folds into the committed GDN states."""

    # per GDN layer [B, N, Kc-1, C] conv window after each node
    windows: tuple[jax.Array, ...] = axes("batch", None, None, "gdn_channels")
    stash: tuple[TreeGDNStash, ...]  # per GDN layer tree-WY stash (k, u, path log-decay, ancestor mask)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class HybridCache:
    # per full-attention layer [B, S, Hkv * kv_head_repeat, D], RoPE applied
    k: tuple[jax.Array, ...] = axes("batch", None, "cache_kv_heads", None)
    # per full-attention layer [B, S, Hkv * kv_head_repeat, D]
    v: tuple[jax.Array, ...] = axes("batch", None, "cache_kv_heads", None)
    # per GDN layer [B, Kc-1, C] committed raw conv inputs, oldest first
    conv: tuple[jax.Array, ...] = axes("batch", None, "gdn_channels")
    # per GDN layer [B, Hv, dk, dv] fp32 committed recurrent state
    state: tuple[jax.Array, ...] = axes("batch", "v_heads", None, None)
    pending: PendingVerify | None = None  # set by forward, consumed (cleared) by commit

    @property
    def capacity(self) -> int | None:
        return self.k[0].shape[1] if self.k else None


def init_cache(cfg: Qwen35Config, batch: int, max_len: int) -> HybridCache:
    """Zero cache: K/V ``[batch, max_len, Hkv, D]`` per attention layer (``cfg.dtype``), zero conv and
    recurrent states per GDN layer, no pending verify."""
    if batch < 1 or max_len < 1:
        raise ValueError(f"batch and max_len must be positive, got {batch}, {max_len}")
    kv = (batch, max_len, cfg.cache_kv_heads, cfg.head_dim)
    conv = (batch, cfg.linear_conv_kernel - 1, cfg.conv_dim)
    state = (batch, cfg.linear_num_v_heads, cfg.linear_k_head_dim, cfg.linear_v_head_dim)
    na, ng = len(cfg.attn_layers), len(cfg.gdn_layers)
    return HybridCache(
        k=tuple(jnp.zeros(kv, cfg.dtype) for _ in range(na)),
        v=tuple(jnp.zeros(kv, cfg.dtype) for _ in range(na)),
        conv=tuple(jnp.zeros(conv, cfg.dtype) for _ in range(ng)),
        state=tuple(jnp.zeros(state, jnp.float32) for _ in range(ng)),
    )


# ----------------------------------------------------------------------------------------------------------
# Layers
# ----------------------------------------------------------------------------------------------------------


def rms_norm_1p(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """Zero-centred RMSNorm (``Qwen3NextRMSNorm``): ``rmsnorm(x) * (1 + w)`` in fp32, cast to ``x.dtype``."""
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (y * (1.0 + w.astype(jnp.float32))).astype(x.dtype)


def gated_attention(
    p: AttnParams,
    cfg: Qwen35Config,
    h: jax.Array,  # [B, T, H] input_layernorm output
    cos: jax.Array,  # [B, T, rotary_dim]
    sin: jax.Array,  # [B, T, rotary_dim]
    k_cache: jax.Array,  # [B, S, Hkv * kv_head_repeat, D]
    v_cache: jax.Array,  # [B, S, Hkv * kv_head_repeat, D]
    lens: jax.Array,  # [B]
    local_mask: jax.Array,  # [B, T, T]
) -> tuple[jax.Array, jax.Array, jax.Array]:  # (out [B, T, H], k_cache, v_cache)
    """Gated full attention: per-head ``[q | gate]``, zero-centred q/k norms, partial RoPE,
    ``attn * sigmoid(gate)``; the T new K/V rows are written at ``[lens, lens + T)``."""
    b, t, _ = h.shape
    nh, d = cfg.num_heads, cfg.head_dim
    qg = (h @ p.wq).reshape(b, t, nh, 2 * d)
    q, gate = qg[..., :d], qg[..., d:].reshape(b, t, nh * d)
    q = apply_rope(rms_norm_1p(q, p.q_norm, cfg.rms_norm_eps), cos, sin)
    k = (h @ p.wk).reshape(b, t, cfg.num_kv_heads, d)
    k = apply_rope(rms_norm_1p(k, p.k_norm, cfg.rms_norm_eps), cos, sin)
    v = (h @ p.wv).reshape(b, t, cfg.num_kv_heads, d)
    k, v = repeat_kv(k, cfg), repeat_kv(v, cfg)
    k_cache, v_cache = write_rows(k_cache, k, lens), write_rows(v_cache, v, lens)
    o = attend(cfg, q, k_cache, v_cache, lens, local_mask).reshape(b, t, nh * d)
    return (o * jax.nn.sigmoid(gate)) @ p.wo, k_cache, v_cache


def gdn_project(
    p: GDNParams, cfg: Qwen35Config, h: jax.Array  # [B, T, H]
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:  # (qkv [B, T, C], z [B, T, Hv, dv], a, b [B, T, Hv])
    """The GDN input projections (raw, pre-conv)."""
    b, t, _ = h.shape
    z = (h @ p.w_z).reshape(b, t, cfg.linear_num_v_heads, cfg.linear_v_head_dim)
    return h @ p.w_qkv, z, h @ p.w_a, h @ p.w_b


def mlp(layer: HybridLayer, cfg: Qwen35Config, x: jax.Array) -> jax.Array:  # [B, T, H] -> [B, T, H]
    return moe.mlp_for(cfg, layer.mlp, x) if isinstance(layer.mlp, moe.MoEParams) else swiglu(layer.mlp, x)


def parents_from_mask(local_mask: jax.Array) -> jax.Array:  # [B, T, T] -> [B, T] int32
    """Parent = the deepest (highest-index) proper ancestor, -1 for none; a causal mask gives ``i - 1``."""
    t = local_mask.shape[-1]
    idx = jnp.arange(t, dtype=jnp.int32)
    proper = local_mask & (idx[None, :] < idx[:, None])
    return jnp.max(jnp.where(proper, idx, -1), axis=-1)


# ----------------------------------------------------------------------------------------------------------
# Model API
# ----------------------------------------------------------------------------------------------------------


def _check(cfg: Qwen35Config, tokens, positions, cache: HybridCache, lens, local_mask, taps) -> None:
    check_step_inputs(tokens, positions, lens, local_mask, taps, cfg.num_layers, cache.capacity)
    if len(cache.k) != len(cfg.attn_layers) or len(cache.conv) != len(cfg.gdn_layers):
        raise ValueError("cache does not match the config's layer types (use init_cache(cfg, ...))")


def _run(params, cfg, tokens, positions, cache, lens, local_mask, taps, gdn):
    """The layer stack; ``gdn(j, p, qkv, z, a, b) -> (y [B, T, Hv, dv], extra)`` runs the j-th GDN core."""
    b, t = tokens.shape
    x = embed(params, tokens).astype(cfg.dtype)
    cos, sin = rope_tables(positions, cfg.rotary_dim, cfg.rope_theta)
    ks, vs, extras, tapped = [], [], [], {}
    for i, layer in enumerate(params.layers):
        h = rms_norm_1p(x, layer.attn_norm, cfg.rms_norm_eps)
        if isinstance(layer.mixer, AttnParams):
            j = len(ks)
            o, k, v = gated_attention(layer.mixer, cfg, h, cos, sin, cache.k[j], cache.v[j], lens, local_mask)
            ks.append(k)
            vs.append(v)
        else:
            y, extra = gdn(len(extras), layer.mixer, *gdn_project(layer.mixer, cfg, h))
            extras.append(extra)
            o = y.reshape(b, t, -1) @ layer.mixer.w_out
        x = x + o
        x = x + mlp(layer, cfg, rms_norm_1p(x, layer.mlp_norm, cfg.rms_norm_eps))
        if i in taps:
            tapped[i] = x
    normed = rms_norm_1p(x, params.final_norm, cfg.rms_norm_eps)
    feats = tap_features(tapped, normed, taps, cfg.num_layers)
    return lm_head(params, cfg, normed), feats, tuple(ks), tuple(vs), extras


def forward(
    params: Qwen35Params,
    cfg: Qwen35Config,
    tokens: jax.Array,  # [B, T] int32 tree nodes (node 0 = the root, the last emitted token)
    positions: jax.Array,  # [B, T] int32 RoPE positions (lens + depth)
    cache: HybridCache,
    lens: jax.Array,  # [B] int32 committed tokens (attention rows already in the cache)
    local_mask: jax.Array,  # [B, T, T] bool ancestor-or-self mask of a topologically ordered tree
    taps: tuple[int, ...] = (),
) -> tuple[jax.Array, jax.Array, HybridCache]:
    """Tree verify (decode = a 1-node tree): ``(logits [B, T, V] fp32, feats [B, T, len(taps) * H], cache)``.

    Each node sees the committed sequence plus its root -> node path (attention via ``local_mask``, GDN conv
    and recurrence along parent pointers derived from it).  The returned cache has the T new K/V rows at
    ``[lens, lens + T)``, the committed GDN states unchanged, and ``pending`` set for ``commit``.
    ``feats`` concatenates HF's ``output_hidden_states[id + 1]`` for each tapped layer, in ``taps`` order (the
    residual stream after it; after the final norm for the last layer).
    """
    _check(cfg, tokens, positions, cache, lens, local_mask, taps)
    parents = parents_from_mask(local_mask)

    def gdn(j, p, qkv, z, a, b):
        y, windows, stash = tree_gdn_mixer(
            qkv, z, a, b, p.conv_w, p.A_log, p.dt_bias, p.norm, cache.conv[j], cache.state[j], parents,
            num_k_heads=cfg.linear_num_k_heads, head_k_dim=cfg.linear_k_head_dim, eps=cfg.rms_norm_eps,
            impl=cfg.gdn_impl,
        )
        return y, (windows, stash)

    logits, feats, ks, vs, extras = _run(params, cfg, tokens, positions, cache, lens, local_mask, taps, gdn)
    pending = PendingVerify(windows=tuple(e[0] for e in extras), stash=tuple(e[1] for e in extras))
    return logits, feats, dataclasses.replace(cache, k=ks, v=vs, pending=pending)


def commit(
    cfg: Qwen35Config,
    cache: HybridCache,  # from forward (pending set)
    lens: jax.Array,  # [B] int32 committed length before the verify
    path: jax.Array,  # [B, N] int32 accepted node indices in path order (path[:, 0] = 0, the root)
    num_emitted: jax.Array,  # [B] int32 nodes of path to commit (root + accepted drafts); 0 keeps the row
) -> HybridCache:
    """Commits the accepted path: K/V rows compacted to ``[lens, lens + num_emitted)`` and each GDN layer's
    conv/recurrent state set to the one after node ``path[num_emitted - 1]``; clears ``pending``.
    The caller advances ``lens`` by ``num_emitted``."""
    if cache.pending is None:
        raise ValueError("commit needs the pending data of a verify: pass the cache returned by forward")
    path = jnp.asarray(path, jnp.int32)
    num_emitted = jnp.asarray(num_emitted, jnp.int32)
    k, v = compact_kv((cache.k, cache.v), lens, path, num_emitted)
    last = jnp.clip(jnp.take_along_axis(path, jnp.maximum(num_emitted - 1, 0)[:, None], axis=1)[:, 0], 0)
    keep = num_emitted > 0
    convs, states = [], []
    pending = cache.pending
    for windows, stash, conv0, state0 in zip(pending.windows, pending.stash, cache.conv, cache.state):
        conv1, state1 = commit_tree_gdn(windows, stash, state0, last)
        convs.append(jnp.where(keep[:, None, None], conv1.astype(conv0.dtype), conv0))
        states.append(jnp.where(keep[:, None, None, None], state1, state0))
    return HybridCache(k=k, v=v, conv=tuple(convs), state=tuple(states), pending=None)


def prefill(
    params: Qwen35Params,
    cfg: Qwen35Config,
    tokens: jax.Array,  # [B, P] int32 right-padded prompts
    cache: HybridCache,  # fresh (init_cache)
    prompt_lens: jax.Array,  # [B] int32 real prompt lengths (>= 1)
    taps: tuple[int, ...] = (),
) -> tuple[jax.Array, jax.Array, HybridCache]:
    """Prompt pass: ``(logits [B, P, V] fp32, feats [B, P, len(taps) * H], cache)`` with K/V rows ``[0, P)``
    written (the caller's ``lens = prompt_lens`` covers the real ones) and every GDN layer's committed state
    set to the one after the request's last real token (chunked delta rule with ``g = beta = 0`` on padding;
    the conv state is the last ``Kc-1`` real inputs).  Outputs at padded positions are garbage."""
    b, p = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
    causal = jnp.broadcast_to(jnp.tri(p, dtype=bool), (b, p, p))
    lens0 = jnp.zeros((b,), jnp.int32)
    _check(cfg, tokens, positions, cache, lens0, causal, taps)
    prompt_lens = jnp.asarray(prompt_lens, jnp.int32)
    valid = positions < prompt_lens[:, None]  # [B, P]
    kc = cfg.linear_conv_kernel
    # rows of [zeros(Kc-1); qkv] holding the last Kc-1 real inputs: prompt_lens + j, j < Kc-1
    tail = prompt_lens[:, None] + jnp.arange(kc - 1, dtype=jnp.int32)

    def gdn(j, pr, qkv, z, a, bb):
        y, _ = causal_conv(qkv, pr.conv_w)
        xp = jnp.concatenate([jnp.zeros((b, kc - 1, qkv.shape[-1]), qkv.dtype), qkv], axis=1)
        conv_state = jnp.take_along_axis(xp, tail[..., None], axis=1)
        q, k, v = split_qkv(y, cfg.linear_num_k_heads, cfg.linear_k_head_dim, cfg.linear_num_v_heads,
                            cfg.linear_v_head_dim)
        g, beta = gdn_gates(a, bb, pr.A_log, pr.dt_bias)
        g, beta = jnp.where(valid[..., None], g, 0.0), jnp.where(valid[..., None], beta, 0.0)
        o, state = chunk_gated_delta_rule(q, k, v, g, beta)
        return gated_rms_norm(o, z, pr.norm, cfg.rms_norm_eps), (conv_state.astype(cfg.dtype), state)

    logits, feats, ks, vs, extras = _run(params, cfg, tokens, positions, cache, lens0, causal, taps, gdn)
    new = HybridCache(k=ks, v=vs, conv=tuple(e[0] for e in extras), state=tuple(e[1] for e in extras))
    return logits, feats, new
