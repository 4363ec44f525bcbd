"""Static, hashable model configs built from HF ``config.json`` dicts (pass them to jitted code as is).

A checkpoint's config is untrusted: every field is read by one of the typed readers (``config_int``,
``config_ints``, ``config_float``, ``config_bool``, ``config_str``, ``config_strs``, ``config_dict``), which
refuse a value of the wrong JSON type or outside its sane range (``MAX_LAYERS``, ...) with a ValueError naming
the field, before anything is built from it."""

from __future__ import annotations

import dataclasses
import numbers
import reprlib
import sys
from typing import Any, Callable, Mapping, NoReturn

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


# Sane upper limits for HF config fields: past them a config is refused before anything is built from it.
MAX_LAYERS = 1024
MAX_HEADS = 1024
MAX_WIDTH = 2**20  # hidden, intermediate and head sizes
MAX_VOCAB = 2**24
MAX_EXPERTS = 4096
MAX_POSITIONS = 2**30
MAX_BLOCK = 1024  # a drafter's block_size
MAX_CONV_KERNEL = 1024
_REQUIRED = object()  # ``default`` of a field that must be present


def _refuse(key: str, expected: str, value: Any) -> NoReturn:
    """The ValueError of a malformed field: ``key: expected ..., got <value, shortened>``."""
    raise ValueError(f"{key}: expected {expected}, got {reprlib.repr(value)}")


def _read(d: Mapping[str, Any], key: str, default: Any, parse: Callable[[Any], Any]) -> Any:
    """``parse(d[key])``; ``default`` (returned as is) when the field is absent or null, a ValueError when it
    is required (``default`` not given)."""
    value = d.get(key)
    if value is not None:
        return parse(value)
    if default is _REQUIRED:
        raise ValueError(f"config is missing required field {key!r}")
    return default


def _integer(value: Any, key: str, low: int, high: int) -> int:
    """``value`` as an int in ``[low, high]``: a JSON integer or an integral float (``2.0``), never a bool, a
    fractional, infinite or NaN float, or a string."""
    integral = isinstance(value, numbers.Integral) or isinstance(value, float) and value.is_integer()
    if isinstance(value, bool) or not integral or not low <= value <= high:
        _refuse(key, f"an integer in [{low}, {high}]", value)
    return int(value)


def config_int(d: Mapping[str, Any], key: str, *, default: Any = _REQUIRED, low: int = 1,
               high: int = MAX_WIDTH) -> int:
    """Integer field ``key`` of an HF config dict, in ``[low, high]``: a JSON integer or an integral float
    (``2.0``), not a bool, a fractional float (``2.7``), Infinity, NaN or a string; absent or null:
    ``default``."""
    return _read(d, key, default, lambda v: _integer(v, key, low, high))


def config_ints(d: Mapping[str, Any], key: str, *, default: Any = _REQUIRED, low: int = 0,
                high: int = MAX_LAYERS - 1, max_len: int = MAX_LAYERS) -> tuple[int, ...]:
    """A list of at most ``max_len`` integers, each in ``[low, high]``; absent or null: ``default``."""

    def parse(value):
        if not isinstance(value, (list, tuple)) or len(value) > max_len:
            _refuse(key, f"a list of at most {max_len} integers", value)
        return tuple(_integer(v, f"{key}[{i}]", low, high) for i, v in enumerate(value))

    return _read(d, key, default, parse)


def config_float(d: Mapping[str, Any], key: str, *, default: Any = _REQUIRED,
                 positive: bool = False) -> float:
    """A finite number (a JSON integer or float, not a bool), ``> 0`` when ``positive``; absent or null:
    ``default``."""

    def parse(value):
        real = isinstance(value, numbers.Real) and not isinstance(value, bool)
        if not (real and abs(value) <= sys.float_info.max) or positive and value <= 0:  # NaN fails the bound
            _refuse(key, f"a finite{' positive' if positive else ''} number", value)
        return float(value)

    return _read(d, key, default, parse)


