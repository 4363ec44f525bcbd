"""The few-row CPU dot (``dtree_jax.cpu_dot``): the product of its pure-jnp reference on odd shapes, a row's result
independent of the other rows bit for bit, the dense weights packed where generations bake their weights in (the
tokens unchanged, the kernel in the compiled program), and XLA's dots, with one reason, wherever it cannot run."""

import collections
import ctypes
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dtree_jax import api, cpu_dot, cpu_options, loop, running
from dtree_jax.api import generate
from dtree_jax.models import decoder, domino_head, qwen3_5
from tests.test_decode import PROMPTS, models  # noqa: F401, F811  (the module's tiny target and Domino drafter)

# Every machine of our kind builds it (x86-64 with AVX-512 or AVX2 + FMA, a C++ compiler); elsewhere XLA's dots run.
needs_kernel = pytest.mark.skipif(not cpu_dot.available(), reason=f"needs the kernel: {cpu_dot.status()}")


def _weight(k, n, seed=0):
    return jnp.asarray(np.random.default_rng(seed).standard_normal((k, n), dtype=np.float32))


@needs_kernel
@pytest.mark.parametrize("k,n", [(1, 1), (7, 3), (64, 64), (96, 130), (576, 200)])
@pytest.mark.parametrize("lead", [(1,), (5,), (2, 7), (13,)])
def test_the_kernel_computes_the_references_product(k, n, lead):
    w = _weight(k, n)
    x = jnp.asarray(np.random.default_rng(1).standard_normal(lead + (k,), dtype=np.float32))
    packed = cpu_dot.pack(w)
    assert packed.shape == (k, n) and packed.panels.shape == (-(-n // 64), k, 64)
    np.testing.assert_array_equal(cpu_dot.unpack(packed), w)
    got = jax.jit(lambda x, p: x @ p)(x, packed)
    assert got.shape == lead + (n,) and got.dtype == jnp.float32
    np.testing.assert_allclose(got, cpu_dot.reference_fewrow_dot(x, packed), rtol=2e-5, atol=2e-5 * np.sqrt(k))


def _bf16_equals_fp32_panels(dot, k, n, rows):
    """``dot(x, panels)`` with a bf16 weight's own panels gives the sums of its fp32 widening's panels, bit for bit
    (half the bytes read, the same values); a weight differing in one bf16 step gives other sums (control)."""
    w16 = _weight(k, n, seed=4).astype(jnp.bfloat16)
    x = jnp.asarray(np.random.default_rng(5).standard_normal((rows, k), dtype=np.float32))
    half, full = cpu_dot.pack(w16), cpu_dot.pack(w16.astype(jnp.float32))
    assert half.panels.dtype == jnp.bfloat16 and half.panels.nbytes * 2 == full.panels.nbytes
    got = np.asarray(dot(x, half))
    np.testing.assert_array_equal(got, np.asarray(dot(x, full)))
    nudged = cpu_dot.pack(w16.at[k // 2, n // 2].set(jnp.nextafter(w16[k // 2, n // 2], jnp.bfloat16(jnp.inf))))
    assert not np.array_equal(np.asarray(dot(x, nudged)), got)


@needs_kernel
@pytest.mark.parametrize("k,n,rows", [(7, 3, 1), (96, 130, 5), (576, 200, 9), (576, 1000, 13), (1536, 64, 2)])
def test_bf16_panels_give_the_fp32_panels_sums(k, n, rows):
    _bf16_equals_fp32_panels(jax.jit(lambda x, p: x @ p), k, n, rows)


@needs_kernel
def test_a_rows_result_never_depends_on_the_other_rows():
    """Every row of a 13-row call equals, bit for bit, the same row computed alone or in any other group (in the
    kernel: 12 rows sharing a pass as groups of 6 + 6, then 1; or 5; or 6 + 3 ...); changing one row changes that
    row only (the check can fail)."""
    packed = cpu_dot.pack(_weight(576, 1000))
    x = jnp.asarray(np.random.default_rng(2).standard_normal((13, 576), dtype=np.float32))
    dot = jax.jit(lambda x: x @ packed)
    full = np.asarray(dot(x))
    for lo, hi in [(0, 1), (4, 5), (0, 5), (3, 12), (7, 13), (12, 13)]:
        np.testing.assert_array_equal(np.asarray(dot(x[lo:hi])), full[lo:hi])
    changed = np.asarray(dot(x.at[4, 0].add(1.0)))
    assert not np.array_equal(changed[4], full[4])
    np.testing.assert_array_equal(np.delete(changed, 4, axis=0), np.delete(full, 4, axis=0))


@needs_kernel
def test_the_avx2_build_computes_the_same_products(tmp_path, monkeypatch):
    """Hosts without AVX-512 build the AVX2 variant (one row: a whole panel per pass; 2-3 rows: half a panel; 4-6
    rows of fp32 panels: a quarter; 5 rows as 3 + 2, 9 as 6 + 3, 13 as 6 + 6 and 1):
    built here with ``-mno-avx512f`` (as ``DTREE_JAX_CPU_DOT=avx2`` builds it) and called through its own FFI
    name, it gives the reference's product and the same bits for a row alone or among others."""

    monkeypatch.setenv("DTREE_JAX_CACHE", str(tmp_path))
    targets = cpu_dot.register_build("_avx2_test", arch=cpu_dot.AVX2_FLAGS)
    avx2 = jax.jit(lambda x, p: cpu_dot.fewrow_dot(x, p, targets))
    packed = cpu_dot.pack(_weight(96, 130))
    x = jnp.asarray(np.random.default_rng(3).standard_normal((13, 96), dtype=np.float32))
    full = np.asarray(avx2(x, packed))
    np.testing.assert_allclose(full, cpu_dot.reference_fewrow_dot(x, packed), rtol=2e-5, atol=2e-4)
    for lo, hi in [(0, 1), (0, 2), (2, 5), (3, 8), (1, 7), (0, 9), (12, 13)]:
        np.testing.assert_array_equal(np.asarray(avx2(x[lo:hi], packed)), full[lo:hi])
    for rows in (1, 2, 3, 7, 9):
        _bf16_equals_fp32_panels(avx2, 96, 130, rows)


@needs_kernel
def test_pack_dense_packs_the_dense_weights_and_keeps_the_forward(models):
    _, target, draft = models
    packed = cpu_options.pack_dense(target.params)
    layer = packed.layers[0]
    assert all(isinstance(getattr(layer, f), cpu_dot.PackedWeight) for f in ("wq", "wk", "wv", "wo", "w_up"))
    assert isinstance(layer.attn_norm, jax.Array) and packed.embed is target.params.embed
    assert isinstance(cpu_options.pack_dense(draft.params).fc, cpu_dot.PackedWeight)
    head, unpacked = cpu_options.pack_dense(draft.params).head, draft.params.head
    assert all(isinstance(getattr(head, f), cpu_dot.PackedWeight) for f in ("w_ih", "w_hh", "w1"))
    state = jax.random.normal(jax.random.key(1), (3, 5, head.gru_dim))  # the GRU and the correction: same values
    emb = target.params.embed[jnp.asarray(PROMPTS[1][:5])]
    ph = jax.random.normal(jax.random.key(2), (3, 1, head.hidden_dim))
    for fn, args in ((domino_head.gru_step, (state, emb)), (domino_head.correction_hidden, (ph, state))):
        got, want = jax.jit(fn)(head, *args), jax.jit(fn)(unpacked, *args)
        assert got.shape == want.shape == (3, 5, want.shape[-1])
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    tokens = jnp.asarray([PROMPTS[1]], jnp.int32)
    prefill = jax.jit(lambda params: decoder.prefill(params, target.cfg, tokens,
                                                      decoder.init_cache(target.cfg, 1, 16), None, taps=(0, 1)))
    for got, want in zip(jax.tree.leaves(prefill(packed)), jax.tree.leaves(prefill(target.params))):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)  # logits, features, cache
    x = decoder.embed(target.params, tokens)
    tied = cpu_options.pack_dense(dataclasses.replace(target.params, layers=(), lm_head=None))
    assert isinstance(tied.lm_head, cpu_dot.PackedWeight) and tied.lm_head.shape == target.params.embed.T.shape
    np.testing.assert_allclose(decoder.lm_head(tied, target.cfg, x),
                               jnp.einsum("...h,vh->...v", x, target.params.embed), rtol=1e-5, atol=1e-5)
    # bf16 weights are packed too, as bf16 panels (widened to fp32 in the kernel, exact): x @ w keeps its dtype,
    # the sums are fp32's.
    bf16 = jax.tree.map(lambda a: a.astype(jnp.bfloat16), target.params)
    packed16 = cpu_options.pack_dense(bf16).layers[0].wq
    assert isinstance(packed16, cpu_dot.PackedWeight) and packed16.dtype == jnp.bfloat16
    np.testing.assert_array_equal(cpu_dot.unpack(packed16), bf16.layers[0].wq)
    x16 = x.astype(jnp.bfloat16)
    got = jax.jit(lambda a: a @ packed16)(x16)
    want = jnp.matmul(x16.astype(jnp.float32), bf16.layers[0].wq.astype(jnp.float32),
                      precision=jax.lax.Precision.HIGHEST)
    assert got.dtype == (x16 @ bf16.layers[0].wq).dtype == jnp.bfloat16
    np.testing.assert_allclose(got.astype(jnp.float32), want.astype(jnp.bfloat16).astype(jnp.float32), rtol=1e-2, atol=1e-3)
    assert (x @ packed16).dtype == jnp.float32  # an fp32 input: fp32, as x @ w


def round_compiler(target, draft, method, monkeypatch):
    """``compile(**options)``: the HLO text of ``method``'s round (budget 6, one prompt) compiled by
    ``cpu_options.compile_here`` as generations compile it (``options`` go to ``compile_baked``)."""
    knobs = dict(budget=6, node_topk=4, corr_topm=None, max_depth=None, max_new_tokens=8, prompt_bucket=16,
                 stop_ids=(), top_k=0, top_p=1.0)
    spec = api.make_spec(target, draft, method, **knobs)
    inputs = (jnp.asarray([PROMPTS[0]], jnp.int32), jnp.asarray([len(PROMPTS[0])], jnp.int32), api.request_keys(0, 1),
              jnp.float32(0))
    dp = draft.params if spec.record.drafts else None
    state = loop.prefill_on_device(spec, target.params, dp, *inputs)

    def compile(**options) -> str:
        compiled = []
        compile_baked = cpu_options.compile_baked
        monkeypatch.setattr(cpu_options, "compile_baked",
                            lambda *a, **k: compiled.append(compile_baked(*a, **k, **options)))
        cpu_options.compile_here(loop.decode_round, spec, (target.params, dp), inputs[-1], state,
                                 bake=functools.partial(loop.unshared_heads, spec))
        monkeypatch.setattr(cpu_options, "compile_baked", compile_baked)
        (program,) = compiled
        return program.as_text()

    return compile


def _assert_baked_equals_arguments(target, draft, method, monkeypatch):
    """The baked generation (the kernel's dots) gives the tokens and rounds of the argument program (XLA's)."""
    monkeypatch.setattr(running, "COMPILED", collections.OrderedDict())
    baked = generate(target, PROMPTS, method, draft, budget=6, max_new_tokens=16, stop_ids=())
    monkeypatch.setattr(cpu_options, "bakes_weights", lambda *a: False)
    monkeypatch.setattr(running, "COMPILED", collections.OrderedDict())
    plain = generate(target, PROMPTS, method, draft, budget=6, max_new_tokens=16, stop_ids=())
    assert baked.tokens == plain.tokens
    assert [s["rounds"] for s in baked.stats] == [s["rounds"] for s in plain.stats]
    monkeypatch.undo()


@needs_kernel
@pytest.mark.parametrize("method", ["ar", "dominotree"])
def test_baked_generations_run_the_kernel_with_the_same_tokens(models, method, monkeypatch):
    """A baked generation's program calls the kernel, and gives the tokens and rounds of the program that takes
    its weights as arguments (XLA's dots); without the kernel (``DTREE_JAX_CPU_DOT=0``) the baked round has no
    call to it (control)."""
    _, target, draft = models
    _assert_baked_equals_arguments(target, draft, method, monkeypatch)
    compile_round = round_compiler(target, draft, method, monkeypatch)

    def kernel_calls() -> int:
        targets = [target for target, _ in cpu_dot.FFI_TARGETS.values()]
        return sum(target in line for line in compile_round().splitlines() for target in targets)

    assert kernel_calls() > 0
    monkeypatch.setitem(cpu_dot._state, "ok", False)
    assert kernel_calls() == 0


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    """A tiny Qwen3.5 hybrid target (Gated DeltaNet and gated full-attention layers) and a Domino drafter."""
    from tests.oracles_hybrid import save_hybrid_pair

    root = tmp_path_factory.mktemp("hybrid")
    save_hybrid_pair(root)
    return api.load_model(root / "target"), api.load_model(root / "drafter")


@needs_kernel
def test_the_hybrid_targets_projections_are_packed_with_the_same_forward_and_tokens(hybrid, monkeypatch):
    target, draft = hybrid
    packed = cpu_options.pack_dense(target.params)
    kinds = {type(layer.mixer).__name__: layer.mixer for layer in packed.layers}
    assert set(kinds) == {"GDNParams", "AttnParams"}
    for mixer in kinds.values():
        for field in cpu_options.DENSE_FIELDS[type(mixer)]:
            assert isinstance(getattr(mixer, field), cpu_dot.PackedWeight), field
    assert isinstance(packed.layers[0].mlp.w_down, cpu_dot.PackedWeight)
    tokens = jnp.asarray([PROMPTS[1]], jnp.int32)
    cache = qwen3_5.init_cache(target.cfg, 1, 16)
    prefill = jax.jit(lambda params: qwen3_5.prefill(params, target.cfg, tokens, cache,
                                                      jnp.asarray([tokens.shape[1]]), taps=(0, 1)))
    for got, want in zip(jax.tree.leaves(prefill(packed)), jax.tree.leaves(prefill(target.params))):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)  # logits, features, caches and states
    _assert_baked_equals_arguments(target, draft, "dominotree", monkeypatch)


def test_where_the_kernel_cannot_build_xlas_dots_run_and_say_why(tmp_path, monkeypatch):
    monkeypatch.setenv("DTREE_JAX_CACHE", str(tmp_path))
    monkeypatch.setattr(cpu_dot, "_state", {})
    monkeypatch.setenv(cpu_dot.DISABLE_ENV, "0")
    assert not cpu_dot.available() and cpu_dot.status() == f"XLA's dots ({cpu_dot.DISABLE_ENV}=0)"
    monkeypatch.delenv(cpu_dot.DISABLE_ENV)
    monkeypatch.setattr(cpu_dot, "_state", {})
    monkeypatch.setattr(cpu_dot, "_compiler", lambda: None)
    assert not cpu_dot.available() and "no C++ compiler" in cpu_dot.status()
    monkeypatch.undo()
    monkeypatch.setenv("DTREE_JAX_CACHE", str(tmp_path))
    monkeypatch.setattr(cpu_dot, "_state", {})
    monkeypatch.setenv("CXX", "false")  # a "compiler" that fails
    monkeypatch.setattr(cpu_dot, "_compiler", lambda: __import__("shutil").which("false"))
    assert not cpu_dot.available() and "did not build here" in cpu_dot.status()
    assert not list(tmp_path.rglob("*.so"))  # nothing half-built left in the cache


@needs_kernel
def test_a_cached_library_that_does_not_load_is_rebuilt(tmp_path, monkeypatch):
    """A truncated or foreign file where the cached build should be is replaced by a fresh build, not taken as
    a reason to fall back to XLA's dots (control: the file written there really does not load); the AVX2
    variant (``DTREE_JAX_CPU_DOT=avx2``) is a build of its own."""
    monkeypatch.setenv("DTREE_JAX_CACHE", str(tmp_path))
    monkeypatch.setattr(cpu_dot, "_cpu_fingerprint", lambda: "a CPU only this test has")  # a path never loaded
    lib = cpu_dot._build(cpu_dot._compiler())
    lib.write_bytes(b"\x7fELF, but truncated")
    with pytest.raises(OSError):
        ctypes.CDLL(str(lib))
    monkeypatch.setattr(cpu_dot, "_state", {})
    monkeypatch.setattr(jax.ffi, "register_ffi_target", lambda *a, **k: None)  # the process has its kernel already
    assert cpu_dot.available(), cpu_dot.status()
    assert lib.stat().st_size > 1000 and lib.name in cpu_dot.status()
    monkeypatch.setenv(cpu_dot.DISABLE_ENV, "avx2")  # the variant for CPUs without AVX-512: its own build
    monkeypatch.setattr(cpu_dot, "_state", {})
    assert cpu_dot.available() and cpu_dot.status().endswith(", AVX2)") and lib.name not in cpu_dot.status()
