"""Verify attention over [committed prefix of per-request length | new tokens with a local mask].

The cache already holds the new tokens' K/V at rows ``[lens, lens + T)`` of each request.  Query ``t`` sees
every cache row below ``lens`` and the new row ``lens + s`` iff ``local_mask[t, s]``: the ancestor-or-self
mask of a draft tree, the causal mask for prefill, or all-true for the drafter's non-causal block.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu


def ancestor_bits(mask: jax.Array) -> jax.Array:  # [..., N, N] bool -> [..., N, ceil(N/32)] uint32
    """Packs each mask row into 32-bit words: bit ``j % 32`` of word ``j // 32`` is ``mask[i, j]``."""
    n = mask.shape[-1]
    words = -(-n // 32)
    padded = jnp.pad(mask.astype(jnp.uint32), [(0, 0)] * (mask.ndim - 1) + [(0, words * 32 - n)])
    padded = padded.reshape(mask.shape[:-1] + (words, 32))
    shifts = jnp.arange(32, dtype=jnp.uint32)
    return jnp.sum(padded << shifts, axis=-1, dtype=jnp.uint32)


def mask_from_bits(bits: jax.Array, n: int) -> jax.Array:  # [..., N, W] uint32 -> [..., N, n] bool
    """Unpacks ``ancestor_bits`` (the inverse, for tests and debugging)."""
    j = jnp.arange(n)
    words = jnp.take(bits, j // 32, axis=-1)
    return ((words >> (j % 32).astype(jnp.uint32)) & 1) == 1


def reference_tree_attention(
    q: jax.Array,  # [B, T, H, D] queries, RoPE applied
    k: jax.Array,  # [B, S, Hkv, D] key cache (new tokens written at [lens, lens + T))
    v: jax.Array,  # [B, S, Hkv, D] value cache
    lens: jax.Array,  # [B] int32 committed length before the T new tokens
    local_mask: jax.Array,  # [B, T, T] bool visibility among the new tokens
    *,
    scale: float,
    window: int | None = None,
) -> jax.Array:  # [B, T, H, D]
    """Pure-jnp GQA attention with fp32 softmax; the XLA path and the oracle of the Pallas kernels.

    ``window`` (sliding-window layers) hides committed rows ``r <= lens + t - window`` from query ``t``: the
    rows more than ``window - 1`` positions before it when query ``t`` sits at position ``lens + t`` (a drafter
    block or a prefill chunk).  Visibility among the new tokens is the caller's ``local_mask``.
    """
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
    committed = jnp.broadcast_to((cols < lens)[:, None, :], (b, t, s))  # [B, T, S]
    if window is not None:
        query_pos = lens[:, :, None] + jnp.arange(t, dtype=jnp.int32)[None, :, None]  # [B, T, 1]
        committed = committed & (query_pos - cols[:, None, :] < window)
    visible = committed | (in_new[:, None, :] & local)  # [B, T, S]
    qg = q.reshape(b, t, hkv, g, d)
    logits = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32) * scale
    logits = jnp.where(visible[:, None, None], logits, -jnp.inf)
    probs = jax.nn.softmax(logits, axis=-1)
    probs = jnp.where(jnp.isnan(probs), 0.0, probs)  # a row with nothing visible yields zeros
    out = jnp.einsum("bkgts,bskd->btkgd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out.reshape(b, t, h, d).astype(q.dtype)


# ----------------------------------------------------------------------------------------------------------
# Pallas kernels
#
# Both variants regroup the queries per kv head: row ``r = t * g + j`` of a ``[B, Hkv, R, D]`` block holds
# query token ``t`` of head ``kv * g + j``, so one K/V tile feeds all ``g`` heads that share it.  The cache is
# read through the free view ``[B, S, Hkv * D]`` (block ``(block_kv, D)`` at column block ``kv``), never
# transposed.  The local mask travels as ancestor bits (``ancestor_bits``: ``W = ceil(T/32)``
# int32 words per query row, any bool mask works, not only trees); each tile computes its own mask from
# ``lens`` and those words, so no ``[T, S]`` mask exists anywhere.
# ----------------------------------------------------------------------------------------------------------

_MASKED = -1e30  # finite, so fully masked rows never produce inf - inf
_BACKENDS = ("tpu", "gpu", "xla")


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def _visible(
    cols: jax.Array,  # [1, block_kv] int32 absolute cache rows of the tile
    length: jax.Array,  # [] int32 committed length of this request
    t: int,  # number of new tokens
    row_words: list[jax.Array],  # W x [block_q, 1] int32 ancestor-bit words of each query row
    window: int | None = None,
    query_pos: jax.Array | None = None,  # [block_q, 1] int32 position of each row's query (needed with window)
) -> jax.Array:  # [block_q, block_kv] bool
    """Tile mask: committed rows visible (with a window, only the ``window - 1`` rows before the query's position
    and later), new row ``length + s`` iff bit ``s`` of the query's words."""
    rel = cols - length
    in_new = (rel >= 0) & (rel < t)
    rel = jnp.clip(rel, 0, t - 1)
    word_idx, shift = rel >> 5, rel & 31
    word = row_words[0]
    for w in range(1, len(row_words)):
        word = jnp.where(word_idx == w, row_words[w], word)
    bit = (word >> shift) & 1
    committed = cols < length
    if window is not None:
        committed = committed & (query_pos - cols < window)
    return committed | (in_new & (bit == 1))


def _tile_range(length, t: int, block_kv: int, window: int | None):
    """``(first, first_full, n_full, n_tiles)``: kv tiles ``[first, n_tiles)`` hold a row some query sees;
    those in ``[first_full, n_full)`` are visible to every query (no mask needed), the rest need the mask.
    ``first <= first_full <= n_full <= n_tiles``; without a window ``first = first_full = 0``."""
    n_tiles = lax.div(length + t + block_kv - 1, block_kv)
    n_full = lax.div(length, block_kv)  # tiles entirely below the committed length
    if window is None:
        zero = jnp.zeros_like(length)
        return zero, zero, n_full, n_tiles
    # Query 0 (position length) sees committed rows >= length - window + 1; the last query (length + t - 1)
    # sees every committed row >= length + t - window.  lax.div: operands are >= 0 (no sign fix-up).
    first = lax.div(jnp.maximum(length - window + 1, 0), block_kv)
    first_full = lax.div(jnp.maximum(length + t - window, 0) + block_kv - 1, block_kv)
    first_full = jnp.clip(first_full, first, n_full)
    return first, first_full, n_full, n_tiles


def _attend(q, k, v, m, l, acc, visible, *, scale, precision):
    """One online-softmax step over a K/V tile.

    q [bq, D], k/v [bkv, D], m/l [bq, 1] f32 running max/denominator, acc [bq, D] f32, visible [bq, bkv] bool
    or None (every column visible).  Masked columns contribute exactly zero, so a row that sees nothing
    keeps ``l == 0``.
    """
    s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32, precision=precision)
    s = s * scale
    if visible is not None:
        s = jnp.where(visible, s, _MASKED)
    m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
    p = jnp.exp(s - m_new)
    if visible is not None:
        p = jnp.where(visible, p, 0.0)
    alpha = jnp.exp(m - m_new)
    pv = lax.dot_general(
        p.astype(v.dtype), v, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32, precision=precision
    )
    return m_new, alpha * l + jnp.sum(p, axis=1, keepdims=True), alpha * acc + pv


def _precision(dtype):
    return (lax.Precision.HIGHEST, lax.Precision.HIGHEST) if dtype == jnp.float32 else None


def _tpu_kernel(
    lens_ref,  # [B] int32 in SMEM (scalar prefetch): committed rows per request
    q_ref,  # [block_q, Dp] query rows of one (request, kv head): row t*g + j is query t's j-th head of the group
    k_ref,  # [block_kv, Dp] one kv tile of the cache
    v_ref,  # [block_kv, Dp]
    bits_ref,  # [block_q, W] int32 ancestor bits of each query row's node
    o_ref,  # [block_q, Dp] out
    m_ref,  # [block_q, 128] fp32 scratch: running max (lane-broadcast)
    l_ref,  # [block_q, 128] fp32 scratch: running denominator
    acc_ref,  # [block_q, Dp] fp32 scratch: running numerator
    *, scale, t, words, g, window,
):
    """Grid (B, Hkv, q tiles, kv tiles); the kv axis is sequential with the softmax state in VMEM scratch."""
    b, i, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    block_q, block_kv = q_ref.shape[0], k_ref.shape[0]
    length = lens_ref[b]
    start = j * block_kv
    first, first_full, n_full, n_tiles = _tile_range(length, t, block_kv, window)

    @pl.when(j == 0)
    def _init():
        m_ref[...] = jnp.full(m_ref.shape, _MASKED, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    def step(masked: bool):
        visible = None
        if masked:
            cols = start + lax.broadcasted_iota(jnp.int32, (1, block_kv), 1)
            query_pos = None
            if window is not None:  # kernel row r = t * g + j holds query token r // g
                rows = i * block_q + lax.broadcasted_iota(jnp.int32, (block_q, 1), 0)
                query_pos = length + lax.div(rows, g)
            visible = _visible(cols, length, t, [bits_ref[:, w : w + 1] for w in range(words)], window, query_pos)
        m, l, acc = _attend(
            q_ref[...], k_ref[...], v_ref[...], m_ref[:, 0:1], l_ref[:, 0:1], acc_ref[...], visible,
            scale=scale, precision=_precision(q_ref.dtype),
        )
        m_ref[...] = jnp.broadcast_to(m, m_ref.shape)
        l_ref[...] = jnp.broadcast_to(l, l_ref.shape)
        acc_ref[...] = acc

    # Tiles every query sees whole need no mask; tiles past length + t, or (with a window) entirely before
    # the oldest row any query sees, are skipped (their index_map is clamped to the nearest needed tile, so
    # no new DMA is issued either).
    full = (j >= first_full) & (j < n_full)
    pl.when(full)(lambda: step(False))
    pl.when(~full & (j >= first) & (j < n_tiles))(lambda: step(True))

    @pl.when(j == pl.num_programs(3) - 1)
    def _finish():
        l = l_ref[:, 0:1]
        o_ref[...] = jnp.where(l > 0, acc_ref[...] / jnp.where(l > 0, l, 1.0), 0.0).astype(o_ref.dtype)


def _tpu_call(qr, kf, vf, lens, bits, *, scale, t, g, window, block_q, block_kv, interpret, vmem_limit_bytes=None):
    """qr [B, Hkv, R, D], kf/vf [B, S, Hkv*D], lens [B], bits [B, R, W] int32 -> [B, Hkv, R, D] in qr.dtype."""
    b, hkv, r, d = qr.shape
    s, words = kf.shape[1], bits.shape[2]

    def kv_map(bi, h, i, j, lens_ref):
        first, _, _, n_tiles = _tile_range(lens_ref[bi], t, block_kv, window)
        return bi, jnp.clip(j, first, n_tiles - 1), h

    sq = pl.Squeezed()
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1,
        grid=(b, hkv, r // block_q, s // block_kv),
        in_specs=[
            pl.BlockSpec((sq, sq, block_q, d), lambda bi, h, i, j, lens_ref: (bi, h, i, 0)),
            pl.BlockSpec((sq, block_kv, d), kv_map),
            pl.BlockSpec((sq, block_kv, d), kv_map),
            pl.BlockSpec((sq, block_q, words), lambda bi, h, i, j, lens_ref: (bi, i, 0)),
        ],
        out_specs=pl.BlockSpec((sq, sq, block_q, d), lambda bi, h, i, j, lens_ref: (bi, h, i, 0)),
        scratch_shapes=[
            pltpu.VMEM((block_q, 128), jnp.float32),
            pltpu.VMEM((block_q, 128), jnp.float32),
            pltpu.VMEM((block_q, d), jnp.float32),
        ],
    )
    return pl.pallas_call(
        functools.partial(_tpu_kernel, scale=scale, t=t, words=words, g=g, window=window),
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct(qr.shape, qr.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel", "arbitrary"),
                                             vmem_limit_bytes=vmem_limit_bytes),
        interpret=interpret,
    )(lens, qr, kf, vf, bits)


def _gpu_kernel(
    lens_ref,  # [B] int32 committed rows per request
    q_ref,  # [block_q, D] query rows of one (request, kv head)
    k_ref,  # [S, D] the request's cache for this kv head (tiles read with pl.ds)
    v_ref,  # [S, D]
    bits_ref,  # [W, block_q] int32 ancestor bits, transposed (one word row per 32 tree nodes)
    acc_out,  # [block_q, D] out fp32: this split's unnormalised numerator
    m_out,  # [block_q] out fp32: this split's running max
    l_out,  # [block_q] out fp32: this split's denominator
    *, scale, t, g, window, block_kv, splits,
):
    """Grid (B, Hkv, q tiles, splits); each program loops over its share of the needed kv tiles."""
    b, i, sp = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    length = lens_ref[b]
    first, first_full, n_full, n_tiles = _tile_range(length, t, block_kv, window)
    per = lax.div(n_tiles - first + splits - 1, splits)
    lo = first + sp * per
    hi = jnp.minimum(lo + per, n_tiles)
    q = q_ref[...]
    bq, d = q.shape
    row_words = [bits_ref[w, :][:, None] for w in range(bits_ref.shape[0])]
    query_pos = None
    if window is not None:  # kernel row r = t * g + j holds query token r // g
        query_pos = length + lax.div(i * bq + lax.broadcasted_iota(jnp.int32, (bq, 1), 0), g)
    precision = _precision(q_ref.dtype)

    def body(masked: bool):
        def fn(j, state):
            start = pl.multiple_of(j * block_kv, block_kv)
            k, v = k_ref[pl.ds(start, block_kv), :], v_ref[pl.ds(start, block_kv), :]
            visible = None
            if masked:
                cols = start + lax.broadcasted_iota(jnp.int32, (1, block_kv), 1)
                visible = _visible(cols, length, t, row_words, window, query_pos)
            return _attend(q, k, v, *state, visible, scale=scale, precision=precision)

        return fn

    state = (
        jnp.full((bq, 1), _MASKED, jnp.float32),
        jnp.zeros((bq, 1), jnp.float32),
        jnp.zeros((bq, d), jnp.float32),
    )
    # [first, first_full) masked (window edge), [first_full, n_full) unmasked, [n_full, n_tiles) masked.
    if window is not None:
        state = lax.fori_loop(lo, jnp.minimum(hi, first_full), body(True), state)
    state = lax.fori_loop(jnp.maximum(lo, first_full), jnp.minimum(hi, n_full), body(False), state)
    m, l, acc = lax.fori_loop(jnp.maximum(lo, n_full), hi, body(True), state)
    acc_out[...] = acc
    m_out[...] = m[:, 0]
    l_out[...] = l[:, 0]


def _gpu_call(qr, kf, vf, lens, bits, *, scale, t, g, window, block_q, block_kv, splits, num_warps, num_stages,
              interpret):
    """qr [B, Hkv, R, D], kf/vf [B, S, Hkv*D], lens [B], bits [B, W, R] int32 -> [B, Hkv, R, D] in qr.dtype.

    Split-K (flash-decoding): ``splits`` programs share each row block's needed kv tiles and emit
    unnormalised partial results that are merged here in fp32.
    """
    from jax.experimental.pallas import triton as pltriton  # deprecated in jax 0.11: imported only when used

    b, hkv, r, d = qr.shape
    s, words = kf.shape[1], bits.shape[1]
    sq = pl.Squeezed()
    acc, m, l = pl.pallas_call(
        functools.partial(_gpu_kernel, scale=scale, t=t, g=g, window=window, block_kv=block_kv, splits=splits),
        grid=(b, hkv, r // block_q, splits),
        in_specs=[
            pl.BlockSpec((b,), lambda bi, h, i, sp: (0,)),
            pl.BlockSpec((sq, sq, block_q, d), lambda bi, h, i, sp: (bi, h, i, 0)),
            pl.BlockSpec((sq, s, d), lambda bi, h, i, sp: (bi, 0, h)),
            pl.BlockSpec((sq, s, d), lambda bi, h, i, sp: (bi, 0, h)),
            pl.BlockSpec((sq, words, block_q), lambda bi, h, i, sp: (bi, 0, i)),
        ],
        out_specs=[
            pl.BlockSpec((sq, sq, sq, block_q, d), lambda bi, h, i, sp: (bi, h, sp, i, 0)),
            pl.BlockSpec((sq, sq, sq, block_q), lambda bi, h, i, sp: (bi, h, sp, i)),
            pl.BlockSpec((sq, sq, sq, block_q), lambda bi, h, i, sp: (bi, h, sp, i)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((b, hkv, splits, r, d), jnp.float32),
            jax.ShapeDtypeStruct((b, hkv, splits, r), jnp.float32),
            jax.ShapeDtypeStruct((b, hkv, splits, r), jnp.float32),
        ],
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
    )(lens, qr, kf, vf, bits)
    weight = jnp.exp(m - jnp.max(m, axis=2, keepdims=True))  # [B, Hkv, splits, R]
    num = jnp.sum(weight[..., None] * acc, axis=2)
    den = jnp.sum(weight * l, axis=2)[..., None]
    return jnp.where(den > 0, num / jnp.where(den > 0, den, 1.0), 0.0).astype(qr.dtype)


def _check_inputs(q, k, v, lens, local_mask) -> None:
    if q.ndim != 4 or k.ndim != 4:
        raise ValueError(f"q must be [B, T, H, D] and k [B, S, Hkv, D], got {q.shape} and {k.shape}")
    b, t, h, d = q.shape
    s, hkv = k.shape[1], k.shape[2]
    if v.shape != k.shape:
        raise ValueError(f"k and v must have the same shape, got {k.shape} and {v.shape}")
    if k.shape[0] != b or k.shape[3] != d:
        raise ValueError(f"k {k.shape} does not match q {q.shape} in batch or head dim")
    if h % hkv:
        raise ValueError(f"query heads {h} must be a multiple of kv heads {hkv}")
    if tuple(lens.shape) != (b,):
        raise ValueError(f"lens must have shape ({b},), got {lens.shape}")
    if tuple(local_mask.shape) != (b, t, t):
        raise ValueError(f"local_mask must have shape ({b}, {t}, {t}), got {local_mask.shape}")
    if t > s:
        raise ValueError(f"{t} new tokens do not fit a cache of {s} rows")


# The kernels' dtype contract.  K and V (the cache) must share one dtype from this table: it is the dtype of
# both matmuls' operands.  Q may have any floating dtype; it is cast to the cache dtype at the boundary (a model
# whose activations are fp32 over a bf16 cache therefore computes q.k in bf16, as the cache already is).  The
# output has q's dtype, as ``reference_tree_attention``'s.  Softmax statistics and accumulation are fp32.
KERNEL_DTYPES = {"tpu": ("float32", "bfloat16"), "gpu": ("float32", "bfloat16", "float16")}


def _kernel_dtype(q, k, v, backend: str):
    """The compute (cache) dtype for ``backend``'s kernel; raises if the inputs break the contract."""
    if k.dtype != v.dtype:
        raise ValueError(f"k and v must share one dtype (the cache dtype), got {k.dtype} and {v.dtype}")
    if jnp.dtype(k.dtype).name not in KERNEL_DTYPES[backend]:
        raise ValueError(f"the {backend} kernel takes a {' / '.join(KERNEL_DTYPES[backend])} cache, got {k.dtype}")
    if not jnp.issubdtype(q.dtype, jnp.floating):
        raise ValueError(f"q must be floating point, got {q.dtype}")
    return k.dtype


def _pick_backend(backend: str | None, interpret) -> str:
    if backend is None:
        platform = jax.default_backend()
        if platform in ("tpu", "gpu"):
            return platform
        return "tpu" if interpret else "xla"
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS} or None, got {backend!r}")
    return backend


# Default tiles per backend and head size: (max kv rows per tile, max query rows per tile).  TPU: the kv tile a
# multiple of 128 (the lane width), query tiles of up to 256 rows keep the score tile in VMEM.  GPU: smaller kv
# tiles for wider heads (shared memory holds block_kv x D of K and V per stage).  Not yet tuned on hardware
# (experiments/gpu_check.py times the GPU choices); explicit block_kv / block_q arguments override them.
BLOCK_SIZES = {
    ("tpu", 64): (512, 256),
    ("tpu", 128): (512, 256),
    ("tpu", 256): (256, 128),
    ("gpu", 64): (64, 128),
    ("gpu", 128): (64, 128),
    ("gpu", 256): (32, 64),
}


def block_sizes(backend: str, head_dim: int) -> tuple[int, int]:
    """``(block_kv, block_q)`` limits from ``BLOCK_SIZES`` for the smallest tabled head size >= ``head_dim``
    (the largest tabled one beyond)."""
    sizes = sorted(d for b, d in BLOCK_SIZES if b == backend)
    return BLOCK_SIZES[backend, next((d for d in sizes if d >= head_dim), sizes[-1])]


def _check_options(backend: str, *, window, interpret, block_kv, block_q, num_splits) -> None:
    """ValueError for a malformed keyword of ``tree_attention``."""
    if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
        raise ValueError(f"window must be a positive int or None, got {window!r}")
    if not isinstance(interpret, (bool, pltpu.InterpretParams)):
        raise ValueError(f"interpret must be a bool or pltpu.InterpretParams, got {interpret!r}")
    if backend == "gpu" and isinstance(interpret, pltpu.InterpretParams):
        raise ValueError("InterpretParams simulates a TPU; use interpret=True for the GPU kernel")
    for name, val in (("block_kv", block_kv), ("block_q", block_q), ("num_splits", num_splits)):
        if val is not None and (not isinstance(val, int) or val < 1):
            raise ValueError(f"{name} must be a positive int, got {val!r}")


def _tiles(backend: str, *, rows: int, s: int, d: int, hkv: int, block_kv: int | None, block_q: int | None):
    """``(block_kv, block_q, padded D)`` for ``rows`` grouped query rows over an ``s``-row cache: the given
    blocks or ``block_sizes``' defaults; D padded to a multiple of 128 on TPU when Hkv > 1 (lane-aligned
    per-head slices of the flattened cache), to a power of two (>= 16) on GPU."""
    max_kv, max_q = block_sizes(backend, d)
    if backend == "tpu":
        dp = d if hkv == 1 or d % 128 == 0 else _round_up(d, 128)
        return block_kv or min(max_kv, _round_up(s, 128)), block_q or min(_round_up(rows, 16), max_q), dp
    return block_kv or max_kv, block_q or min(max(16, _next_pow2(rows)), max_q), max(16, _next_pow2(d))


def tree_attention(
    q: jax.Array,  # [B, T, H, D] queries, RoPE applied
    k: jax.Array,  # [B, S, Hkv, D] key cache (new tokens written at [lens, lens + T))
    v: jax.Array,  # [B, S, Hkv, D] value cache
    lens: jax.Array,  # [B] int32 committed length before the T new tokens
    local_mask: jax.Array,  # [B, T, T] bool visibility among the new tokens
    *,
    scale: float,
    window: int | None = None,
    interpret: bool | pltpu.InterpretParams = False,
    backend: str | None = None,
    block_kv: int | None = None,
    block_q: int | None = None,
    num_splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int = 2,
    vmem_limit_bytes: int | None = None,
) -> jax.Array:  # [B, T, H, D]
    """Pallas version of ``reference_tree_attention`` (same arguments and result, fp32 accumulation).

    backend: "tpu" (Mosaic: scalar-prefetched ``lens``, sequential kv grid axis, tiles past
    ``lens + T`` skipped), "gpu" (Pallas Triton backend with split-K over the needed kv tiles), "xla"
    (``reference_tree_attention``) or None: the default platform's kernel; on CPU the TPU kernel when
    ``interpret`` is set, else the XLA reference (Pallas cannot run on CPU without interpret mode).
    interpret: True (fast HLO interpreter, either kernel) or ``pltpu.InterpretParams()`` (TPU semantics).
    block_kv: kv rows per tile (default from ``block_sizes``: 512 on TPU, 64 on GPU at D <= 128; the TPU needs
    a multiple of 128 unless it covers the whole cache, the GPU a power of two).  block_q: query rows
    (``T * H / Hkv``) per tile (default: all of them up to ``block_sizes``' limit).  num_splits, num_warps, num_stages: GPU only.
    vmem_limit_bytes: TPU only, the kernel's scoped VMEM limit (default: the compiler's, 16 MiB on v5e).
    Any T, H, Hkv, D, S work: the wrapper pads rows, D and S as the backend needs and slices the result.
    Padding D (to a multiple of 128 on TPU when Hkv > 1, to a power of two on GPU) or S (to a multiple of
    block_kv) copies the cache; production shapes (D = 128, block_kv dividing S) copy nothing.
    window: sliding-window layers, as in ``reference_tree_attention``, in both kernels (tiles no query sees
    are skipped).  Dtypes (``KERNEL_DTYPES``): k and v share the cache dtype (TPU: fp32 / bf16; GPU also
    fp16), q of any floating dtype is cast to it, the output has q's dtype; anything else raises.
    """
    _check_inputs(q, k, v, lens, local_mask)
    backend = _pick_backend(backend, interpret)
    _check_options(backend, window=window, interpret=interpret, block_kv=block_kv, block_q=block_q,
                   num_splits=num_splits)
    if backend == "xla":
        return reference_tree_attention(q, k, v, lens, local_mask, scale=scale, window=window)
    out_dtype, dtype = q.dtype, _kernel_dtype(q, k, v, backend)
    q = q.astype(dtype)

    b, t, h, d = q.shape
    s, hkv = k.shape[1], k.shape[2]
    g = h // hkv
    rows = t * g
    bits = lax.bitcast_convert_type(ancestor_bits(local_mask.astype(bool)), jnp.int32)  # [B, T, W]
    bits = jnp.repeat(bits, g, axis=1)  # [B, T*g, W]: row t*g+j belongs to query t
    qr = q.reshape(b, t, hkv, g, d).transpose(0, 2, 1, 3, 4).reshape(b, hkv, rows, d)
    block_kv, block_q, dp = _tiles(backend, rows=rows, s=s, d=d, hkv=hkv, block_kv=block_kv, block_q=block_q)
    r, sp = _round_up(rows, block_q), _round_up(s, block_kv)
    qr = jnp.pad(qr, ((0, 0), (0, 0), (0, r - rows), (0, dp - d)))
    bits = jnp.pad(bits, ((0, 0), (0, r - rows), (0, 0)))
    if (sp, dp) != (s, d):
        k = jnp.pad(k, ((0, 0), (0, sp - s), (0, 0), (0, dp - d)))
        v = jnp.pad(v, ((0, 0), (0, sp - s), (0, 0), (0, dp - d)))
    kf, vf = k.reshape(b, sp, hkv * dp), v.reshape(b, sp, hkv * dp)
    lens = jnp.asarray(lens, jnp.int32)

    if backend == "tpu":
        out = _tpu_call(qr, kf, vf, lens, bits, scale=scale, t=t, g=g, window=window, block_q=block_q,
                        block_kv=block_kv, interpret=interpret, vmem_limit_bytes=vmem_limit_bytes)
    else:
        groups = b * hkv * (r // block_q)
        splits = num_splits or max(1, min(sp // block_kv, 256 // groups))
        out = _gpu_call(qr, kf, vf, lens, bits.transpose(0, 2, 1), scale=scale, t=t, g=g, window=window,
                        block_q=block_q, block_kv=block_kv, splits=splits,
                        num_warps=num_warps or (4 if block_q <= 64 else 8), num_stages=num_stages,
                        interpret=bool(interpret))
    out = out[:, :, :rows, :d].reshape(b, hkv, t, g, d).transpose(0, 2, 1, 3, 4)
    return out.reshape(b, t, h, d).astype(out_dtype)
