"""cpu_dot's small ops (``cpu_ops.cc``): ``first_argmax`` against ``jnp.argmax`` (ties, NaNs, infinities, widths
that are no multiple of the vector), ``fusion_barrier`` as the identity, and where programs run them: RoPE's tables
computed once and greedy acceptance's argmax in the programs whose dense dots run the few-row kernel, nowhere else."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dtree_jax import cpu_dot, verify
from dtree_jax.models import kernels, layers
from tests.test_cpu_dot import needs_kernel, round_compiler
from tests.test_decode import models  # noqa: F401, F811  (the module's tiny target and Domino drafter)


def _rows(shape, seed=0) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    return np.round(x, 1)  # one decimal: many ties within a row


@needs_kernel
@pytest.mark.parametrize("shape", [(9, 49152), (1, 49152), (3, 37), (2, 5, 16), (4, 1), (7,), (2, 3, 17)])
def test_first_argmax_is_jnp_argmax(shape):
    x = _rows(shape)
    got = jax.jit(cpu_dot.first_argmax)(x)
    want = jnp.argmax(x, axis=-1)
    assert got.shape == want.shape and got.dtype == jnp.int32
    np.testing.assert_array_equal(got, want)


@needs_kernel
def test_first_argmax_takes_the_first_of_ties_and_of_nans():
    """Ties anywhere (inside the vector width and in the tail), NaNs (the first wins, wherever the maximum is),
    rows of -inf, +inf; a last-index argmax (control) gives other answers on these rows."""
    v = 53
    x = np.zeros((8, v), np.float32)
    x[0, [3, 40]] = 5.0                       # tie in the vectorised part and the tail: 3
    x[1, [50, 52]] = 5.0                      # tie in the tail: 50
    x[2, [20, 31]] = np.nan                   # two NaNs: 20
    x[3, 45] = np.nan                         # NaN in the tail beyond a larger value
    x[3, 2] = 1e30
    x[4, :] = -np.inf                         # all -inf: 0
    x[5, [7, 9]] = np.inf                     # +inf tie: 7
    x[6, :] = 1.0                             # all equal: 0
    x[7, 16] = np.float32(np.finfo(np.float32).max)
    got = np.asarray(jax.jit(cpu_dot.first_argmax)(x))
    np.testing.assert_array_equal(got, np.asarray(jnp.argmax(x, axis=-1)))
    np.testing.assert_array_equal(got, [3, 50, 20, 45, 0, 7, 0, 16])
    last = v - 1 - np.argmax(x[:, ::-1], axis=-1)
    assert (last != got).sum() >= 4  # the rows can tell the first index from the last


@needs_kernel
def test_first_argmax_refuses_what_it_cannot_take():
    with pytest.raises(ValueError, match="fp32"):
        cpu_dot.first_argmax(jnp.zeros((2, 8), jnp.bfloat16))
    with pytest.raises(ValueError, match="V > 0"):
        cpu_dot.first_argmax(jnp.zeros((2, 0), jnp.float32))


@needs_kernel
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.int32])
def test_fusion_barrier_is_the_identity(dtype):
    x = jnp.asarray(_rows((3, 9, 64)) * 10, dtype)
    np.testing.assert_array_equal(jax.jit(cpu_dot.fusion_barrier)(x), x)
    batched = jax.jit(jax.vmap(cpu_dot.fusion_barrier))(x)
    np.testing.assert_array_equal(batched, x)


@needs_kernel
def test_rope_tables_behind_the_barrier_are_the_same_tables():
    """Inside ``kernels.cpu_ops()`` the tables pass the barrier (a custom call in the program) and RoPE gives the
    same values bit for bit; outside, no custom call (control)."""
    positions = jnp.arange(0, 900, 7, dtype=jnp.int32)[None]
    x = jnp.asarray(_rows((1, positions.shape[1], 9, 64)))

    def rope(x, positions):
        return layers.apply_rope(x, *layers.rope_tables(positions, 64, 1e5))

    with kernels.cpu_ops():  # a new function each time: jit's trace cache does not see the context
        lowered = jax.jit(lambda *a: rope(*a)).lower(x, positions)
        inside = lowered.compile()(x, positions)
    plain = jax.jit(lambda *a: rope(*a)).lower(x, positions)
    assert lowered.as_text().count(cpu_dot.OPS_TARGETS["copy"][0]) == 2
    assert cpu_dot.OPS_TARGETS["copy"][0] not in plain.as_text()
    np.testing.assert_array_equal(inside, plain.compile()(x, positions))
    assert not kernels._CPU_OPS.get()


@needs_kernel
@pytest.mark.parametrize("method", ["ar", "dominotree"])
def test_programs_on_the_kernels_dots_run_the_small_ops(models, method, monkeypatch):
    """A round compiled as generations compile it calls the copy for each model's RoPE tables and the argmax for
    greedy acceptance; with ``ops=False`` or the kernel's dots off, neither (controls).  Equal tokens: ``test_cpu_dot``'s
    baked-against-arguments generations run them."""
    _, target, draft = models
    compile_round = round_compiler(target, draft, method, monkeypatch)

    def calls(op: str, **options) -> int:
        name = f'"{cpu_dot.OPS_TARGETS[op][0]}"'
        return sum(name in line for line in compile_round(**options).splitlines() if "custom_call_target" in line)

    assert calls("first_argmax") >= 1
    assert calls("copy") >= 2 * (2 if method == "dominotree" else 1)  # cos and sin: the target's, the drafter's
    assert calls("first_argmax", ops=False) == calls("copy", ops=False) == 0
    monkeypatch.setitem(cpu_dot._state, "ok", False)
    assert calls("first_argmax") == calls("copy") == 0


def test_first_argmax_outside_those_programs_is_still_jnp_argmax():
    x = _rows((4, 300), seed=3)
    x[1, 17] = np.nan
    np.testing.assert_array_equal(jax.jit(verify.first_argmax)(x), jnp.argmax(x, axis=-1))


def test_every_source_of_the_library_ships_with_the_package():
    """An installed package builds the library from its own files: each source and the header is package data."""
    import pathlib
    import tomllib

    config = tomllib.loads((pathlib.Path(__file__).parents[1] / "pyproject.toml").read_text())
    shipped = set(config["tool"]["setuptools"]["package-data"]["dtree_jax"])
    assert {p.name for p in (*cpu_dot.SOURCES, cpu_dot.HEADER)} <= shipped
