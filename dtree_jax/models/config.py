"""Static, hashable model configs built from HF ``config.json`` dicts (pass them to jitted code as is)."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import jax.numpy as jnp

from dtree_jax.models import families

ATTENTION_IMPLS = ("xla", "pallas")
KERNEL_PLATFORMS = ("tpu", "gpu", "cpu")  # kernel_platform: whose kernels "pallas" selects (models/kernels.py)
HEAD_PROJECTORS = ("domino", "causal_v5")  # "causal_v5" is the legacy name of the Domino head
ROPE_TYPES = ("default", "llama3")  # what the dense models implement (the hybrid ones: default only)


@dataclasses.dataclass(frozen=True)
class Llama3RoPE:
    """Llama 3.1's ``rope_type: "llama3"`` frequency scaling (applied by ``layers.rope_tables``)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


def _rope(d: Mapping[str, Any], allowed: tuple[str, ...] = ("default",)) -> tuple[float, Llama3RoPE | None]:
    """``(rope_theta, llama3 scaling or None)`` from ``rope_parameters`` (transformers 5 saves) or the hub
    form (top-level ``rope_theta``, ``rope_scaling``); any RoPE type outside ``allowed`` is refused."""
    rp = d.get("rope_parameters") or {}
    scaling = d.get("rope_scaling") or {}
    kinds = {spec.get("rope_type", spec.get("type", "default")) for spec in (rp, scaling)} - {"default"}
    if len(kinds) > 1 or not kinds <= set(allowed):
        raise ValueError(f"unsupported rope_type {sorted(kinds)}: implemented here: {list(allowed)}")
    theta = rp.get("rope_theta", d.get("rope_theta"))
    if theta is None:
        raise ValueError("config has neither rope_theta nor rope_parameters.rope_theta")
    if not kinds:
        return float(theta), None
    spec = {**scaling, **rp}
    try:
        llama3 = Llama3RoPE(
            factor=float(spec["factor"]),
            low_freq_factor=float(spec["low_freq_factor"]),
            high_freq_factor=float(spec["high_freq_factor"]),
            original_max_position_embeddings=int(spec["original_max_position_embeddings"]),
        )
    except KeyError as e:
        raise ValueError(f"rope_type llama3 needs {e.args[0]!r} in rope_parameters / rope_scaling") from None
    if llama3.high_freq_factor <= llama3.low_freq_factor:
        raise ValueError("rope_type llama3 needs high_freq_factor > low_freq_factor")
    return float(theta), llama3


def _rope_theta(d: Mapping[str, Any]) -> float:
    """``rope_theta`` of a default-RoPE config (any scaling is refused)."""
    return _rope(d)[0]


def check_kernel_platform(platform: str | None) -> None:
    if platform is not None and platform not in KERNEL_PLATFORMS:
        raise ValueError(f"kernel_platform must be one of {KERNEL_PLATFORMS} or None, got {platform!r}")


def check_kv_heads(cfg) -> None:
    """The query heads must split evenly over the KV heads, and over their repeats in the cache."""
    if isinstance(cfg.kv_head_repeat, bool) or not isinstance(cfg.kv_head_repeat, int) or cfg.kv_head_repeat < 1:
        raise ValueError(f"kv_head_repeat must be a positive integer, got {cfg.kv_head_repeat!r}")
    if cfg.num_heads % (cfg.num_kv_heads * cfg.kv_head_repeat):
        raise ValueError(f"num_heads={cfg.num_heads} is not a multiple of num_kv_heads={cfg.num_kv_heads}"
                         + (f" x kv_head_repeat={cfg.kv_head_repeat}" if cfg.kv_head_repeat > 1 else ""))


def repeat_kv(x, cfg):  # [B, T, Hkv, D] -> [B, T, Hkv * kv_head_repeat, D]
    """Each KV head repeated ``cfg.kv_head_repeat`` times in place (query head ``h`` keeps its KV head)."""
    return x if cfg.kv_head_repeat == 1 else jnp.repeat(x, cfg.kv_head_repeat, axis=2)


