"""cpu_dot.tree_attention: XLA:CPU tree attention as one FFI call a layer (``cpu_attention.cc``), against the
pure-jnp reference, row by row, and in the programs whose dense dots run the few-row kernel."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dtree_jax import cpu_dot, cpu_options
from dtree_jax.models import kernels
from pallas_kernels.tree_attention import reference_tree_attention
from tests.test_cpu_dot import needs_kernel, round_compiler
from tests.test_decode import models  # noqa: F401, F811  (the module's tiny target and Domino drafter)


def _inputs(b, t, h, hkv, d, s, lens, seed=0, density=0.5, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    q, k, v = (jnp.asarray(rng.standard_normal(shape, dtype=np.float32), dtype) for shape in
               ((b, t, h, d), (b, s, hkv, d), (b, s, hkv, d)))
    mask = np.tril(rng.random((b, t, t)) < density) | np.eye(t, dtype=bool)
    return q, k, v, jnp.asarray(lens, jnp.int32), jnp.asarray(mask)


@needs_kernel
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("b,t,h,hkv,d,s,lens", [
    (1, 9, 9, 3, 64, 256, [100]),  # SmolLM2's verify of 9 nodes
    (1, 1, 9, 3, 64, 256, [200]),  # its ar step
    (2, 5, 8, 2, 128, 64, [0, 30]),  # Qwen3's head size, a request with nothing committed
    (2, 6, 4, 4, 8, 16, [13, 40]),  # g = 1; new rows past the cache's end; lens past it
    (1, 12, 16, 1, 16, 32, [5]),  # 16 query heads on one kv head
])
def test_the_kernel_computes_the_reference_attention(b, t, h, hkv, d, s, lens, dtype):
    """fp32 to 2e-5; a bf16 cache (and queries) read as bf16, its probabilities rounded to bf16 as the reference's
    bf16 matmul takes them: the bf16 result at most one bf16 step from the reference's, nearly all equal."""
    q, k, v, lens, mask = _inputs(b, t, h, hkv, d, s, lens, dtype=dtype)
    scale = d ** -0.5
    got = jax.jit(cpu_dot.tree_attention, static_argnums=5)(q, k, v, lens, mask, scale)
    want = reference_tree_attention(q, k, v, lens, mask, scale=scale)
    assert got.shape == q.shape and got.dtype == jnp.float32 and want.dtype == dtype
    tol = dict(rtol=2e-5, atol=2e-6) if dtype == jnp.float32 else dict(rtol=2 ** -7, atol=2 ** -9)
    if dtype == jnp.bfloat16:
        got = got.astype(dtype).astype(jnp.float32)
        assert np.mean(np.asarray(got) == np.asarray(want.astype(jnp.float32))) > 0.95
    np.testing.assert_allclose(got, want.astype(jnp.float32), **tol)
    # control: the comparison sees a query shown other rows (one fewer committed row)
    other = reference_tree_attention(q, k, v, lens - 1, mask, scale=scale).astype(jnp.float32)
    assert not np.allclose(other, got, **tol)


@needs_kernel
def test_a_query_that_sees_nothing_gets_zeros_and_refused_shapes_say_so():
    q, k, v, lens, mask = _inputs(1, 3, 4, 2, 8, 8, [0])
    mask = mask.at[0, 1].set(False)  # query 1 sees no row at all
    got = cpu_dot.tree_attention(q, k, v, lens, mask, 0.5)
    np.testing.assert_array_equal(got[0, 1], 0.0)
    np.testing.assert_allclose(got, reference_tree_attention(q, k, v, lens, mask, scale=0.5), rtol=2e-5, atol=2e-6)
    k16 = k.astype(jnp.bfloat16)
    assert cpu_dot.attends(q.astype(jnp.bfloat16), k16) and cpu_dot.attends(q, k16)
    assert not cpu_dot.attends(q, k.astype(jnp.float16)) and not cpu_dot.attends(q[..., :6], k[..., :6])
    assert not cpu_dot.attends(jnp.zeros((1, 3, 3, 8)), k)  # 3 query heads on 2 kv heads
    for args in ((q[..., :6], k[..., :6], v[..., :6]), (q, k, v.astype(jnp.bfloat16))):
        with pytest.raises(ValueError, match="cannot take"):
            cpu_dot.tree_attention(*args, lens, mask, 0.5)


@needs_kernel
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_a_tree_nodes_output_is_what_one_token_steps_along_its_path_get(dtype):
    """Bit for bit: node i of a tree (its ancestors in cache order) against one query at the end of a cache
    holding the committed rows and then its path, as one-token ar steps would see them; control: the path's rows
    in another order change the bits."""
    parents = [-1, 0, 0, 1, 1, 2, 3, 6, 5]
    t, h, hkv, d, s, committed = len(parents), 9, 3, 64, 64, 37
    q, k, v, lens, _ = _inputs(1, t, h, hkv, d, s, [committed], seed=4, dtype=dtype)
    paths = []
    for i in range(t):
        path, j = [], i
        while j >= 0:
            path.insert(0, j)
            j = parents[j]
        paths.append(path)
    mask = np.zeros((1, t, t), bool)
    for i, path in enumerate(paths):
        mask[0, i, path] = True
    tree = cpu_dot.tree_attention(q, k, v, lens, jnp.asarray(mask), d ** -0.5)
    one_row = jax.jit(cpu_dot.tree_attention, static_argnums=5)
    for i, path in enumerate(paths):
        rows = list(range(committed)) + [committed + j for j in path]
        order = [rows, rows[:committed] + rows[committed:][::-1]]
        outs = []
        for kept in order:
            kc, vc = (jnp.zeros_like(x).at[:, : len(kept)].set(x[:, jnp.asarray(kept)]) for x in (k, v))
            outs.append(one_row(q[:, i: i + 1], kc, vc, jnp.asarray([len(kept) - 1], jnp.int32),
                                jnp.ones((1, 1, 1), bool), d ** -0.5))
        np.testing.assert_array_equal(outs[0][0, 0], tree[0, i])
        if len(path) > 2:
            assert not np.array_equal(outs[1][0, 0], tree[0, i])


@needs_kernel
@pytest.mark.parametrize("method", ["ar", "dominotree"])
def test_programs_on_the_kernels_dots_run_it_once_a_layer(models, method, monkeypatch):
    """A round compiled as generations compile calls it once a target layer (and in the drafter's attention);
    with the kernel's dots off, ``attention=False`` or ``DTREE_JAX_CPU_ATTENTION=0``, not at all (controls).
    Equal tokens: ``test_cpu_dot``'s baked-against-arguments generations run it."""
    _, target, draft = models
    compile_round = round_compiler(target, draft, method, monkeypatch)

    def attention_calls(**options) -> int:
        targets = [target for target, _ in cpu_dot.ATTENTION_TARGETS.values()]
        return sum(any(f'"{target}"' in line for target in targets) for line in compile_round(**options).splitlines()
                   if "custom_call_target" in line)

    assert attention_calls() >= target.cfg.num_layers
    assert attention_calls(attention=False) == 0
    monkeypatch.setenv(cpu_options.ATTENTION_ENV, "0")
    assert attention_calls() == 0
    monkeypatch.delenv(cpu_options.ATTENTION_ENV)
    monkeypatch.setitem(cpu_dot._state, "ok", False)
    assert attention_calls() == 0
    assert not kernels._CPU_ATTENTION.get()  # nothing left set after tracing
