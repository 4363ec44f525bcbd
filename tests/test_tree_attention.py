"""Pallas tree attention vs the pure-jnp reference (CPU interpret modes) and CPU cross-lowering checks."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from dtree_jax.tree import ancestor_mask
from pallas_kernels.tree_attention import reference_tree_attention, tree_attention


def random_parents(rng, b, t):
    return np.stack([np.r_[-1, [rng.integers(0, i) for i in range(1, t)]] for _ in range(b)]).astype(np.int32)


def make_case(seed, b, t, h, hkv, d, s, dtype=jnp.float32, mask="tree", lens=None):
    """Random q/k/v, random lens (lens + t <= s) and a local mask: random trees, causal, full or random bits."""
    rng = np.random.default_rng(seed)
    if mask == "tree":
        local = ancestor_mask(random_parents(rng, b, t))
    elif mask == "causal":
        local = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))
    elif mask == "full":
        local = jnp.ones((b, t, t), bool)
    else:  # arbitrary bools, including rows that see no new token
        local = jnp.asarray(rng.random((b, t, t)) < 0.3)
    if lens is None:
        lens = rng.integers(0, s - t + 1, size=b)
    q, k, v = (jnp.asarray(rng.standard_normal(shape), dtype) for shape in [(b, t, h, d)] + [(b, s, hkv, d)] * 2)
    return q, k, v, jnp.asarray(lens, jnp.int32), local


def run(args, **kw):
    scale = 1.0 / np.sqrt(args[0].shape[-1])
    return jax.jit(functools.partial(tree_attention, scale=scale, **kw))(*args)


def ref(args):
    return reference_tree_attention(*args, scale=1.0 / np.sqrt(args[0].shape[-1]))


# (b, t, h, hkv, d, s, backend, blocks, mask)
FP32_CASES = [
    (2, 17, 4, 2, 32, 300, "tpu", dict(block_kv=128), "tree"),
    (2, 17, 4, 2, 32, 300, "gpu", dict(block_kv=32), "tree"),
    (3, 40, 6, 2, 64, 520, "tpu", dict(block_kv=256, block_q=32), "tree"),  # 2 mask words, 3 row tiles
    (3, 40, 6, 2, 64, 520, "gpu", dict(block_kv=64, block_q=32, num_splits=3), "tree"),
    (2, 70, 2, 1, 16, 200, "tpu", dict(block_kv=128), "random"),  # 3 words, rows seeing nothing
    (2, 70, 2, 1, 16, 200, "gpu", dict(block_kv=16, num_splits=4), "random"),
    (2, 16, 8, 8, 128, 256, "tpu", dict(block_kv=128), "causal"),  # prefill: lens = 0 below
    (2, 24, 4, 4, 48, 160, "gpu", dict(block_kv=32), "full"),  # drafter block, D padded to 64
]


@pytest.mark.parametrize("b,t,h,hkv,d,s,backend,blocks,mask", FP32_CASES)
def test_matches_reference_fp32(b, t, h, hkv, d, s, backend, blocks, mask):
    lens = [0] * b if mask == "causal" else None
    args = make_case(hash((t, s, backend)) % 1000, b, t, h, hkv, d, s, mask=mask, lens=lens)
    out = run(args, backend=backend, interpret=True, **blocks)
    assert out.shape == args[0].shape and out.dtype == jnp.float32
    np.testing.assert_allclose(out, ref(args), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("backend", ["tpu", "gpu"])
def test_matches_reference_bf16_edge_lengths(backend):
    # lens = 0 (prefix empty) and lens = s - t (cache exactly full) in one batch.
    args = make_case(7, 3, 33, 8, 2, 64, 384, dtype=jnp.bfloat16, lens=[0, 384 - 33, 200])
    out = run(args, backend=backend, interpret=True, block_kv=128 if backend == "tpu" else 64)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_allclose(out.astype(np.float32), ref(args).astype(np.float32), atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("backend", ["tpu", "gpu"])
def test_tiles_past_the_new_tokens_are_skipped(backend):
    """NaN in whole kv tiles past lens + T must not reach the output (0 * NaN would, if they were read)."""
    block_kv = 128 if backend == "tpu" else 32
    q, k, v, lens, local = make_case(3, 2, 9, 4, 2, 32, 640, lens=[10, 300])
    needed = -(-(np.asarray(lens) + 9) // block_kv) * block_kv  # first row of the first unneeded tile
    rows = np.arange(640)[None, :, None, None] >= needed[:, None, None, None]
    clean = ref((q, k, v, lens, local))
    k, v = jnp.where(rows, jnp.nan, k), jnp.where(rows, jnp.nan, v)
    out = run((q, k, v, lens, local), backend=backend, interpret=True, block_kv=block_kv)
    np.testing.assert_allclose(out, clean, atol=2e-5, rtol=2e-5)


class TestTpuInterpretParams:
    """TPU semantics (uninitialised VMEM poisoned with NaN, randomised parallel grid order): tiny sizes."""

    def teardown_method(self):
        pltpu.reset_tpu_interpret_mode_state()

    @pytest.mark.parametrize("dtype,tol", [(jnp.float32, 2e-5), (jnp.bfloat16, 3e-2)])
    def test_matches_reference(self, dtype, tol):
        args = make_case(11, 2, 12, 4, 2, 128, 256, dtype=dtype, lens=[0, 150])
        params = pltpu.InterpretParams(random_seed=3)
        out = run(args, backend="tpu", interpret=params, block_kv=128, block_q=16)
        np.testing.assert_allclose(out.astype(np.float32), ref(args).astype(np.float32), atol=tol, rtol=tol)


def test_default_backend_on_cpu():
    args = make_case(5, 1, 8, 2, 1, 16, 64)
    scale = 0.25
    np.testing.assert_array_equal(
        tree_attention(*args, scale=scale), reference_tree_attention(*args, scale=scale)
    )  # no interpret: the XLA reference
    np.testing.assert_allclose(tree_attention(*args, scale=scale, interpret=True, block_kv=64),
                               reference_tree_attention(*args, scale=scale), atol=2e-5, rtol=2e-5)


def test_bad_inputs_raise():
    q, k, v, lens, local = make_case(0, 2, 8, 4, 2, 16, 64)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        tree_attention(q[:, :, :3], k, v, lens, local, scale=1.0)
    with pytest.raises(ValueError, match="local_mask"):
        tree_attention(q, k, v, lens, local[:, :4], scale=1.0)
    with pytest.raises(ValueError, match="lens"):
        tree_attention(q, k, v, lens[:1], local, scale=1.0)
    with pytest.raises(ValueError, match="same shape"):
        tree_attention(q, k, v[:, :32], lens, local, scale=1.0)
    with pytest.raises(ValueError, match="backend"):
        tree_attention(q, k, v, lens, local, scale=1.0, backend="cuda")
    with pytest.raises(ValueError, match="InterpretParams"):
        tree_attention(q, k, v, lens, local, scale=1.0, backend="gpu", interpret=pltpu.InterpretParams())
    with pytest.raises(ValueError, match="block_kv"):
        tree_attention(q, k, v, lens, local, scale=1.0, backend="tpu", interpret=True, block_kv=0)


# --------------------------------------------------------------------------------------------------------
# Cross-lowering on CPU: the real Pallas -> Mosaic / Triton lowering, which enforces block-shape rules.
# --------------------------------------------------------------------------------------------------------


def lower(backend, dtype, b=2, t=32, h=32, hkv=8, d=128, s=4096, **blocks):
    specs = [
        jax.ShapeDtypeStruct((b, t, h, d), dtype),
        jax.ShapeDtypeStruct((b, s, hkv, d), dtype),
        jax.ShapeDtypeStruct((b, s, hkv, d), dtype),
        jax.ShapeDtypeStruct((b,), jnp.int32),
        jax.ShapeDtypeStruct((b, t, t), jnp.bool_),
    ]
    f = functools.partial(tree_attention, scale=0.088, backend=backend, **blocks)
    platform = {"tpu": "tpu", "gpu": "cuda"}[backend]
    return jax.jit(f).trace(*specs).lower(lowering_platforms=(platform,)).as_text()


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("shape", [dict(), dict(b=8, t=64, s=32768), dict(b=3, t=17, h=4, hkv=2, d=32, s=300)])
def test_tpu_kernel_lowers(dtype, shape):
    assert "tpu_custom_call" in lower("tpu", dtype, **shape)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("shape", [dict(), dict(b=8, t=64, s=32768), dict(b=3, t=17, h=4, hkv=2, d=32, s=300)])
def test_gpu_kernel_lowers(dtype, shape):
    assert "triton" in lower("gpu", dtype, **shape)


def test_cross_lowering_rejects_illegal_blocks():
    """The checks above can fail: interpret mode accepts these blocks, the backends' lowerings do not."""
    with pytest.raises(ValueError, match="divisible by 8 and 128"):
        lower("tpu", jnp.float32, block_q=4)  # a (4, 128) query block on a 128-row array
    with pytest.raises(ValueError, match="power of 2"):
        lower("gpu", jnp.float32, block_kv=48)