def moe_fields(text: Mapping[str, Any], num_layers: int, enabled: bool) -> dict[str, Any]:
    """A target config's MoE fields (``models.moe``) from an HF config dict: ``moe_layers`` (layer ``i`` is MoE
    when it is not in ``mlp_only_layers`` and ``(i + 1) % decoder_sparse_step == 0``), ``num_experts``,
    ``num_experts_per_tok``, ``moe_intermediate_size``, ``shared_expert_intermediate_size`` (0: none) and
    ``norm_topk_prob``; every layer dense when not ``enabled`` (a dense model type) or without experts.  The
    expert count is ``num_experts`` (the hub's configs) or ``num_local_experts`` (what transformers 5 writes)."""
    experts = int(text.get("num_experts") or text.get("num_local_experts") or 0) if enabled else 0
    size = lambda key: int(text.get(key, 0) or 0) if experts else 0  # noqa: E731
    step, only = int(text.get("decoder_sparse_step", 1) or 1), set(text.get("mlp_only_layers") or ())
    return dict(
        moe_layers=tuple(experts > 0 and i not in only and (i + 1) % step == 0 for i in range(num_layers)),
        num_experts=experts,
        num_experts_per_tok=size("num_experts_per_tok"),
        moe_intermediate_size=size("moe_intermediate_size"),
        shared_expert_intermediate_size=size("shared_expert_intermediate_size"),
        norm_topk_prob=bool(text.get("norm_topk_prob", True)) if experts else True,
    )


def check_moe(cfg) -> None:
    """Normalises ``cfg.moe_layers`` (``()``: every layer dense) and refuses inconsistent MoE fields."""
    moe = tuple(bool(m) for m in cfg.moe_layers) or (False,) * cfg.num_layers
    object.__setattr__(cfg, "moe_layers", moe)
    if len(moe) != cfg.num_layers:
        raise ValueError(f"moe_layers must have {cfg.num_layers} entries, got {len(moe)}")
    if any(moe) and not 0 < cfg.num_experts_per_tok <= cfg.num_experts:
        raise ValueError(f"MoE needs 0 < num_experts_per_tok <= num_experts, got "
                         f"{cfg.num_experts_per_tok} and {cfg.num_experts}")
    if any(moe) and cfg.moe_intermediate_size < 1:
        raise ValueError(f"MoE needs moe_intermediate_size >= 1, got {cfg.moe_intermediate_size}")


def _require(d: Mapping[str, Any], key: str) -> Any:
    if key not in d or d[key] is None:
        raise ValueError(f"config is missing required field {key!r}")
    return d[key]


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
    """The full-attention decoder: Qwen3 (the target, or the drafter's backbone with its draft layers); Llama,
    Qwen2 and Qwen3-MoE differ from it only by the switches ``qk_norm``, ``qkv_bias``, ``rope_scaling`` and the
    MoE fields (``moe_layers``: which layers' MLPs are ``models.moe`` experts)."""

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
    qk_norm: bool = True  # per-head RMSNorm of q and k before RoPE (Qwen3; not Llama / Qwen2)
    qkv_bias: bool = False  # biases on q_proj / k_proj / v_proj (Qwen2)
    rope_scaling: Llama3RoPE | None = None  # Llama 3.1 frequency scaling
    dtype: str = "bfloat16"  # activation and KV-cache dtype
    attention_impl: str = "xla"  # "xla" (reference_tree_attention) or "pallas"
    kernel_platform: str | None = None  # "tpu" | "gpu" | "cpu" (interpret mode); None: the runtime's platform
    max_position_embeddings: int | None = None  # positions the model was trained for (generate checks prompts)
    kv_head_repeat: int = 1  # the KV cache holds each KV head this many times (``sharding.for_mesh``)
    moe_layers: tuple[bool, ...] = ()  # per layer: MoE MLP (Qwen3-MoE, ``models.moe``), else dense; () = all dense
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0  # 0: no shared expert (Qwen3-MoE)
    norm_topk_prob: bool = True

    def __post_init__(self):
        object.__setattr__(self, "dtype", jnp.dtype(self.dtype).name)  # accept jnp.bfloat16, np.dtype, "float32"
        check_moe(self)
        if self.attention_impl not in ATTENTION_IMPLS:
            raise ValueError(f"attention_impl must be one of {ATTENTION_IMPLS}, got {self.attention_impl!r}")
        check_kernel_platform(self.kernel_platform)
        check_kv_heads(self)
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")

    @property
    def cache_kv_heads(self) -> int:
        """KV heads per layer in the cache: ``num_kv_heads * kv_head_repeat``."""
        return self.num_kv_heads * self.kv_head_repeat

    @classmethod
    def from_hf(cls, d: Mapping[str, Any], **overrides) -> "DecoderConfig":
        """From an HF ``Qwen3Config`` / ``LlamaConfig`` / ``Qwen2Config`` dict (``model_type`` sets the
        switches; absent or any other value: Qwen3); ``overrides`` sets ``dtype``/``attention_impl`` (or any
        field).  What these models can be configured to do and is not implemented here is refused."""
        model_type = d.get("model_type") if d.get("model_type") in families.DENSE.model_types else "qwen3"
        if d.get("use_sliding_window"):
            raise ValueError("sliding-window attention is not supported")
        if d.get("attention_bias"):
            raise ValueError("attention_bias=true (biases on q/k/v and o_proj) is not supported")
        if d.get("mlp_bias"):
            raise ValueError("mlp_bias=true is not supported")
        partial = (d.get("rope_parameters") or {}).get("partial_rotary_factor", d.get("partial_rotary_factor", 1))
        if float(partial) != 1:
            raise ValueError("partial_rotary_factor != 1 is not supported on dense models")
        if d.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act must be silu, got {d['hidden_act']!r}")
        theta, rope_scaling = _rope(d, ROPE_TYPES)
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
            rope_theta=theta,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            qkv_bias=model_type == "qwen2",
            rope_scaling=rope_scaling,
            max_position_embeddings=d.get("max_position_embeddings"),
            **moe_fields(d, int(_require(d, "num_hidden_layers")), model_type == "qwen3_moe"),
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


