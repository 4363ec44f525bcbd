"""GDN core vs transformers' torch references; tree-aware verify vs per-path chain recomputation."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from jax.experimental.pallas import tpu as pltpu
from transformers.models.qwen3_next.modeling_qwen3_next import (
    Qwen3NextRMSNormGated,
    causal_conv1d_fn,
    causal_conv1d_update,
    torch_chunk_gated_delta_rule,
    torch_recurrent_gated_delta_rule,
)

from dtree_jax.models import gdn
from dtree_jax.models import tree_gdn as mtg
from pallas_kernels import tree_gdn as tg

B, HK, HV, DK, DV, KC = 2, 2, 4, 16, 8, 4  # Hk != Hv and dk != dv so orientation bugs show
C = 2 * HK * DK + HV * DV
TOL = dict(rtol=2e-5, atol=2e-5)
_recurrent = jax.jit(gdn.recurrent_gated_delta_rule)
_chunk = jax.jit(gdn.chunk_gated_delta_rule, static_argnames="chunk_size")


def _t(x):
    return torch.from_numpy(np.asarray(x))


def _delta_inputs(rng, t, dtype=np.float32):
    q = rng.normal(size=(B, t, HK, DK)).astype(dtype)
    k = rng.normal(size=(B, t, HK, DK)).astype(dtype)
    v = rng.normal(size=(B, t, HV, DV)).astype(dtype)
    g = -rng.uniform(0.0, 1.5, (B, t, HV)).astype(np.float32)
    beta = rng.uniform(0.0, 1.0, (B, t, HV)).astype(np.float32)
    h0 = rng.normal(size=(B, HV, DK, DV)).astype(np.float32)
    return q, k, v, g, beta, h0


# ----------------------------------------------------------------------------------------------------------
# Chain GDN core vs torch
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("t", [1, 63, 64, 65, 130])
def test_delta_rule_matches_torch(t):
    q, k, v, g, beta, h0 = _delta_inputs(np.random.default_rng(t), t)
    args = [_t(x) for x in (q, k, v, g, beta)]
    kw = dict(initial_state=_t(h0), output_final_state=True, use_qk_l2norm_in_kernel=True)
    ref_o, ref_s = torch_recurrent_gated_delta_rule(*args, **kw)
    ref_co, ref_cs = torch_chunk_gated_delta_rule(*args, **kw)
    np.testing.assert_allclose(ref_co.numpy(), ref_o.numpy(), **TOL)  # the two torch forms agree

    o, s = _recurrent(q, k, v, g, beta, h0)
    co, cs = _chunk(q, k, v, g, beta, h0)
    assert o.shape == (B, t, HV, DV) and s.shape == (B, HV, DK, DV) and s.dtype == jnp.float32
    np.testing.assert_allclose(o, ref_o.numpy(), **TOL)
    np.testing.assert_allclose(s, ref_s.numpy(), **TOL)
    np.testing.assert_allclose(co, ref_co.numpy(), **TOL)
    np.testing.assert_allclose(cs, ref_cs.numpy(), **TOL)
    np.testing.assert_allclose(co, o, **TOL)
    np.testing.assert_allclose(cs, s, **TOL)


def test_chunk_crosses_many_chunk_boundaries():
    q, k, v, g, beta, h0 = _delta_inputs(np.random.default_rng(7), 23)
    for state in (h0, None):
        o, s = _recurrent(q, k, v, g, beta, state)
        co, cs = _chunk(q, k, v, g, beta, state, chunk_size=4)
        np.testing.assert_allclose(co, o, **TOL)
        np.testing.assert_allclose(cs, s, **TOL)
    # prefill in two calls (state carried) equals one call
    o1, s1 = _chunk(*(x[:, :9] for x in (q, k, v, g, beta)), h0, chunk_size=4)
    o2, s2 = _chunk(*(x[:, 9:] for x in (q, k, v, g, beta)), s1, chunk_size=4)
    o, s = _chunk(q, k, v, g, beta, h0, chunk_size=4)
    np.testing.assert_allclose(jnp.concatenate([o1, o2], axis=1), o, **TOL)
    np.testing.assert_allclose(s2, s, **TOL)


def test_delta_rule_bf16_activations():
    q, k, v, g, beta, h0 = _delta_inputs(np.random.default_rng(3), 5)
    qb, kb, vb = (jnp.asarray(x, jnp.bfloat16) for x in (q, k, v))
    args = [torch.tensor(np.asarray(x, np.float32)).to(torch.bfloat16) for x in (qb, kb, vb)]
    args += [_t(g), _t(beta)]
    ref_o, ref_s = torch_recurrent_gated_delta_rule(
        *args, initial_state=_t(h0), output_final_state=True, use_qk_l2norm_in_kernel=True)
    for fn in (gdn.recurrent_gated_delta_rule, gdn.chunk_gated_delta_rule):
        o, s = fn(qb, kb, vb, g, beta, h0)
        assert o.dtype == jnp.bfloat16 and s.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(o, np.float32), ref_o.float().numpy(), rtol=2e-2, atol=2e-2)
        np.testing.assert_allclose(s, ref_s.numpy(), **TOL)


def test_gates_match_torch_formula():
    rng = np.random.default_rng(0)
    a = (rng.normal(size=(3, 5, HV)) * 15).astype(np.float32)  # crosses the softplus threshold (20) both ways
    b = rng.normal(size=(3, 5, HV)).astype(np.float32)
    a_log = rng.normal(size=HV).astype(np.float32)
    dt_bias = (rng.normal(size=HV) * 5).astype(np.float32)
    g, beta = gdn.gdn_gates(a, b, a_log, dt_bias)
    ref_g = -_t(a_log).exp() * torch.nn.functional.softplus(_t(a) + _t(dt_bias))
    np.testing.assert_allclose(g, ref_g.numpy(), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(beta, torch.sigmoid(_t(b)).numpy(), rtol=1e-6, atol=1e-6)
    assert np.all(np.asarray(g) <= 0)


@pytest.mark.parametrize("t", [1, 2, 7])
def test_causal_conv_prefill_matches_torch(t):
    rng = np.random.default_rng(t)
    x = rng.normal(size=(B, t, C)).astype(np.float32)
    w = rng.normal(size=(C, KC)).astype(np.float32)
    state = rng.normal(size=(B, KC - 1, C)).astype(np.float32)
    y, new_state = gdn.causal_conv(x, w)  # zero state: plain prefill
    ref = causal_conv1d_fn(_t(x).transpose(1, 2), _t(w), None, activation="silu").transpose(1, 2)
    np.testing.assert_allclose(y, ref.numpy(), **TOL)
    full = np.concatenate([np.zeros((B, KC - 1, C), np.float32), x], axis=1)
    np.testing.assert_array_equal(new_state, full[:, -(KC - 1):])
    y, new_state = gdn.causal_conv(x, w, state)  # continuing from a cached state (HF multi-token path)
    full = np.concatenate([state, x], axis=1)
    ref = causal_conv1d_fn(_t(full).transpose(1, 2), _t(w), None, activation="silu").transpose(1, 2)[:, -t:]
    np.testing.assert_allclose(y, ref.numpy(), **TOL)
    np.testing.assert_array_equal(new_state, full[:, -(KC - 1):])


@pytest.mark.parametrize("t", [1, 2])
def test_causal_conv_update_matches_torch(t):
    rng = np.random.default_rng(10 + t)
    x = rng.normal(size=(B, t, C)).astype(np.float32)
    w = rng.normal(size=(C, KC)).astype(np.float32)
    state = rng.normal(size=(B, KC - 1, C)).astype(np.float32)
    ref_state = _t(state).transpose(1, 2).contiguous()  # [B, C, Kc-1], updated in place
    ref = causal_conv1d_update(_t(x).transpose(1, 2), ref_state, _t(w), None, "silu").transpose(1, 2)
    y, new_state = gdn.causal_conv(x, w, state)
    np.testing.assert_allclose(y, ref.numpy(), **TOL)
    np.testing.assert_array_equal(new_state, ref_state.transpose(1, 2).numpy())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_rms_norm_matches_torch(dtype):
    rng = np.random.default_rng(1)
    x = torch.tensor(rng.normal(size=(B, 3, HV, DV)), dtype=dtype)
    z = torch.tensor(rng.normal(size=(B, 3, HV, DV)), dtype=dtype)
    norm = Qwen3NextRMSNormGated(DV, eps=1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.tensor(rng.normal(size=DV)))  # random, so w vs 1 + w mistakes show
        ref = norm(x, z).float().numpy()
    jdt = jnp.bfloat16 if dtype == torch.bfloat16 else jnp.float32
    as_j = lambda tt: jnp.asarray(tt.float().numpy(), jdt)
    y = gdn.gated_rms_norm(as_j(x), as_j(z), as_j(norm.weight.detach()))
    assert y.dtype == jdt
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    np.testing.assert_allclose(np.asarray(y, np.float32), ref, rtol=tol, atol=tol)


def test_chain_input_validation():
    q, k, v, g, beta, h0 = _delta_inputs(np.random.default_rng(0), 4)
    with pytest.raises(ValueError, match="state"):
        gdn.recurrent_gated_delta_rule(q, k, v, g, beta, h0[:, :2])
    with pytest.raises(ValueError, match="g and beta"):
        gdn.chunk_gated_delta_rule(q, k, v, g[:, :3], beta, h0)
    with pytest.raises(ValueError, match="multiple"):
        gdn.recurrent_gated_delta_rule(q, k, v[:, :, :3], g[..., :3], beta[..., :3], None)
    with pytest.raises(ValueError, match="conv_state"):
        gdn.causal_conv(np.zeros((B, 3, C), np.float32), np.zeros((C, KC), np.float32), np.zeros((B, KC, C)))
    with pytest.raises(ValueError, match="channels"):
        gdn.split_qkv(np.zeros((B, 3, C + 1)), HK, DK, HV, DV)


# ----------------------------------------------------------------------------------------------------------
# Tree verify: one GDN layer's token mixer on a batch of trees
# ----------------------------------------------------------------------------------------------------------


def _random_parents(rng, n):
    return np.array([-1] + [int(rng.integers(0, i)) for i in range(1, n)], np.int32)


def _path(parents, i):
    path = [i]
    while path[-1] > 0:
        path.append(int(parents[path[-1]]))
    return path[::-1]


def _layer(seed, n, parents=None):
    """Raw inputs of one GDN layer for B trees of n nodes (random trees unless ``parents`` is given)."""
    rng = np.random.default_rng(seed)
    f = lambda *s: rng.normal(size=s).astype(np.float32)
    if parents is None:
        parents = np.stack([_random_parents(rng, n) for _ in range(B)])
    return dict(
        parents=np.asarray(parents, np.int32), x=f(B, n, C), a=f(B, n, HV), b=f(B, n, HV), w=f(C, KC) * 0.5,
        a_log=f(HV) * 0.5, dt_bias=f(HV), conv_state=f(B, KC - 1, C), state0=f(B, HV, DK, DV),
    )


def _tree_mixer(p, fn=tg.reference_tree_gdn, parents=None, jit=True):
    """tree_conv -> split -> gates -> tree GDN; returns (y, windows, o, second output of fn)."""
    parents = p["parents"] if parents is None else parents
    if jit:
        return _tree_mixer_jit(p, fn, parents)
    y, windows = mtg.tree_conv(p["x"], p["w"], p["conv_state"], parents)
    q, k, v = gdn.split_qkv(y, HK, DK, HV, DV)
    g, beta = gdn.gdn_gates(p["a"], p["b"], p["a_log"], p["dt_bias"])
    o, extra = fn(q, k, v, g, beta, p["state0"], parents)
    return y, windows, o, extra


_tree_mixer_jit = jax.jit(functools.partial(_tree_mixer, jit=False), static_argnums=1)


@jax.jit
def _chain_mixer(x, a, b, w, a_log, dt_bias, conv_state, state0):
    """The chain path (causal_conv + recurrent form) over x [1, L, C] from the committed state."""
    y, conv_state = gdn.causal_conv(x, w, conv_state)
    q, k, v = gdn.split_qkv(y, HK, DK, HV, DV)
    g, beta = gdn.gdn_gates(a, b, a_log, dt_bias)
    o, state = gdn.recurrent_gated_delta_rule(q, k, v, g, beta, state0)
    return y, conv_state, o, state


def _chain_along(p, r, path):
    idx = np.asarray(path)
    y, cs, o, s = _chain_mixer(p["x"][r : r + 1, idx], p["a"][r : r + 1, idx], p["b"][r : r + 1, idx], p["w"],
                               p["a_log"], p["dt_bias"], p["conv_state"][r : r + 1], p["state0"][r : r + 1])
    return y[0, -1], cs[0], o[0, -1], s[0]


@functools.lru_cache(maxsize=None)
def _verified(seed, n):
    p = _layer(seed, n)
    return p, _tree_mixer(p), _tree_mixer(p, mtg.tree_gdn_wy)


@pytest.mark.parametrize("seed", [0, 1])
def test_every_node_equals_its_path_chain(seed):
    p, (y, windows, o, states), (_, _, o_wy, stash) = _verified(seed, 10)
    for r in range(B):
        for i in range(p["parents"].shape[1]):
            cy, cwin, co, cs = _chain_along(p, r, _path(p["parents"][r], i))
            np.testing.assert_allclose(y[r, i], cy, **TOL)
            np.testing.assert_array_equal(windows[r, i], cwin)
            np.testing.assert_allclose(o[r, i], co, **TOL)
            np.testing.assert_allclose(o_wy[r, i], co, **TOL)
            np.testing.assert_allclose(states[r, i], cs, **TOL)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_tree_wy_equals_sequential_reference(seed):
    p, (_, _, o, states), (_, _, o_wy, stash) = _verified(seed, 10)
    np.testing.assert_allclose(o_wy, o, **TOL)
    for i in range(p["parents"].shape[1]):  # the fold rebuilds every node's state from the stash
        last = np.full(B, i, np.int32)
        folded = mtg.tree_gdn_commit(stash, p["state0"], last)
        np.testing.assert_allclose(folded, mtg.take_node(states, last), **TOL)


def test_commit_equals_accepted_path_recompute():
    p, (_, windows, _, states), (_, _, _, stash) = _verified(1, 10)
    rng = np.random.default_rng(5)
    for _ in range(3):
        last = rng.integers(0, p["parents"].shape[1], B).astype(np.int32)
        state = mtg.tree_gdn_commit(stash, p["state0"], last)
        conv = mtg.commit_conv(windows, last)
        assert state.shape == (B, HV, DK, DV) and conv.shape == (B, KC - 1, C)
        for r in range(B):
            _, cwin, _, cs = _chain_along(p, r, _path(p["parents"][r], int(last[r])))
            np.testing.assert_allclose(state[r], cs, **TOL)
            np.testing.assert_allclose(mtg.take_node(states, last)[r], cs, **TOL)
            np.testing.assert_array_equal(conv[r], cwin)


def test_chain_tree_reproduces_chain_kernels():
    n = 12
    p = _layer(4, n, parents=np.broadcast_to(np.arange(n, dtype=np.int32) - 1, (B, n)))
    y, windows, o, stash = _tree_mixer(p, mtg.tree_gdn_wy)
    cy, cconv = jax.jit(gdn.causal_conv)(p["x"], p["w"], p["conv_state"])
    np.testing.assert_allclose(y, cy, **TOL)
    np.testing.assert_array_equal(windows[:, -1], cconv)
    q, k, v = gdn.split_qkv(cy, HK, DK, HV, DV)
    g, beta = gdn.gdn_gates(p["a"], p["b"], p["a_log"], p["dt_bias"])
    co, cs = _chunk(q, k, v, g, beta, p["state0"], chunk_size=8)
    np.testing.assert_allclose(o, co, **TOL)
    np.testing.assert_allclose(mtg.tree_gdn_commit(stash, p["state0"], np.full(B, n - 1)), cs, **TOL)
    _, cs5 = _chunk(*(x[:, :6] for x in (q, k, v, g, beta)), p["state0"])
    np.testing.assert_allclose(mtg.tree_gdn_commit(stash, p["state0"], np.full(B, 5)), cs5, **TOL)


def test_tree_unaware_verify_differs_on_branching_tree():
    """Negative control: verifying the tree as a chain in index order must fail the path check."""
    parents = np.array([[-1, 0, 0, 1, 2, 2], [-1, 0, 1, 1, 0, 4]], np.int32)
    p = _layer(6, 6, parents=parents)
    flat = np.broadcast_to(np.arange(6, dtype=np.int32) - 1, (B, 6))
    _, flat_windows, flat_o, flat_states = _tree_mixer(p, parents=flat)
    _, windows, o, states = _tree_mixer(p)
    worst = 0.0
    for r in range(B):
        for i in range(6):
            _, cwin, co, cs = _chain_along(p, r, _path(parents[r], i))
            np.testing.assert_allclose(o[r, i], co, **TOL)  # the tree-aware verify passes ...
            worst = max(worst, float(np.abs(flat_o[r, i] - co).max()))
            worst = max(worst, float(np.abs(flat_states[r, i] - cs).max()))
    assert worst > 1e-2  # ... and the tree-unaware one is caught


def test_off_path_nodes_are_harmless():
    p, (y, windows, o, states), (_, _, o_wy, stash) = _verified(2, 10)
    last = np.array([7, 9], np.int32)
    on = np.stack([np.isin(np.arange(10), _path(p["parents"][r], int(last[r]))) for r in range(B)])  # [B, N]
    q = dict(p)
    rng = np.random.default_rng(0)
    for key in ("x", "a", "b"):  # garbage (finite, large) in every node off the accepted path
        noise = rng.normal(size=p[key].shape).astype(np.float32) * 50
        q[key] = np.where(on.reshape(on.shape + (1,) * (p[key].ndim - 2)), p[key], noise)
    y2, windows2, o2, states2 = _tree_mixer(q)
    _, _, o_wy2, stash2 = _tree_mixer(q, mtg.tree_gdn_wy)
    np.testing.assert_allclose(np.asarray(o2)[on], np.asarray(o)[on], **TOL)
    np.testing.assert_allclose(np.asarray(o_wy2)[on], np.asarray(o_wy)[on], **TOL)
    np.testing.assert_allclose(mtg.tree_gdn_commit(stash2, p["state0"], last),
                               mtg.tree_gdn_commit(stash, p["state0"], last), **TOL)
    np.testing.assert_array_equal(mtg.commit_conv(windows2, last), mtg.commit_conv(windows, last))
    assert not np.allclose(np.asarray(o2)[~on], np.asarray(o)[~on])  # the garbage did reach the dead nodes


def test_tree_input_validation():
    p = _layer(0, 5)
    bad = p["parents"].copy()
    bad[0, 3] = 4  # child before parent
    with pytest.raises(ValueError, match="precede"):
        _tree_mixer(p, parents=bad, jit=False)
    y, windows = mtg.tree_conv(p["x"], p["w"], p["conv_state"], p["parents"])
    q, k, v = gdn.split_qkv(y, HK, DK, HV, DV)
    g, beta = gdn.gdn_gates(p["a"], p["b"], p["a_log"], p["dt_bias"])
    with pytest.raises(ValueError, match="parents"):
        mtg.tree_gdn_wy(q, k, v, g, beta, p["state0"], p["parents"][:, :4])
    with pytest.raises(ValueError, match="state0"):
        mtg.tree_gdn_pallas(q, k, v, g, beta, p["state0"][:, :2], p["parents"], interpret=True)
    with pytest.raises(ValueError, match="last"):
        mtg.commit_conv(windows, np.array([0, 5]))


_mixer = jax.jit(gdn.gdn_mixer, static_argnames=("num_k_heads", "head_k_dim"))
DIMS = dict(num_k_heads=HK, head_k_dim=DK)


def _mixer_weights(p, seed=0):
    rng = np.random.default_rng(seed)
    z = rng.normal(size=p["a"].shape + (DV,)).astype(np.float32)
    return z, (p["w"], p["a_log"], p["dt_bias"], rng.normal(size=DV).astype(np.float32))


def test_mixer_prefill_then_decode_equals_one_prefill():
    p = _layer(3, 9, parents=np.broadcast_to(np.arange(9, dtype=np.int32) - 1, (B, 9)))
    z, wts = _mixer_weights(p)
    cut = lambda lo, hi: [x[:, lo:hi] for x in (p["x"], z, p["a"], p["b"])]
    y, cs, s = _mixer(*cut(0, 9), *wts, p["conv_state"], p["state0"], **DIMS)
    y1, cs1, s1 = _mixer(*cut(0, 6), *wts, p["conv_state"], p["state0"], **DIMS)
    y2, cs2, s2 = _mixer(*cut(6, 7), *wts, cs1, s1, **DIMS)  # decode: recurrent path
    y3, cs3, s3 = _mixer(*cut(7, 9), *wts, cs2, s2, **DIMS)
    np.testing.assert_allclose(jnp.concatenate([y1, y2, y3], axis=1), y, **TOL)
    np.testing.assert_array_equal(cs3, cs)
    np.testing.assert_allclose(s3, s, **TOL)


@pytest.mark.parametrize("impl", ["xla", "interpret"])
def test_tree_mixer_and_commit_equal_chain_mixer(impl):
    p = _layer(9, 10)
    z, wts = _mixer_weights(p)
    y, windows, stash = jax.jit(functools.partial(mtg.tree_gdn_mixer, impl=impl, **DIMS))(
        p["x"], z, p["a"], p["b"], *wts, p["conv_state"], p["state0"], p["parents"])
    last = np.array([9, 4], np.int32)
    conv, state = mtg.commit_tree_gdn(windows, stash, p["state0"], last)
    for r in range(B):
        idx = np.asarray(_path(p["parents"][r], int(last[r])))
        cy, ccs, cs = _mixer(*(x[r : r + 1, idx] for x in (p["x"], z, p["a"], p["b"])), *wts,
                             p["conv_state"][r : r + 1], p["state0"][r : r + 1], **DIMS)
        np.testing.assert_allclose(y[r, idx], cy[0], **TOL)
        np.testing.assert_array_equal(conv[r], ccs[0])
        np.testing.assert_allclose(state[r], cs[0], **TOL)
    with pytest.raises(ValueError, match="impl"):
        mtg.tree_gdn_mixer(p["x"], z, p["a"], p["b"], *wts, p["conv_state"], p["state0"], p["parents"],
                          impl="cuda", **DIMS)


# ----------------------------------------------------------------------------------------------------------
# Pallas kernel
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n, interpret", [(1, True), (10, True), (10, pltpu.InterpretParams())])
def test_pallas_tree_gdn_interpret_matches_reference(n, interpret):
    p = _layer(8, n)
    _, _, o, stash = _tree_mixer(p, mtg.tree_gdn_wy)
    _, _, o_k, stash_k = _tree_mixer(p, functools.partial(mtg.tree_gdn_pallas, interpret=interpret))
    _, _, o_ref, states = _tree_mixer(p)
    np.testing.assert_allclose(o_k, o, **TOL)
    np.testing.assert_allclose(o_k, o_ref, **TOL)
    for name in ("k", "u", "g_path"):
        np.testing.assert_allclose(getattr(stash_k, name), getattr(stash, name), **TOL)
    last = np.array([n - 1, n // 2], np.int32)
    folded = mtg.tree_gdn_commit(stash_k, p["state0"], last)
    np.testing.assert_allclose(folded, mtg.take_node(states, last), **TOL)


def test_pallas_tree_gdn_bf16_activations():
    p = _layer(11, 10)
    y, _ = mtg.tree_conv(jnp.asarray(p["x"], jnp.bfloat16), p["w"], p["conv_state"], p["parents"])
    q, k, v = gdn.split_qkv(y, HK, DK, HV, DV)
    g, beta = gdn.gdn_gates(p["a"], p["b"], p["a_log"], p["dt_bias"])
    o, stash = mtg.tree_gdn_wy(q, k, v, g, beta, p["state0"], p["parents"])
    o_k, stash_k = mtg.tree_gdn_pallas(q, k, v, g, beta, p["state0"], p["parents"], interpret=True)
    assert o.dtype == o_k.dtype == jnp.bfloat16 and stash_k.u.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(o_k, np.float32), np.asarray(o, np.float32), rtol=1e-2, atol=1e-2)
    np.testing.assert_allclose(stash_k.u, stash.u, **TOL)


@pytest.mark.parametrize(
    "n, dims, dtype", [(16, (HK, HV, DK, DV), jnp.float32), (16, (16, 48, 128, 128), jnp.bfloat16)])
def test_pallas_tree_gdn_lowers_for_tpu(n, dims, dtype):
    hk, hv, dk, dv = dims  # the second case has Qwen3.6-27B's GDN head shapes
    shapes = [(B, n, hk, dk), (B, n, hk, dk), (B, n, hv, dv)]
    args = [jax.ShapeDtypeStruct(s, dtype) for s in shapes]
    args += [jax.ShapeDtypeStruct(s, jnp.float32) for s in [(B, n, hv), (B, n, hv), (B, hv, dk, dv)]]
    args += [jax.ShapeDtypeStruct((B, n), jnp.int32)]
    fn = jax.jit(functools.partial(mtg.tree_gdn_pallas, interpret=False))
    text = fn.trace(*args).lower(lowering_platforms=("tpu",)).as_text()
    assert "tpu_custom_call" in text