# --------------------------------------------------------------------------------------------------------
# Sliding window (drafter layers): query t at position lens + t sees committed row r iff lens + t - r < window.
# --------------------------------------------------------------------------------------------------------

# (b, t, h, hkv, d, s, window, mask, lens, backend, blocks)
WINDOW_CASES = [
    (2, 17, 4, 2, 32, 300, 40, "tree", [0, 283], "tpu", dict(block_kv=128)),
    (2, 17, 4, 2, 32, 300, 40, "tree", [0, 283], "gpu", dict(block_kv=32, num_splits=3)),
    (3, 9, 4, 1, 16, 400, 1, "random", [5, 391, 150], "tpu", dict(block_kv=128)),  # window 1: no prefix
    (3, 9, 4, 1, 16, 400, 1, "random", [5, 391, 150], "gpu", dict(block_kv=16)),
    (2, 40, 6, 2, 64, 520, 200, "causal", [130, 480], "tpu", dict(block_kv=128, block_q=32)),  # row tiles
    (2, 40, 6, 2, 64, 520, 200, "causal", [130, 480], "gpu", dict(block_kv=64, block_q=32, num_splits=2)),
    (2, 24, 4, 4, 48, 320, 7, "full", [3, 290], "tpu", dict(block_kv=128)),  # window < t: edge tiles only
    (2, 24, 4, 4, 48, 320, 7, "full", [3, 290], "gpu", dict(block_kv=32)),
    (1, 8, 4, 2, 32, 256, 1000, "full", [200], "gpu", dict(block_kv=64)),  # window past everything
]