# Every field a DFlash/Domino drafter's config.json may carry (top level and ``dflash_config``).  Each one is
# either read by ``DrafterConfig.from_hf`` or cannot change what the drafter computes (metadata, training-only
# settings, the generic ``PretrainedConfig`` fields transformers writes); any other field is refused by name.
_DRAFTER_INERT = frozenset(
    """_name_or_path architectures auto_map model_type transformers_version dtype torch_dtype use_cache
    initializer_range attention_dropout bos_token_id eos_token_id pad_token_id sep_token_id
    decoder_start_token_id max_position_embeddings output_attentions output_hidden_states return_dict
    id2label label2id problem_type chunk_size_feed_forward is_encoder_decoder is_decoder add_cross_attention
    cross_attention_hidden_size tie_encoder_decoder torchscript use_bfloat16 tf_legacy_loss pruned_heads
    tokenizer_class prefix task_specific_params finetuning_task mask_token""".split()
)
_DRAFTER_BACKBONE = frozenset(
    """vocab_size hidden_size intermediate_size num_hidden_layers num_attention_heads num_key_value_heads
    head_dim rms_norm_eps rope_theta rope_parameters rope_scaling tie_word_embeddings hidden_act
    attention_bias""".split()
)
_DRAFTER_ATTENTION = frozenset("layer_types sliding_window use_sliding_window max_window_layers is_causal".split())
_DRAFTER_OWN = frozenset(
    """block_size num_target_layers target_layer_ids mask_token_id shift_label pure_draft_prefix_len
    projector_type emb_dim gru_hidden_dim input_embedding_scale output_multiplier
    final_logit_softcapping""".split()
)
_DRAFTER_TOP_FIELDS = _DRAFTER_INERT | _DRAFTER_BACKBONE | _DRAFTER_ATTENTION | _DRAFTER_OWN | {"dflash_config"}
_DRAFTER_DFLASH_FIELDS = _DRAFTER_OWN | {"mask_token"}
LAYER_TYPES = ("full_attention", "sliding_attention")


def _draft_attention(d: Mapping[str, Any], num_layers: int) -> tuple[tuple[bool, ...], tuple[int | None, ...]]:
    """Per draft layer ``(causal, window)`` as the ``dflash`` package builds them from an HF Qwen3 config:
    ``layer_types`` (default: sliding from ``max_window_layers`` on when ``use_sliding_window``), the window
    ``sliding_window`` only with ``use_sliding_window`` (HF drops it otherwise), and a layer causal iff
    ``is_causal`` says so, or, when it is absent, iff it is a sliding layer."""
    use_sw = bool(d.get("use_sliding_window", False))
    window = d.get("sliding_window") if use_sw else None
    types = d.get("layer_types")
    if types is None:
        first = int(d.get("max_window_layers", 28))  # HF Qwen3Config's default
        types = ["sliding_attention" if use_sw and i >= first else "full_attention" for i in range(num_layers)]
    types = tuple(types)
    if len(types) != num_layers or set(types) - set(LAYER_TYPES):
        raise ValueError(f"layer_types must list {num_layers} of {LAYER_TYPES}, got {list(types)}")
    if window is not None and (not isinstance(window, int) or window < 1):
        raise ValueError(f"sliding_window must be a positive integer, got {window!r}")
    is_causal = d.get("is_causal")
    causal = tuple(bool(is_causal) if is_causal is not None else t == "sliding_attention" for t in types)
    return causal, tuple(window if t == "sliding_attention" else None for t in types)