def config_bool(d: Mapping[str, Any], key: str, default: bool | None) -> bool | None:
    """A JSON boolean (not 0 / 1 or a string); absent or null: ``default``."""
    return _read(d, key, default, lambda v: v if isinstance(v, bool) else _refuse(key, "true or false", v))


def config_str(d: Mapping[str, Any], key: str, *, default: Any = _REQUIRED) -> str:
    """A JSON string; absent or null: ``default``."""
    return _read(d, key, default, lambda v: v if isinstance(v, str) else _refuse(key, "a string", v))


def config_strs(d: Mapping[str, Any], key: str, *, default: Any = _REQUIRED,
                choices: tuple[str, ...] | None = None, length: int | None = None) -> tuple[str, ...]:
    """A list of strings (each one of ``choices`` when given; ``length`` of them when given); absent or null:
    ``default``."""

    def parse(value):
        ok = isinstance(value, (list, tuple)) and (length is None or len(value) == length)
        if not ok or not all(isinstance(s, str) and (choices is None or s in choices) for s in value):
            counted = "a list of" if length is None else f"a list of {length}"
            _refuse(key, f"{counted} strings" + ("" if choices is None else f" from {list(choices)}"), value)
        return tuple(value)

    return _read(d, key, default, parse)


def config_dict(d: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    """A JSON object field (``rope_parameters``, ``text_config``, ...); absent or null: ``{}``."""
    return _read(d, key, {}, lambda v: v if isinstance(v, Mapping) else _refuse(key, "a JSON object", v))


def rope_parameter(d: Mapping[str, Any], key: str, default: Any = None) -> float | None:
    """Positive RoPE parameter ``key`` from ``rope_parameters`` (transformers 5 saves), else the top level
    (the hub form); absent: ``default``."""
    rp = config_dict(d, "rope_parameters")
    return config_float(rp if rp.get(key) is not None else d, key, default=default, positive=True)


_LLAMA3_FIELDS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def _rope(d: Mapping[str, Any], allowed: tuple[str, ...] = ("default",)) -> tuple[float, Llama3RoPE | None]:
    """``(rope_theta, llama3 scaling or None)`` from ``rope_parameters`` (transformers 5 saves) or the hub
    form (top-level ``rope_theta``, ``rope_scaling``); any RoPE type outside ``allowed`` is refused."""
    rp, scaling = config_dict(d, "rope_parameters"), config_dict(d, "rope_scaling")
    kinds = {config_str(spec, "rope_type", default=config_str(spec, "type", default="default"))
             for spec in (rp, scaling)} - {"default"}
    if len(kinds) > 1 or not kinds <= set(allowed):
        raise ValueError(f"unsupported rope_type {sorted(kinds)}: implemented here: {list(allowed)}")
    theta = rope_parameter(d, "rope_theta")
    if theta is None:
        raise ValueError("config has neither rope_theta nor rope_parameters.rope_theta")
    if not kinds:
        return theta, None
    spec = {**scaling, **rp}
    missing = [key for key in _LLAMA3_FIELDS if spec.get(key) is None]
    if missing:
        raise ValueError(f"rope_type llama3 needs {missing[0]!r} in rope_parameters / rope_scaling")
    llama3 = Llama3RoPE(
        *(config_float(spec, key, positive=True) for key in _LLAMA3_FIELDS[:3]),
        original_max_position_embeddings=config_int(spec, _LLAMA3_FIELDS[3], high=MAX_POSITIONS),
    )
    if llama3.high_freq_factor <= llama3.low_freq_factor:
        raise ValueError("rope_type llama3 needs high_freq_factor > low_freq_factor")
    return theta, llama3


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
        raise ValueError(f"num_heads={cfg.num_heads} (num_attention_heads) is not a multiple of "
                         f"num_kv_heads={cfg.num_kv_heads} (num_key_value_heads)"
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
    count = lambda key: config_int(text, key, default=0, low=0, high=MAX_EXPERTS)  # noqa: E731
    experts = (count("num_experts") or count("num_local_experts")) if enabled else 0
    if not experts:
        return dict(moe_layers=(False,) * num_layers, num_experts=0, num_experts_per_tok=0,
                    moe_intermediate_size=0, shared_expert_intermediate_size=0, norm_topk_prob=True)
    step = config_int(text, "decoder_sparse_step", default=1, high=MAX_LAYERS)
    only = set(config_ints(text, "mlp_only_layers", default=(), high=num_layers - 1))
    return dict(
        moe_layers=tuple(i not in only and (i + 1) % step == 0 for i in range(num_layers)),
        num_experts=experts,
        num_experts_per_tok=config_int(text, "num_experts_per_tok", default=0, low=0, high=experts),
        moe_intermediate_size=config_int(text, "moe_intermediate_size", default=0, low=0),
        shared_expert_intermediate_size=config_int(text, "shared_expert_intermediate_size", default=0, low=0),
        norm_topk_prob=config_bool(text, "norm_topk_prob", True),
    )


def attention_fields(d: Mapping[str, Any]) -> dict[str, Any]:
    """The fields every target config reads alike: ``vocab_size``, ``hidden_size``, ``num_layers``,
    ``num_heads``, ``num_kv_heads`` (absent: ``num_heads``), ``head_dim`` (absent: ``hidden_size /
    num_heads``, which must divide), ``rms_norm_eps`` and ``max_position_embeddings`` (absent: no limit; else
    >= 1)."""
    hidden, heads = config_int(d, "hidden_size"), config_int(d, "num_attention_heads", high=MAX_HEADS)
    if d.get("head_dim") is None and hidden % heads:
        raise ValueError(f"hidden_size={hidden} is not a multiple of num_attention_heads={heads} (and "
                         "head_dim is absent)")
    return dict(
        vocab_size=config_int(d, "vocab_size", high=MAX_VOCAB),
        hidden_size=hidden,
        num_layers=config_int(d, "num_hidden_layers", high=MAX_LAYERS),
        num_heads=heads,
        num_kv_heads=config_int(d, "num_key_value_heads", default=heads, high=MAX_HEADS),
        head_dim=config_int(d, "head_dim", default=hidden // heads),
        rms_norm_eps=config_float(d, "rms_norm_eps", default=1e-6, positive=True),
        max_position_embeddings=config_int(d, "max_position_embeddings", default=None, high=MAX_POSITIONS),
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
        if config_bool(d, "use_sliding_window", False):
            raise ValueError("sliding-window attention is not supported")
        if config_bool(d, "attention_bias", False):
            raise ValueError("attention_bias=true (biases on q/k/v and o_proj) is not supported")
        if config_bool(d, "mlp_bias", False):
            raise ValueError("mlp_bias=true is not supported")
        if rope_parameter(d, "partial_rotary_factor", default=1.0) != 1:
            raise ValueError("partial_rotary_factor != 1 is not supported on dense models")
        if config_str(d, "hidden_act", default="silu") != "silu":
            raise ValueError(f"hidden_act must be silu, got {d['hidden_act']!r}")
        theta, rope_scaling = _rope(d, ROPE_TYPES)
        shared = attention_fields(d)
        fields = dict(
            **shared,
            intermediate_size=config_int(d, "intermediate_size"),
            rope_theta=theta,
            tie_word_embeddings=config_bool(d, "tie_word_embeddings", False),
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            qkv_bias=model_type == "qwen2",
            rope_scaling=rope_scaling,
            **moe_fields(d, shared["num_layers"], model_type == "qwen3_moe"),
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
    use_sw = config_bool(d, "use_sliding_window", False)
    window = config_int(d, "sliding_window", default=None, high=MAX_POSITIONS) if use_sw else None
    types = config_strs(d, "layer_types", default=None, choices=LAYER_TYPES, length=num_layers)
    if types is None:
        first = config_int(d, "max_window_layers", default=28, low=0, high=MAX_LAYERS)  # HF Qwen3Config's
        types = tuple("sliding_attention" if use_sw and i >= first else "full_attention"
                      for i in range(num_layers))
    is_causal = config_bool(d, "is_causal", None)
    causal = tuple(is_causal if is_causal is not None else t == "sliding_attention" for t in types)
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
        dc = config_dict(d, "dflash_config")
        unknown = sorted(set(d) - _DRAFTER_TOP_FIELDS)
        unknown += [f"dflash_config.{k}" for k in sorted(set(dc) - _DRAFTER_DFLASH_FIELDS)]
        if "DFlash2DraftModel" in config_strs(d, "architectures", default=()):
            raise ValueError(
                "DFlash2DraftModel checkpoints (dynamic convolutions, candidate selector) are not supported"
            )
        if unknown:
            raise ValueError(f"drafter config field(s) not supported: {', '.join(unknown)}")
        if d.get("model_type", "qwen3") != "qwen3":
            raise ValueError(f"drafter model_type must be qwen3 (DFlash draft layers are Qwen3 layers), got "
                             f"{d['model_type']!r}")
        model = DecoderConfig.from_hf({k: v for k, v in d.items() if k not in _DRAFTER_ATTENTION}, **overrides)
        causal, windows = _draft_attention(d, model.num_layers)
        return cls(model=model, causal_layers=causal, layer_windows=windows, **_drafter_fields(d, dc, model))


def _drafter_fields(d: Mapping[str, Any], dc: Mapping[str, Any], model: DecoderConfig) -> dict[str, Any]:
    """A drafter's own ``DrafterConfig`` fields, each from ``dflash_config`` (``dc``) where it sets them, else
    from the top level (``emb_dim``: the other way round)."""

    def src(key: str, top_first: bool = False) -> Mapping[str, Any]:
        first, second = (d, dc) if top_first else (dc, d)
        return first if first.get(key) is not None else second

    n_target = config_int(src("num_target_layers"), "num_target_layers", default=None, high=MAX_LAYERS)
    last_layer = (n_target or MAX_LAYERS) - 1
    ids = config_ints(src("target_layer_ids"), "target_layer_ids", default=None, high=last_layer)
    if ids is None and n_target is None:
        raise ValueError("drafter config has neither target_layer_ids nor num_target_layers")
    block_size = config_int(src("block_size"), "block_size", default=16, low=2, high=MAX_BLOCK)
    softcap = config_float(src("final_logit_softcapping"), "final_logit_softcapping", default=None)
    return dict(
        block_size=block_size,
        target_layer_ids=default_target_layer_ids(n_target, model.num_layers) if ids is None else ids,
        mask_token_id=config_int(src("mask_token_id"), "mask_token_id", low=0, high=model.vocab_size - 1),
        shift_label=config_bool(src("shift_label"), "shift_label", False),
        pure_draft_prefix_len=config_int(src("pure_draft_prefix_len"), "pure_draft_prefix_len", default=0,
                                         low=0, high=block_size),
        projector_type=config_str(src("projector_type"), "projector_type", default=None),
        emb_dim=config_int(src("emb_dim", top_first=True), "emb_dim", default=None),
        gru_hidden_dim=config_int(src("gru_hidden_dim"), "gru_hidden_dim", default=None),
        num_target_layers=n_target,
        input_embedding_scale=config_float(src("input_embedding_scale"), "input_embedding_scale",
                                           default=1.0),
        output_multiplier=config_float(src("output_multiplier"), "output_multiplier", default=1.0),
        final_logit_softcapping=softcap if softcap is not None and softcap > 0 else None,
    )