@pytest.mark.parametrize("b,t,h,hkv,d,s,window,mask,lens,backend,blocks", WINDOW_CASES)
def test_window_matches_reference(b, t, h, hkv, d, s, window, mask, lens, backend, blocks):
    args = make_case(window + t, b, t, h, hkv, d, s, mask=mask, lens=lens)
    scale = 1.0 / np.sqrt(d)
    want = reference_tree_attention(*args, scale=scale, window=window)
    out = run(args, backend=backend, interpret=True, window=window, **blocks)
    np.testing.assert_allclose(out, want, atol=2e-5, rtol=2e-5)
    if window < s:  # the window changes the result, so the test above is not vacuous
        assert not np.allclose(want, ref(args), atol=1e-3)


@pytest.mark.parametrize("backend", ["tpu", "gpu"])
def test_window_skips_tiles_before_the_window(backend):
    """NaN in whole kv tiles no query's window reaches must not reach the output (nor NaN past lens + T)."""
    block_kv, window, t = (128, 100, 9) if backend == "tpu" else (32, 40, 9)
    q, k, v, lens, local = make_case(4, 2, t, 4, 2, 32, 640, lens=[300, 520])
    first = (np.asarray(lens) - window + 1) // block_kv * block_kv  # first row of the first needed tile
    needed = -(-(np.asarray(lens) + t) // block_kv) * block_kv
    rows = np.arange(640)[None, :, None, None]
    dead = (rows < first[:, None, None, None]) | (rows >= needed[:, None, None, None])
    clean = reference_tree_attention(q, k, v, lens, local, scale=0.2, window=window)
    k, v = jnp.where(dead, jnp.nan, k), jnp.where(dead, jnp.nan, v)
    out = jax.jit(functools.partial(tree_attention, scale=0.2, window=window, backend=backend, interpret=True,
                                    block_kv=block_kv))(q, k, v, lens, local)
    np.testing.assert_allclose(out, clean, atol=2e-5, rtol=2e-5)


def test_window_tpu_interpret_params():
    pltpu.reset_tpu_interpret_mode_state()
    try:
        args = make_case(12, 2, 12, 4, 2, 128, 512, lens=[0, 300])
        want = reference_tree_attention(*args, scale=1.0 / np.sqrt(128), window=150)
        out = run(args, backend="tpu", interpret=pltpu.InterpretParams(random_seed=5), block_kv=128, block_q=16,
                  window=150)
        np.testing.assert_allclose(out, want, atol=2e-5, rtol=2e-5)
    finally:
        pltpu.reset_tpu_interpret_mode_state()


@pytest.mark.parametrize("backend", ["tpu", "gpu"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_window_kernels_lower(backend, dtype):
    text = lower(backend, dtype, window=1024)
    assert ("tpu_custom_call" if backend == "tpu" else "triton") in text


def test_bad_window_raises():
    args = make_case(0, 1, 4, 2, 1, 16, 64)
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="window"):
            tree_attention(*args, scale=1.0, backend="tpu", interpret=True, window=bad)


# --------------------------------------------------------------------------------------------------------
# Dtype contract: k and v share the cache dtype, q is cast to it, the output keeps q's dtype.
# --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["tpu", "gpu"])
def test_fp32_queries_over_a_bf16_cache(backend):
    q, k, v, lens, local = make_case(8, 2, 16, 4, 2, 64, 256, lens=[0, 200])
    k, v = k.astype(jnp.bfloat16), v.astype(jnp.bfloat16)
    out = run((q, k, v, lens, local), backend=backend, interpret=True, block_kv=128 if backend == "tpu" else 64)
    assert out.dtype == jnp.float32
    want = ref((q.astype(jnp.bfloat16), k, v, lens, local)).astype(jnp.float32)  # what the kernel computes
    np.testing.assert_allclose(out, want, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("backend", ["tpu", "gpu"])
def test_mixed_dtypes_lower(backend):
    """fp32 queries over a bf16 cache (a model with fp32 weights and bf16 activations) lower for both
    platforms: before the boundary cast the Triton dot refused mixed operands ('same element type')."""
    b, t, h, hkv, d, s = 2, 16, 8, 2, 64, 512
    specs = [jax.ShapeDtypeStruct((b, t, h, d), jnp.float32)]
    specs += [jax.ShapeDtypeStruct((b, s, hkv, d), jnp.bfloat16)] * 2
    specs += [jax.ShapeDtypeStruct((b,), jnp.int32), jax.ShapeDtypeStruct((b, t, t), jnp.bool_)]
    f = functools.partial(tree_attention, scale=0.125, backend=backend)
    platform = {"tpu": "tpu", "gpu": "cuda"}[backend]
    lowered = jax.jit(f).trace(*specs).lower(lowering_platforms=(platform,))
    assert ("tpu_custom_call" if backend == "tpu" else "triton") in lowered.as_text()
    assert lowered.out_info.dtype == jnp.float32


def test_dtype_contract_refusals():
    q, k, v, lens, local = make_case(1, 1, 4, 2, 1, 16, 64)
    with pytest.raises(ValueError, match="share one dtype"):
        tree_attention(q, k, v.astype(jnp.bfloat16), lens, local, scale=1.0, backend="gpu", interpret=True)
    with pytest.raises(ValueError, match="tpu kernel takes"):
        tree_attention(q, k.astype(jnp.float16), v.astype(jnp.float16), lens, local, scale=1.0, backend="tpu",
                       interpret=True)
    with pytest.raises(ValueError, match="floating"):
        tree_attention(q.astype(jnp.int32), k, v, lens, local, scale=1.0, backend="gpu", interpret=True)


def test_block_size_table_obeys_each_backends_tiling_rules():
    from pallas_kernels.tree_attention import BLOCK_SIZES, block_sizes

    for (backend, d), (kv, q) in BLOCK_SIZES.items():
        assert kv & (kv - 1) == 0 and q & (q - 1) == 0  # powers of two
        assert backend != "tpu" or kv % 128 == 0  # lane-aligned kv tiles
        assert block_sizes(backend, d) == (kv, q)
    assert block_sizes("gpu", 96) == BLOCK_SIZES["gpu", 128] and block_sizes("tpu", 512) == BLOCK_SIZES["tpu", 256]