@dataclasses.dataclass(frozen=True)
class DrafterConfig:
    """A DFlash block drafter, optionally with Domino's GRU correction head (``has_head``)."""

    model: DecoderConfig  # the draft backbone (num_layers = draft layers; vocab = the target's)
    block_size: int
    target_layer_ids: tuple[int, ...]
    mask_token_id: int
    shift_label: bool = False
    pure_draft_prefix_len: int = 0
    projector_type: str | None = None  # None: plain DFlash (no head); "domino"/"causal_v5": Domino head
    emb_dim: int | None = None
    gru_hidden_dim: int | None = None
    num_target_layers: int | None = None  # the target's depth the drafter was trained for, when stated
    input_embedding_scale: float = 1.0  # the block's token embeddings are multiplied by it
    output_multiplier: float = 1.0  # base logits = lm_head(ph) * output_multiplier ...
    final_logit_softcapping: float | None = None  # ... then softcap * tanh(logits / softcap)
    causal_layers: tuple[bool, ...] = ()  # per draft layer: block queries see block keys at or before them
    layer_windows: tuple[int | None, ...] = ()  # per draft layer: sliding window (None: full attention)

    def __post_init__(self):
        n = self.model.num_layers
        object.__setattr__(self, "causal_layers", tuple(self.causal_layers) or (False,) * n)
        object.__setattr__(self, "layer_windows", tuple(self.layer_windows) or (None,) * n)
        if len(self.causal_layers) != n or len(self.layer_windows) != n:
            raise ValueError(f"causal_layers / layer_windows must have one entry per draft layer ({n})")
        if self.projector_type is not None and self.projector_type not in HEAD_PROJECTORS:
            raise ValueError(
                f"unknown projector_type {self.projector_type!r}; expected one of {HEAD_PROJECTORS}"
            )
        if self.has_head and (self.emb_dim is None or self.gru_hidden_dim is None):
            raise ValueError("a Domino head needs emb_dim and gru_hidden_dim")
        if self.has_head and (self.output_multiplier != 1.0 or self.final_logit_softcapping):
            raise ValueError(
                "output_multiplier / final_logit_softcapping are not defined for a Domino head (specforge's "
                "DominoDraftModel uses the target's plain lm_head); refusing this config"
            )
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
        """From a DFlash/Domino ``config.json`` dict; ``overrides`` go to the backbone (``dtype``, ...).

        Every field is either honoured or refused: unknown fields (top level or in ``dflash_config``), and
        DFlash2 checkpoints (dynamic convolutions, candidate selector), raise a ValueError naming them.
        """
        dc = d.get("dflash_config") or {}
        unknown = sorted(set(d) - _DRAFTER_TOP_FIELDS)
        unknown += [f"dflash_config.{k}" for k in sorted(set(dc) - _DRAFTER_DFLASH_FIELDS)]
        if "DFlash2DraftModel" in (d.get("architectures") or ()):
            raise ValueError(
                "DFlash2DraftModel checkpoints (dynamic convolutions, candidate selector) are not supported"
            )
        if unknown:
            raise ValueError(f"drafter config field(s) not supported: {', '.join(unknown)}")

        def pick(key, default=None, top_first=False):
            order = (d, dc) if top_first else (dc, d)
            for src in order:
                if src.get(key) is not None:
                    return src[key]
            return default

        if d.get("model_type", "qwen3") != "qwen3":
            raise ValueError(f"drafter model_type must be qwen3 (DFlash draft layers are Qwen3 layers), got "
                             f"{d['model_type']!r}")
        model = DecoderConfig.from_hf({k: v for k, v in d.items() if k not in _DRAFTER_ATTENTION}, **overrides)
        causal, windows = _draft_attention(d, model.num_layers)
        n_target = pick("num_target_layers")
        ids = pick("target_layer_ids")
        if ids is None:
            if n_target is None:
                raise ValueError("drafter config has neither target_layer_ids nor num_target_layers")
            ids = default_target_layer_ids(int(n_target), model.num_layers)
        mask = pick("mask_token_id")
        if mask is None:
            raise ValueError("drafter config is missing mask_token_id")
        emb_dim, gru = pick("emb_dim", top_first=True), pick("gru_hidden_dim")
        softcap = pick("final_logit_softcapping")
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
            num_target_layers=None if n_target is None else int(n_target),
            input_embedding_scale=float(pick("input_embedding_scale", 1.0)),
            output_multiplier=float(pick("output_multiplier", 1.0)),
            final_logit_softcapping=float(softcap) if softcap and float(softcap) > 0 else None,
            causal_layers=causal,
            layer_windows=windows,
        )
