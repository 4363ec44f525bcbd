"""Static, hashable model configs built from HF ``config.json`` dicts (pass them to jitted code as is)."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import jax.numpy as jnp

ATTENTION_IMPLS = ("xla", "pallas")
HEAD_PROJECTORS = ("domino", "causal_v5")  # "causal_v5" is the legacy name of the Domino head


def _rope_theta(d: Mapping[str, Any]) -> float:
    """``rope_theta`` from the top level (hub files) or ``rope_parameters`` (transformers 5 saves)."""
    rp = d.get("rope_parameters") or {}
    scaling = d.get("rope_scaling") or {}
    for spec in (rp, scaling):
        kind = spec.get("rope_type", spec.get("type", "default"))
        if kind != "default":
            raise ValueError(f"unsupported rope_type {kind!r}: only default RoPE is implemented")
    theta = rp.get("rope_theta", d.get("rope_theta"))
    if theta is None:
        raise ValueError("config has neither rope_theta nor rope_parameters.rope_theta")
    return float(theta)


def _require(d: Mapping[str, Any], key: str) -> Any:
    if key not in d or d[key] is None:
        raise ValueError(f"config is missing required field {key!r}")
    return d[key]


@dataclasses.dataclass(frozen=True)
class Qwen3Config:
    """A Qwen3-style dense decoder (the target, or the drafter's backbone with its draft layers)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    dtype: str = "bfloat16"  # activation and KV-cache dtype
    attention_impl: str = "xla"  # "xla" (reference_tree_attention) or "pallas"

    def __post_init__(self):
        object.__setattr__(self, "dtype", jnp.dtype(self.dtype).name)  # accept jnp.bfloat16, np.dtype, "float32"
        if self.attention_impl not in ATTENTION_IMPLS:
            raise ValueError(f"attention_impl must be one of {ATTENTION_IMPLS}, got {self.attention_impl!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")

    @classmethod
    def from_hf(cls, d: Mapping[str, Any], **overrides) -> "Qwen3Config":
        """From an HF ``Qwen3Config`` dict; ``overrides`` sets ``dtype``/``attention_impl`` (or any field)."""
        if d.get("use_sliding_window"):
            raise ValueError("sliding-window attention is not supported")
        if d.get("attention_bias"):
            raise ValueError("attention_bias=true is not supported")
        if d.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act must be silu, got {d['hidden_act']!r}")
        heads = int(_require(d, "num_attention_heads"))
        fields = dict(
            vocab_size=int(_require(d, "vocab_size")),
            hidden_size=int(_require(d, "hidden_size")),
            intermediate_size=int(_require(d, "intermediate_size")),
            num_layers=int(_require(d, "num_hidden_layers")),
            num_heads=heads,
            num_kv_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(d.get("head_dim") or int(_require(d, "hidden_size")) // heads),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=_rope_theta(d),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        )
        fields.update(overrides)
        return cls(**fields)


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """DFlash's rule when ``target_layer_ids`` is absent: ``[L//2]`` for one draft layer, else
    ``round(1 + i * (L - 4) / (n - 1))`` for ``i < n``."""
    if num_draft_layers == 1:
        return (num_target_layers // 2,)
    span = num_target_layers - 4
    return tuple(int(round(1 + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers))


@dataclasses.dataclass(frozen=True)
class DrafterConfig:
    """A DFlash block drafter, optionally with Domino's GRU correction head (``has_head``)."""

    model: Qwen3Config  # the draft backbone (num_layers = draft layers; vocab = the target's)
    block_size: int
    target_layer_ids: tuple[int, ...]
    mask_token_id: int
    shift_label: bool = False
    pure_draft_prefix_len: int = 0
    projector_type: str | None = None  # None: plain DFlash (no head); "domino"/"causal_v5": Domino head
    emb_dim: int | None = None
    gru_hidden_dim: int | None = None

    def __post_init__(self):
        if self.projector_type is not None and self.projector_type not in HEAD_PROJECTORS:
            raise ValueError(
                f"unknown projector_type {self.projector_type!r}; expected one of {HEAD_PROJECTORS}"
            )
        if self.has_head and (self.emb_dim is None or self.gru_hidden_dim is None):
            raise ValueError("a Domino head needs emb_dim and gru_hidden_dim")
        if self.block_size < 2:
            raise ValueError(f"block_size must be >= 2, got {self.block_size}")
        if not self.target_layer_ids:
            raise ValueError("target_layer_ids is empty")
        if not 0 <= self.pure_draft_prefix_len <= self.num_draft_rows:
            raise ValueError(f"pure_draft_prefix_len={self.pure_draft_prefix_len} out of range")

    @property
    def has_head(self) -> bool:
        return self.projector_type is not None

    @property
    def num_features(self) -> int:
        return len(self.target_layer_ids)

    @property
    def num_draft_rows(self) -> int:
        """K, the drafted slots (max tree depth): block_size with shift_label, else block_size - 1."""
        return self.block_size if self.shift_label else self.block_size - 1

    @classmethod
    def from_hf(cls, d: Mapping[str, Any], **overrides) -> "DrafterConfig":
        """From a DFlash/Domino ``config.json`` dict; ``overrides`` go to the backbone (``dtype``, ...)."""
        dc = d.get("dflash_config") or {}

        def pick(key, default=None, top_first=False):
            order = (d, dc) if top_first else (dc, d)
            for src in order:
                if src.get(key) is not None:
                    return src[key]
            return default

        model = Qwen3Config.from_hf(d, **overrides)
        ids = pick("target_layer_ids")
        if ids is None:
            n_target = pick("num_target_layers")
            if n_target is None:
                raise ValueError("drafter config has neither target_layer_ids nor num_target_layers")
            ids = default_target_layer_ids(int(n_target), model.num_layers)
        mask = pick("mask_token_id")
        if mask is None:
            raise ValueError("drafter config is missing mask_token_id")
        emb_dim, gru = pick("emb_dim", top_first=True), pick("gru_hidden_dim")
        return cls(
            model=model,
            block_size=int(pick("block_size", 16)),
            target_layer_ids=tuple(int(i) for i in ids),
            mask_token_id=int(mask),
            shift_label=bool(pick("shift_label", False)),
            pure_draft_prefix_len=int(pick("pure_draft_prefix_len", 0)),
            projector_type=pick("projector_type"),
            emb_dim=None if emb_dim is None else int(emb_dim),
            gru_hidden_dim=None if gru is None else int(gru),
        )
