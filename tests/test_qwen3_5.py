"""Hybrid GDN targets (Qwen3.5 dense, Qwen3-Next MoE) vs HF transformers 5.24 on tiny random fp32 configs:
prefill/decode logits and GDN states, chunk vs recurrent through the model, tree verify per root-to-node path,
commit vs recomputing the accepted path, a tree-unaware negative control, the weight contract and loading."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from dtree_jax.models import qwen3_5 as m
from dtree_jax.tree import ancestor_mask
from tests import oracles_hybrid as oh

KINDS = ("qwen3_5", "qwen3_next", "qwen3_5_moe")
TOL = dict(rtol=2e-4, atol=2e-4)
TAPS = (2, 3, 0)  # 3 is the last layer (HF takes it after the final norm)
forward = jax.jit(m.forward, static_argnames=("cfg", "taps"))
prefill = jax.jit(m.prefill, static_argnames=("cfg", "taps"))
commit = jax.jit(m.commit, static_argnames=("cfg",))
# two trees: 0->{1,2}, 1->{3,4}, 2->5, 3->6, 6->7  and  0->{1,4}, 1->{2,6}, 2->3, 4->5, 5->7
PARENTS = np.array([[-1, 0, 0, 1, 1, 2, 3, 6], [-1, 0, 1, 2, 0, 4, 1, 5]], np.int32)


@functools.lru_cache(maxsize=None)
def _tiny(kind: str):
    model, d = oh.tiny_hybrid(kind, seed={"qwen3_5": 3, "qwen3_next": 5, "qwen3_5_moe": 6}[kind])
    cfg = m.config_from_hf(d, dtype="float32")
    state = oh.checkpoint_state(model)
    reads = []
    params = m.params_from_hf(cfg, lambda k: reads.append(k) or state[k], jnp.float32)
    return model, cfg, params, tuple(reads)


def _pad(prompts):
    toks = np.zeros((len(prompts), max(map(len, prompts))), np.int32)
    for i, p in enumerate(prompts):
        toks[i, : len(p)] = p
    return jnp.asarray(toks), jnp.asarray([len(p) for p in prompts], jnp.int32)


def _prefill(cfg, params, prompts, capacity, taps=()):
    toks, lens = _pad(prompts)
    logits, feats, cache = prefill(params, cfg, toks, m.init_cache(cfg, len(prompts), capacity), lens, taps)
    return logits, feats, cache, lens


def _check_states(cfg, cache, row, hf_cache, tol=TOL):
    for j, layer in enumerate(cfg.gdn_layers):
        conv, rec = oh.hf_gdn_states(hf_cache, layer)
        np.testing.assert_allclose(cache.conv[j][row], conv[0], **tol)
        np.testing.assert_allclose(cache.state[j][row], rec[0], **tol)


def _paths(parents):
    """Root-to-node index lists per node."""
    out = []
    for node in range(len(parents)):
        path, j = [], node
        while j >= 0:
            path.append(j)
            j = parents[j]
        out.append(path[::-1])
    return out


def _verify(cfg, params, cache, lens, tokens, mask):
    depths = jnp.sum(mask, axis=-1, dtype=jnp.int32) - 1
    return forward(params, cfg, jnp.asarray(tokens), lens[:, None] + depths, cache, lens, mask)


# ----------------------------------------------------------------------------------------------------------
# Config and weight contract
# ----------------------------------------------------------------------------------------------------------


def test_config_from_hf_forms():
    base = {k: v for k, v in oh.TINY_HYBRID.items() if k != "rope_parameters"}
    text = dict(base, model_type="qwen3_5_text", rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                "partial_rotary_factor": 0.5, "mrope_section": [1, 1, 2], "mrope_interleaved": True})
    nested = m.config_from_hf(dict(model_type="qwen3_5", text_config=text, tie_word_embeddings=True))
    assert nested.rotary_dim == 16 and nested.tie_word_embeddings and not nested.fused_gdn_proj
    assert nested.layer_types == ("linear_attention",) * 3 + ("full_attention",)
    assert (nested.dtype, nested.attention_impl, nested.moe_layers) == ("bfloat16", "xla", (False,) * 4)
    legacy = m.config_from_hf(dict(base, model_type="qwen3_next", rope_theta=1e4, partial_rotary_factor=0.25,
                                   num_hidden_layers=6, full_attention_interval=3, mlp_only_layers=[1],
                                   decoder_sparse_step=1, **oh.TINY_MOE), dtype=jnp.float32)
    assert legacy.fused_gdn_proj and legacy.rotary_dim == 8 and legacy.dtype == "float32"
    assert legacy.attn_layers == (2, 5) and legacy.gdn_layers == (0, 1, 3, 4)
    assert legacy.moe_layers == (True, False, True, True, True, True) and legacy.num_experts == 6
    explicit = m.config_from_hf(dict(text, layer_types=["full_attention", "linear_attention"] * 2))
    assert explicit.attn_layers == (0, 2)
    assert hash(m.config_from_hf(text, attention_impl="pallas"))
    with pytest.raises(ValueError, match="model_type"):
        m.config_from_hf(dict(text, model_type="qwen3"))
    with pytest.raises(ValueError, match="attention_impl"):
        m.config_from_hf(text, attention_impl="cuda")
    with pytest.raises(ValueError, match="rope_theta"):
        m.config_from_hf(dict(base, model_type="qwen3_5_text"))
    with pytest.raises(ValueError, match="layer_types"):
        m.config_from_hf(dict(text, layer_types=["full_attention"]))
    with pytest.raises(ValueError, match="linear_num_value_heads"):
        m.config_from_hf(dict(text, linear_num_value_heads=3))


@pytest.mark.parametrize("kind", KINDS)
def test_weight_contract(kind, tmp_path):
    """hf_shapes == the save_pretrained checkpoint; params_from_hf reads every key once and matches
    abstract_params; the Qwen3-Next regroup puts q/k/v/z/b/a rows where the Qwen3.5 layout expects them."""
    from safetensors import safe_open

    model, cfg, params, reads = _tiny(kind)
    model.save_pretrained(tmp_path)
    with safe_open(tmp_path / "model.safetensors", framework="numpy") as f:
        saved = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    assert m.hf_shapes(cfg) == saved
    assert sorted(reads) == sorted(saved)
    abstract = m.abstract_params(cfg, jnp.float32)
    assert jax.tree.structure(abstract) == jax.tree.structure(params)
    for a, b in zip(jax.tree.leaves(abstract), jax.tree.leaves(params)):
        assert (a.shape, a.dtype) == (b.shape, b.dtype)
    if kind == "qwen3_next":  # regroup vs HF's own split of the fused projections
        la = model.model.layers[0].linear_attn
        x = torch.randn(1, 3, cfg.hidden_size)
        with torch.no_grad():
            q, k, v, z, b, a = la.fix_query_key_value_ordering(la.in_proj_qkvz(x), la.in_proj_ba(x))
        qkv = torch.cat([t.reshape(1, 3, -1) for t in (q, k, v)], -1)
        p = params.layers[0].mixer
        xn = x.numpy()
        for ref, w in ((qkv, p.w_qkv), (z.reshape(1, 3, -1), p.w_z), (b.reshape(1, 3, -1), p.w_b),
                       (a.reshape(1, 3, -1), p.w_a)):
            np.testing.assert_allclose(xn @ np.asarray(w), ref.numpy(), rtol=1e-5, atol=1e-5)


def test_load_hf_checkpoint_layouts(tmp_path):
    """dtree_jax.convert.load_hf of a Qwen3_5ForCausalLM directory and of a tiny
    Qwen3_5ForConditionalGeneration (``model.language_model.*`` plus ``model.visual.*``) with the same text
    weights gives the same params."""
    from transformers.models.qwen3_5 import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    from dtree_jax.convert import load_hf

    model, cfg, params, _ = _tiny("qwen3_5")
    model.save_pretrained(tmp_path / "causal")
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=cfg.hidden_size,
                  patch_size=2, temporal_patch_size=1, spatial_merge_size=1, num_position_embeddings=16)
    vl_cfg = Qwen3_5Config(text_config=model.config.to_dict(), vision_config=vision)
    vl = Qwen3_5ForConditionalGeneration(vl_cfg)
    vl.model.language_model.load_state_dict(model.model.state_dict())
    vl.lm_head.load_state_dict(model.lm_head.state_dict())
    vl.save_pretrained(tmp_path / "vl")
    for sub in ("causal", "vl"):
        kind, cfg2, params2 = load_hf(tmp_path / sub, progress=False)
        assert kind == "qwen3_5" and dataclasses.replace(cfg2, dtype="float32") == cfg
        for a, b in zip(jax.tree.leaves(params2), jax.tree.leaves(params)):
            np.testing.assert_array_equal(np.asarray(a, np.float32), b)


# ----------------------------------------------------------------------------------------------------------
# Prefill, decode, chunk vs recurrent
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_prefill_and_decode_match_hf(kind):
    model, cfg, params, _ = _tiny(kind)
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(0, cfg.vocab_size, 9)), list(rng.integers(0, cfg.vocab_size, 5))]
    logits, feats, cache, lens = _prefill(cfg, params, prompts, capacity=16, taps=TAPS)
    hf_caches = []
    for b, p in enumerate(prompts):
        with torch.no_grad():
            out = model(torch.tensor([p]), output_hidden_states=True, use_cache=False)
        np.testing.assert_allclose(logits[b, : len(p)], out.logits[0].numpy(), **TOL)
        ref_feats = np.concatenate([out.hidden_states[i + 1][0].numpy() for i in TAPS], -1)
        np.testing.assert_allclose(feats[b, : len(p)], ref_feats, **TOL)
        _, hf_cache = oh.hf_run(model, [p])
        _check_states(cfg, cache, b, hf_cache)
        hf_caches.append(hf_cache)
    for _ in range(3):  # decode = 1-node verify + commit
        nxt = rng.integers(0, cfg.vocab_size, (2, 1)).astype(np.int32)
        one = jnp.ones((2, 1, 1), bool)
        out, _, cache = forward(params, cfg, jnp.asarray(nxt), lens[:, None], cache, lens, one)
        cache = commit(cfg, cache, lens, jnp.zeros((2, 1), jnp.int32), jnp.ones(2, jnp.int32))
        assert cache.pending is None
        lens = lens + 1
        for b in range(2):
            ref, _ = oh.hf_run(model, nxt[b : b + 1], hf_caches[b])
            np.testing.assert_allclose(out[b, 0], ref[0, -1], **TOL)
            _check_states(cfg, cache, b, hf_caches[b])


@pytest.mark.parametrize("kind", ["qwen3_5", pytest.param("qwen3_next", marks=pytest.mark.slow)])
def test_chunked_prefill_matches_recurrent_decode(kind):
    """A 70-token prompt (chunked delta rule across the 64-token chunk boundary, with a shorter padded row) vs
    HF token-by-token decoding (torch recurrent kernel) and vs our own one-token verify/commit steps."""
    model, cfg, params, _ = _tiny(kind)
    rng = np.random.default_rng(1)
    long = list(rng.integers(0, cfg.vocab_size, 70))
    logits, _, cache, _ = _prefill(cfg, params, [long, long[:67]], capacity=72)
    hf_cache, ref = None, []
    for t in long:
        out, hf_cache = oh.hf_run(model, [[t]], hf_cache)
        ref.append(out[0, -1])
    np.testing.assert_allclose(logits[0], np.stack(ref), **TOL)
    np.testing.assert_allclose(logits[1, :67], np.stack(ref[:67]), **TOL)
    _check_states(cfg, cache, 0, hf_cache)
    # our recurrent path: prefill 67, then the 3 remaining tokens one by one
    step = dataclasses.replace(cache, k=tuple(x[1:] for x in cache.k), v=tuple(x[1:] for x in cache.v),
                               conv=tuple(x[1:] for x in cache.conv), state=tuple(x[1:] for x in cache.state))
    lens = jnp.asarray([67], jnp.int32)
    for t in long[67:]:
        out, _, step = forward(params, cfg, jnp.asarray([[t]], jnp.int32), lens[:, None], step, lens,
                               jnp.ones((1, 1, 1), bool))
        step = commit(cfg, step, lens, jnp.zeros((1, 1), jnp.int32), jnp.ones(1, jnp.int32))
        lens = lens + 1
    np.testing.assert_allclose(out[0, 0], ref[-1], **TOL)
    _check_states(cfg, step, 0, hf_cache)


# ----------------------------------------------------------------------------------------------------------
# Tree verify and commit
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_tree_verify_and_commit_match_hf_paths(kind):
    model, cfg, params, _ = _tiny(kind)
    rng = np.random.default_rng(2)
    prompts = [list(rng.integers(0, cfg.vocab_size, 6)), list(rng.integers(0, cfg.vocab_size, 9))]
    _, _, cache, lens = _prefill(cfg, params, prompts, capacity=24)
    tokens = rng.integers(0, cfg.vocab_size, PARENTS.shape).astype(np.int32)
    mask = ancestor_mask(jnp.asarray(PARENTS))
    logits, _, vcache = _verify(cfg, params, cache, lens, tokens, mask)
    for b in range(2):
        for node, path in enumerate(_paths(PARENTS[b])):
            ref = oh.hf_logits(model, prompts[b] + [int(tokens[b, j]) for j in path])
            np.testing.assert_allclose(logits[b, node], ref[-1], **TOL)
    # the committed GDN states are untouched by the verify
    for a, c in zip(cache.conv + cache.state, vcache.conv + vcache.state):
        np.testing.assert_array_equal(a, c)
    # commit: request 0 accepts 0->1->3->6 (4 nodes), request 1 accepts 0->4->5 (3 of the 4 listed)
    path = jnp.asarray([[0, 1, 3, 6], [0, 4, 5, 7]], jnp.int32)
    num = jnp.asarray([4, 3], jnp.int32)
    new = commit(cfg, vcache, lens, path, num)
    nxt = rng.integers(0, cfg.vocab_size, (2, 1)).astype(np.int32)
    new_lens = lens + num
    one = jnp.ones((2, 1, 1), bool)
    out, _, _ = forward(params, cfg, jnp.asarray(nxt), new_lens[:, None], new, new_lens, one)
    for b in range(2):
        accepted = prompts[b] + [int(tokens[b, j]) for j in np.asarray(path[b, : num[b]])]
        _, hf_cache = oh.hf_run(model, [accepted])
        _check_states(cfg, new, b, hf_cache)
        np.testing.assert_allclose(out[b, 0], oh.hf_logits(model, accepted + [int(nxt[b, 0])])[-1], **TOL)
    # num_emitted == 0 keeps the row's committed state and K/V
    kept = commit(cfg, vcache, lens, path, jnp.asarray([0, 2], jnp.int32))
    for a, c in zip(cache.conv + cache.state, kept.conv + kept.state):
        np.testing.assert_array_equal(a[0], c[0])
    for a, c in zip(vcache.k + vcache.v, kept.k + kept.v):  # prefix and (ignored) tree rows as they were
        np.testing.assert_array_equal(a[0], c[0])
    assert not np.allclose(kept.state[0][1], cache.state[0][1])


@pytest.mark.parametrize("kind", KINDS)
def test_tree_unaware_chain_verify_differs(kind):
    """Negative control: verifying the same branching tree flattened as a chain in index order (causal mask)
    gives different logits at nodes whose index-order predecessors are not their ancestors."""
    model, cfg, params, _ = _tiny(kind)
    rng = np.random.default_rng(3)
    prompts = [list(rng.integers(0, cfg.vocab_size, 7))] * 2
    _, _, cache, lens = _prefill(cfg, params, prompts, capacity=24)
    tokens = rng.integers(0, cfg.vocab_size, PARENTS.shape).astype(np.int32)
    tree_logits, _, _ = _verify(cfg, params, cache, lens, tokens, ancestor_mask(jnp.asarray(PARENTS)))
    chain = jnp.broadcast_to(jnp.tri(PARENTS.shape[1], dtype=bool), (2,) + PARENTS.shape[1:] * 2)
    pos = lens[:, None] + jnp.arange(8)
    chain_logits, _, _ = forward(params, cfg, jnp.asarray(tokens), pos, cache, lens, chain)
    node = 2  # parent 0 in both trees, but index-order predecessor 1
    ref = oh.hf_logits(model, prompts[0] + [int(tokens[0, 0]), int(tokens[0, 2])])[-1]
    np.testing.assert_allclose(tree_logits[0, node], ref, **TOL)
    assert np.abs(np.asarray(chain_logits[0, node]) - ref).max() > 1e-2
    np.testing.assert_allclose(chain_logits[:, :2], tree_logits[:, :2], **TOL)  # a shared prefix agrees


def test_pallas_impl_matches_xla():
    """attention_impl="pallas": tree-attention and tree-GDN Pallas kernels (interpret mode on CPU)."""
    _, cfg, params, _ = _tiny("qwen3_5")
    cfg_p = dataclasses.replace(cfg, attention_impl="pallas")
    rng = np.random.default_rng(4)
    prompts = [list(rng.integers(0, cfg.vocab_size, 6)), list(rng.integers(0, cfg.vocab_size, 9))]
    _, _, cache, lens = _prefill(cfg, params, prompts, capacity=24)
    tokens = rng.integers(0, cfg.vocab_size, PARENTS.shape).astype(np.int32)
    mask = ancestor_mask(jnp.asarray(PARENTS))
    ref, _, ref_cache = _verify(cfg, params, cache, lens, tokens, mask)
    out, _, out_cache = _verify(cfg_p, params, cache, lens, tokens, mask)
    np.testing.assert_allclose(out, ref, **TOL)
    path, num = jnp.asarray([[0, 2, 5, 0], [0, 1, 6, 0]], jnp.int32), jnp.asarray([3, 3], jnp.int32)
    a, b = commit(cfg, ref_cache, lens, path, num), commit(cfg_p, out_cache, lens, path, num)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(x, y, **TOL)


@pytest.mark.parametrize("kind", [pytest.param("qwen3_5", marks=pytest.mark.slow), "qwen3_next"])
def test_bf16_error_like_hf_bf16(kind):
    """bf16 params/activations: the error vs fp32 is of the size HF's own bf16 model shows (this tiny random
    model is sensitive: both reach ~1 logit at worst), dtypes are as documented, verify + commit run."""
    import copy

    model, cfg, params, _ = _tiny(kind)
    cfg16 = dataclasses.replace(cfg, dtype="bfloat16")
    params16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    rng = np.random.default_rng(5)
    prompts = [list(rng.integers(0, cfg.vocab_size, 12)) for _ in range(4)]
    ref, _, _, _ = _prefill(cfg, params, prompts, capacity=24)
    out, _, cache, lens = _prefill(cfg16, params16, prompts, capacity=24)
    with torch.no_grad():
        hf16 = copy.deepcopy(model).to(torch.bfloat16)(torch.tensor(prompts)).logits.float().numpy()
    hf_err = np.abs(hf16 - np.asarray(ref)).mean()
    assert 0 < np.abs(np.asarray(out - ref)).mean() < 1.5 * hf_err
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (4, 8)), jnp.int32)
    mask = ancestor_mask(jnp.asarray(np.concatenate([PARENTS, PARENTS])))
    logits, _, vcache = _verify(cfg16, params16, cache, lens, tokens, mask)
    new = commit(cfg16, vcache, lens, jnp.asarray([[0, 1, 3]] * 4), jnp.asarray([3, 2, 1, 0]))
    assert logits.dtype == jnp.float32 and bool(jnp.all(jnp.isfinite(logits)))
    assert new.k[0].dtype == new.conv[0].dtype == jnp.bfloat16 and new.state[0].dtype == jnp.float32
    assert jax.tree.structure(new) == jax.tree.structure(cache)


# ----------------------------------------------------------------------------------------------------------
# Decode-loop integration and input checks
# ----------------------------------------------------------------------------------------------------------


def test_decode_loop_greedy_matches_hf_generate():
    """dtree_jax.decode (method "ar": a 1-node verify + commit per round) reproduces HF greedy decoding."""
    from dtree_jax import api

    model, cfg, params, _ = _tiny("qwen3_next")
    prompts = [[5, 17, 99, 3, 42, 7, 8], [11, 12, 13]]
    gen = api.generate(("qwen3_5", cfg, params), prompts, "ar", max_new_tokens=6, stop_ids=())
    for p, toks in zip(prompts, gen.tokens):
        with torch.no_grad():
            ref = model.generate(torch.tensor([p]), max_new_tokens=6, do_sample=False, pad_token_id=0)
        assert toks == ref[0, len(p):].tolist()


def test_bad_inputs():
    _, cfg, params, _ = _tiny("qwen3_5")
    cache = m.init_cache(cfg, 1, 4)
    toks, lens = jnp.zeros((1, 3), jnp.int32), jnp.zeros(1, jnp.int32)
    causal = jnp.tri(3, dtype=bool)[None]
    with pytest.raises(ValueError, match="pending"):
        m.commit(cfg, cache, lens, jnp.zeros((1, 3), jnp.int32), jnp.ones(1, jnp.int32))
    with pytest.raises(ValueError, match="taps"):
        m.forward(params, cfg, toks, toks, cache, lens, causal, taps=(4,))
    with pytest.raises(ValueError, match="shapes"):
        m.forward(params, cfg, toks, toks, cache, lens, causal[:, :2, :2])
    with pytest.raises(ValueError, match="fit"):
        m.forward(params, cfg, jnp.zeros((1, 5), jnp.int32), jnp.zeros((1, 5), jnp.int32), cache, lens,
                  jnp.tri(5, dtype=bool)[None])
    with pytest.raises(ValueError, match="layer types"):
        m.forward(params, cfg, toks, toks, dataclasses.replace(cache, conv=cache.conv[:1]), lens, causal)
    with pytest.raises(ValueError, match="HF shape"):
        m.params_from_hf(cfg, lambda k: np.zeros((3,), np.float32), jnp.float32)
