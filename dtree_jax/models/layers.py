"""Dense-decoder building blocks shared by the target and the drafter: RMSNorm, RoPE (with Llama 3.1
scaling), SwiGLU, the decoder layer (Qwen3; Llama and Qwen2 by the config's switches).

Linear weights are stored ``[in, out]``.  Attention writes the T new tokens' K/V into a per-layer cache at
rows ``[lens, lens + T)`` of each request and attends with the tree-attention semantics of
``pallas_kernels.tree_attention`` (prefix rows ``< lens`` plus ``local_mask`` among the new tokens).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from dtree_jax.models import sharding
from dtree_jax.models.config import Llama3RoPE, DecoderConfig, repeat_kv
from dtree_jax.models.kernels import attention_kwargs, cpu_attention_wanted, cpu_ops_wanted
from dtree_jax.models.sharding import axes
from pallas_kernels.tree_attention import reference_tree_attention

Leaf = Callable[[str, bool], Any]  # (hf_key, transpose) -> array or ShapeDtypeStruct


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LayerParams:
    attn_norm: jax.Array = axes(None)  # [H] input_layernorm
    wq: jax.Array = axes(None, "heads")  # [H, Hq*D]
    wk: jax.Array = axes(None, "kv_heads")  # [H, Hkv*D]
    wv: jax.Array = axes(None, "kv_heads")  # [H, Hkv*D]
    wo: jax.Array = axes("heads", None)  # [Hq*D, H]
    q_norm: jax.Array | None = axes(None)  # [D] (None without qk_norm: Llama, Qwen2)
    k_norm: jax.Array | None = axes(None)  # [D]
    bq: jax.Array | None = axes("heads")  # [Hq*D] (None without qkv_bias: Qwen3, Llama)
    bk: jax.Array | None = axes("kv_heads")  # [Hkv*D]
    bv: jax.Array | None = axes("kv_heads")  # [Hkv*D]
    mlp_norm: jax.Array = axes(None)  # [H] post_attention_layernorm
    w_gate: jax.Array | None = axes(None, "mlp")  # [H, I] (None in an MoE layer)
    w_up: jax.Array | None = axes(None, "mlp")  # [H, I]
    w_down: jax.Array | None = axes("mlp", None)  # [I, H]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DenseMLP:
    """A SwiGLU MLP on its own (the hybrid models' dense layers, a shared expert)."""

    w_gate: jax.Array = axes(None, "mlp")  # [H, I]
    w_up: jax.Array = axes(None, "mlp")  # [H, I]
    w_down: jax.Array = axes("mlp", None)  # [I, H]


# HF names of one decoder layer's tensors (relative to ``{prefix}layers.{i}.``), LayerParams field, and
# whether the HF tensor is an ``[out, in]`` Linear weight that must be transposed.  A config has the q/k norms
# only with ``qk_norm`` and the biases only with ``qkv_bias`` (``layer_keys``).
LAYER_KEYS = (
    ("input_layernorm.weight", "attn_norm", False),
    ("self_attn.q_proj.weight", "wq", True),
    ("self_attn.k_proj.weight", "wk", True),
    ("self_attn.v_proj.weight", "wv", True),
    ("self_attn.o_proj.weight", "wo", True),
    ("self_attn.q_norm.weight", "q_norm", False),
    ("self_attn.k_norm.weight", "k_norm", False),
    ("self_attn.q_proj.bias", "bq", False),
    ("self_attn.k_proj.bias", "bk", False),
    ("self_attn.v_proj.bias", "bv", False),
    ("post_attention_layernorm.weight", "mlp_norm", False),
    ("mlp.gate_proj.weight", "w_gate", True),
    ("mlp.up_proj.weight", "w_up", True),
    ("mlp.down_proj.weight", "w_down", True),
)


def layer_keys(cfg: DecoderConfig | None, dense_mlp: bool = True) -> tuple[tuple[str, str, bool], ...]:
    """The ``LAYER_KEYS`` entries a layer of ``cfg`` has (``None``: a Qwen3 layer, as in every DFlash drafter);
    an MoE layer (not ``dense_mlp``) has no ``mlp.*`` ones (``models.moe`` lists its own)."""
    qk_norm, bias = (True, False) if cfg is None else (cfg.qk_norm, cfg.qkv_bias)
    absent = set() if qk_norm else {"q_norm", "k_norm"}
    absent |= set() if bias else {"bq", "bk", "bv"}
    absent |= set() if dense_mlp else {"w_gate", "w_up", "w_down"}
    return tuple(entry for entry in LAYER_KEYS if entry[1] not in absent)


def layer_hf_shapes(cfg: DecoderConfig, dense_mlp: bool = True) -> dict[str, tuple[int, ...]]:
    """HF shapes ``[out, in]`` of one decoder layer, keyed like ``LAYER_KEYS`` (only the keys it has)."""
    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_heads * d, cfg.num_kv_heads * d
    shapes = {
        "input_layernorm.weight": (h,),
        "self_attn.q_proj.weight": (q, h),
        "self_attn.k_proj.weight": (kv, h),
        "self_attn.v_proj.weight": (kv, h),
        "self_attn.o_proj.weight": (h, q),
        "self_attn.q_norm.weight": (d,),
        "self_attn.k_norm.weight": (d,),
        "self_attn.q_proj.bias": (q,),
        "self_attn.k_proj.bias": (kv,),
        "self_attn.v_proj.bias": (kv,),
        "post_attention_layernorm.weight": (h,),
        "mlp.gate_proj.weight": (i, h),
        "mlp.up_proj.weight": (i, h),
        "mlp.down_proj.weight": (h, i),
    }
    return {key: shapes[key] for key, _, _ in layer_keys(cfg, dense_mlp)}


def load_layer(leaf: Leaf, prefix: str, cfg: DecoderConfig | None = None, dense_mlp: bool = True) -> LayerParams:
    """Builds one layer from ``leaf(hf_key, transpose)`` with HF keys ``{prefix}{LAYER_KEYS name}``; the
    fields ``cfg`` does not have are None (``cfg=None``: a Qwen3 layer, see ``layer_keys``; an MoE layer's
    caller adds its experts: ``models.decoder.MoELayerParams``)."""
    present = {field: leaf(prefix + key, t) for key, field, t in layer_keys(cfg, dense_mlp)}
    return LayerParams(**{field: present.get(field) for _, field, _ in LAYER_KEYS})


def hf_leaf(shapes: dict[str, tuple[int, ...]], get: Callable[[str], Any], dtype, host: bool = False) -> Leaf:
    """A ``leaf`` that reads one HF tensor with ``get(key)``, checks its shape, transposes ``[out, in]``
    Linear weights to ``[in, out]`` and casts at once (peak memory: the output plus one tensor); ``host``: as a
    numpy array instead of a device array."""

    def leaf(key: str, transpose: bool) -> jax.Array:
        x = get(key)
        if tuple(x.shape) != shapes[key]:
            raise ValueError(f"{key}: expected HF shape {shapes[key]}, got {tuple(x.shape)}")
        x = x.T if transpose else x
        return np.ascontiguousarray(x, np.dtype(dtype)) if host else jnp.asarray(x, dtype)

    return leaf


def abstract_leaf(shapes: dict[str, tuple[int, ...]], dtype) -> Leaf:
    """A ``leaf`` giving the ``jax.ShapeDtypeStruct`` that ``hf_leaf`` would produce."""
    return lambda key, transpose: jax.ShapeDtypeStruct(shapes[key][::-1] if transpose else shapes[key], dtype)


@dataclasses.dataclass(frozen=True, eq=False)
class Deferred:
    """A params leaf not read yet: its ``shape`` and ``dtype`` are known (so its sharding is), its value is made
    on the host when asked for (``np.asarray``).  ``deferred_leaf`` makes them and ``derive`` composes them, so
    loading into a mesh (``models.sharding.place``) reads, places and frees one leaf at a time."""

    make: Callable[[], np.ndarray]
    shape: tuple[int, ...]
    dtype: Any

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        x = self.make()
        return x if dtype is None else x.astype(dtype)


def deferred_leaf(shapes: dict[str, tuple[int, ...]], get: Callable[[str], Any], dtype) -> Leaf:
    """A ``leaf`` like ``hf_leaf`` that reads nothing yet: each leaf is a ``Deferred`` that reads its tensor with
    ``get`` when made."""
    read, abstract = hf_leaf(shapes, get, dtype, host=True), abstract_leaf(shapes, dtype)

    def leaf(key: str, transpose: bool) -> Deferred:
        a = abstract(key, transpose)
        return Deferred(lambda: read(key, transpose), a.shape, a.dtype)

    return leaf


def derive(fn: Callable, *xs):
    """``fn(*xs)`` for leaves made by any ``Leaf`` (a leaf built from several HF tensors, or regrouped from one):
    run at once on arrays, the result's ``ShapeDtypeStruct``s on abstract leaves, and on ``Deferred`` leaves
    one ``Deferred`` per output that runs ``fn`` when first made (the outputs of one call share it)."""
    if isinstance(xs[0], jax.ShapeDtypeStruct):
        return jax.eval_shape(fn, *xs)
    if not isinstance(xs[0], Deferred):
        return fn(*xs)
    out = jax.eval_shape(fn, *(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in xs))
    pending: dict[int, np.ndarray] = {}

    def make(i: int) -> np.ndarray:
        if i not in pending:
            with jax.default_device(jax.local_devices(backend="cpu")[0]):
                result = fn(*(np.asarray(x) for x in xs))
            pending.update(enumerate(np.asarray(r) for r in (result if isinstance(out, tuple) else (result,))))
        return pending.pop(i)

    if isinstance(out, tuple):
        return tuple(Deferred(lambda i=i: make(i), o.shape, o.dtype) for i, o in enumerate(out))
    return Deferred(lambda: make(0), out.shape, out.dtype)


def check_step_inputs(tokens, positions, lens, local_mask, taps: tuple[int, ...], num_layers: int,
                      capacity: int | None) -> None:
    """A target forward's input checks (shapes, tap layers, cache room), shared by every family: ValueError
    naming what disagrees."""
    b, t = tokens.shape
    if positions.shape != (b, t) or local_mask.shape != (b, t, t) or jnp.shape(lens) != (b,):
        raise ValueError(f"shapes disagree: tokens {tokens.shape}, positions {positions.shape}, "
                         f"lens {jnp.shape(lens)}, local_mask {local_mask.shape}")
    if any(not 0 <= i < num_layers for i in taps):
        raise ValueError(f"taps {taps} out of range for {num_layers} layers")
    if capacity is not None and t > capacity:
        raise ValueError(f"{t} tokens do not fit a cache of {capacity} rows")


def tap_features(tapped: dict[int, jax.Array], normed: jax.Array, taps: tuple[int, ...], num_layers: int
                 ) -> jax.Array:  # -> [B, T, len(taps) * H]
    """The drafter's features: HF's ``hidden_states[id + 1]`` for each ``id`` in ``taps``, in order.  ``tapped[i]``
    is the residual stream ``[B, T, H]`` after layer ``i``; the last layer's is taken after the final norm
    (``normed``), as HF's ``hidden_states[L]`` is."""
    if not taps:
        return jnp.zeros(normed.shape[:2] + (0,), normed.dtype)
    tapped = {**tapped, num_layers - 1: normed}
    return jnp.concatenate([tapped[i] for i in taps], axis=-1)


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """HF Qwen3RMSNorm: normalise in fp32, cast back to ``x.dtype``, multiply by the plain weight ``w``."""
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (w * y.astype(x.dtype)).astype(x.dtype)


def rope_tables(
    positions: jax.Array,  # [...] int32
    rotary_dim: int,
    theta: float,
    scaling: Llama3RoPE | None = None,
) -> tuple[jax.Array, jax.Array]:
    """``positions [...]`` -> ``cos, sin [..., rotary_dim]`` (fp32; frequencies as ``cat(f, f)``), with
    Llama 3.1's frequency scaling when ``scaling`` is given: wavelengths above ``original / low_freq_factor``
    are stretched by ``factor``, those below ``original / high_freq_factor`` kept, and those between
    interpolated linearly in ``original / wavelength``."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, rotary_dim, 2, dtype=jnp.float32) / rotary_dim))
    if scaling is not None:
        old = scaling.original_max_position_embeddings
        wavelen = 2 * jnp.pi / inv_freq
        smooth = (old / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
        medium = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
        inv_freq = jnp.where(
            wavelen > old / scaling.low_freq_factor,
            inv_freq / scaling.factor,
            jnp.where(wavelen < old / scaling.high_freq_factor, inv_freq, medium),
        )
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    cos, sin = jnp.cos(emb), jnp.sin(emb)
    if cpu_ops_wanted():  # computed once: XLA:CPU would redo them in every layer's RoPE fusion, for every head
        from dtree_jax import cpu_dot

        cos, sin = cpu_dot.fusion_barrier(cos), cpu_dot.fusion_barrier(sin)
    return cos, sin


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


def swiglu(p: LayerParams | DenseMLP, x: jax.Array) -> jax.Array:
    """``down(silu(gate(x)) * up(x))`` for ``x [..., H]``."""
    return (jax.nn.silu(x @ p.w_gate) * (x @ p.w_up)) @ p.w_down


def kv_project(
    p: LayerParams,
    cfg: DecoderConfig,
    x: jax.Array,  # [B, T, H] (already normed: input_layernorm output, or the drafter's projected context)
    cos: jax.Array,  # [B, T, D]
    sin: jax.Array,  # [B, T, D]
) -> tuple[jax.Array, jax.Array]:
    """K (k_proj, per-head k_norm, RoPE) and V (v_proj), each ``[B, T, Hkv * kv_head_repeat, D]``: the KV heads
    as the cache holds them (``repeat_kv``)."""
    b, t, _ = x.shape
    k = _project(x, p.wk, p.bk).reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
    v = _project(x, p.wv, p.bv).reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
    return repeat_kv(apply_rope(_head_norm(k, p.k_norm, cfg), cos, sin), cfg), repeat_kv(v, cfg)


def _project(x: jax.Array, w: jax.Array, b: jax.Array | None) -> jax.Array:  # [..., in] -> [..., out]
    return x @ w if b is None else x @ w + b


def _head_norm(x: jax.Array, w: jax.Array | None, cfg: DecoderConfig) -> jax.Array:  # [B, T, heads, D]
    """Qwen3's per-head q/k RMSNorm; the identity for models without one (``w`` None)."""
    return x if w is None else rms_norm(x, w, cfg.rms_norm_eps)


def write_rows(cache: jax.Array, new: jax.Array, lens: jax.Array) -> jax.Array:
    """Writes ``new [B, T, ...]`` into ``cache [B, S, ...]`` at rows ``[lens, lens + T)`` of each request.

    Needs ``lens + T <= S``: beyond that ``dynamic_update_slice`` clamps the start and overwrites earlier rows.
    """
    new = new.astype(cache.dtype)
    return jax.vmap(lambda c, n, l: jax.lax.dynamic_update_slice_in_dim(c, n, l, axis=0))(
        cache, new, jnp.asarray(lens, jnp.int32)
    )


def attend(
    cfg: DecoderConfig,
    q: jax.Array,  # [B, T, Hq, D]
    k: jax.Array,  # [B, S, Hkv, D]
    v: jax.Array,  # [B, S, Hkv, D]
    lens: jax.Array,  # [B]
    local_mask: jax.Array,  # [B, T, T]
    window: int | None = None,
) -> jax.Array:  # [B, T, Hq, D]
    """Tree attention dispatched on ``cfg.attention_impl`` and ``cfg.kernel_platform`` by
    ``models.kernels.attention_kwargs`` (the Pallas kernel is imported lazily; under a mesh it runs per shard,
    ``sharding.head_plan``; the XLA path runs ``cpu_dot.tree_attention`` where ``cpu_attention_wanted``);
    ``window`` as in ``reference_tree_attention`` (sliding-window drafter layers)."""
    scale = cfg.head_dim**-0.5
    kw = attention_kwargs(cfg)
    if kw["backend"] == "xla":
        if window is None and cpu_attention_wanted(cfg):
            from dtree_jax import cpu_dot

            if cpu_dot.attends(q, k):
                return cpu_dot.tree_attention(q, k, v, lens, local_mask, scale).astype(q.dtype)
        return reference_tree_attention(q, k, v, lens, local_mask, scale=scale, window=window)
    from pallas_kernels.tree_attention import tree_attention

    kernel = lambda q, k, v, lens, mask: tree_attention(q, k, v, lens, mask, scale=scale, window=window, **kw)
    mesh = sharding.context_mesh()
    if mesh is None:
        return kernel(q, k, v, lens, local_mask)
    data, qh, kvh, select = sharding.head_plan(mesh, q.shape[0], q.shape[2], k.shape[2])

    def local(q, k, v, lens, mask):  # one shard: its requests and query heads, their kv heads
        if select:
            k, v = (sharding.select_kv_head(x, k.shape[2], axis=2) for x in (k, v))
        return kernel(q, k, v, lens, mask)

    heads = lambda h: PartitionSpec(data, None, h, None)  # noqa: E731  [B, T|S, heads, D]
    specs = (heads(qh), heads(kvh), heads(kvh), PartitionSpec(data), PartitionSpec(data))
    return sharding.per_shard(local, specs, heads(qh))(
        q, k, v, lens, local_mask)


def decoder_layer(
    p: LayerParams,
    cfg: DecoderConfig,
    x: jax.Array,  # [B, T, H] residual stream
    cos: jax.Array,  # [B, T, D] RoPE tables at the tokens' positions
    sin: jax.Array,  # [B, T, D]
    k_cache: jax.Array,  # [B, S, Hkv, D]
    v_cache: jax.Array,  # [B, S, Hkv, D]
    lens: jax.Array,  # [B] rows already in the cache
    local_mask: jax.Array,  # [B, T, T]
    window: int | None = None,
    mlp: Callable[[LayerParams, jax.Array], jax.Array] = swiglu,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One Qwen3 decoder layer; returns the new residual stream and the caches with the T new rows written.
    ``window``: sliding-window attention (see ``attend``); ``mlp(p, x)``: the layer's MLP (an MoE model's
    dispatches on the layer's type)."""
    b, t, _ = x.shape
    h = rms_norm(x, p.attn_norm, cfg.rms_norm_eps)
    q = _project(h, p.wq, p.bq).reshape(b, t, cfg.num_heads, cfg.head_dim)
    q = apply_rope(_head_norm(q, p.q_norm, cfg), cos, sin)
    k, v = kv_project(p, cfg, h, cos, sin)
    k_cache = write_rows(k_cache, k, lens)
    v_cache = write_rows(v_cache, v, lens)
    o = attend(cfg, q, k_cache, v_cache, lens, local_mask, window)
    x = x + o.reshape(b, t, cfg.num_heads * cfg.head_dim) @ p.wo
    x = x + mlp(p, rms_norm(x, p.mlp_norm, cfg.rms_norm_eps))
    return x, k_cache, v_cache
