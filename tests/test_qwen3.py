"""The full-attention decoder (``models.decoder``) vs HF transformers (eager, fp32) on tiny random configs:
Qwen3, Llama, Qwen2 and Qwen3-MoE (``oracles.DENSE``)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dtree_jax.models import decoder
from dtree_jax.tree import ancestor_mask
from tests import oracles

TOL = dict(rtol=2e-4, atol=2e-4)
TAPS = (3, 0, 4, 2)  # out of order on purpose; 4 is the last layer (HF takes it after the final norm)
forward = jax.jit(decoder.forward, static_argnames=("cfg", "taps"))


DENSE = oracles.DENSE  # the dense families share one model; each parity test runs on all of them
_tiny = oracles.dense_case


def _causal(b, t):
    return jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))


def _prefill(cfg, params, prompts, capacity):
    """Right-padded batched prefill; returns (logits, feats, cache, lens)."""
    b, t = len(prompts), max(map(len, prompts))
    toks = np.zeros((b, t), np.int32)
    for i, p in enumerate(prompts):
        toks[i, : len(p)] = p
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    cache = decoder.init_cache(cfg, b, capacity)
    logits, feats, cache = forward(
        params, cfg, jnp.asarray(toks), pos, cache, jnp.zeros((b,), jnp.int32), _causal(b, t), TAPS
    )
    return logits, feats, cache, jnp.asarray([len(p) for p in prompts], jnp.int32)


def _taps_ref(hidden, rows):
    return np.concatenate([hidden[i + 1][rows] for i in TAPS], axis=-1)


def test_config_from_hf_forms():
    base = dict(oracles.TINY_TARGET)
    legacy = decoder.config_from_hf(dict(base, rope_scaling=None, tie_word_embeddings=True))
    theta = base.pop("rope_theta")
    new = decoder.config_from_hf(dict(base, rope_parameters={"rope_type": "default", "rope_theta": theta}))
    assert legacy.rope_theta == new.rope_theta == theta
    assert legacy.head_dim == 32 and legacy.tie_word_embeddings and not new.tie_word_embeddings
    assert (legacy.dtype, legacy.attention_impl) == ("bfloat16", "xla")
    assert decoder.config_from_hf(dict(base, rope_theta=theta), dtype=jnp.float32).dtype == "float32"
    assert hash(decoder.config_from_hf(dict(base, rope_theta=theta), dtype="float32", attention_impl="pallas"))
    with pytest.raises(ValueError, match="attention_impl"):
        decoder.config_from_hf(dict(base, rope_theta=theta), attention_impl="cuda")
    with pytest.raises(ValueError, match="rope_type"):
        decoder.config_from_hf(
            dict(base, rope_parameters={"rope_type": "yarn", "rope_theta": theta, "factor": 4.0})
        )
    with pytest.raises(ValueError, match="rope_theta"):
        decoder.config_from_hf(base)


@pytest.mark.parametrize("name", sorted(DENSE))
def test_hf_shapes_match_saved_checkpoint(name, tmp_path):
    from safetensors import safe_open

    model_type, tie, _ = DENSE[name]
    model, cfg, _, reads = _tiny(name)
    model.save_pretrained(tmp_path)
    with safe_open(tmp_path / "model.safetensors", framework="numpy") as f:
        saved = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    assert decoder.hf_shapes(cfg) == saved
    assert ("lm_head.weight" in saved) == (not tie)
    assert sorted(reads) == sorted(saved)
    assert any(k.endswith("q_proj.bias") for k in saved) == (model_type == "qwen2")
    assert any("q_norm" in k for k in saved) == (model_type in ("qwen3", "qwen3_moe"))
    assert any(".mlp.experts." in k for k in saved) == (model_type == "qwen3_moe")
    assert oracles.check_hf_contract(decoder, cfg, jnp.float32) == len(saved)


@pytest.mark.parametrize("name", sorted(DENSE))
def test_prefill_and_decode_match_hf(name):
    model, cfg, params, _ = _tiny(name)
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(0, cfg.vocab_size, 9)), list(rng.integers(0, cfg.vocab_size, 5))]
    logits, feats, cache, lens = _prefill(cfg, params, prompts, capacity=16)
    for b, p in enumerate(prompts):
        ref_logits, ref_hidden = oracles.hf_hidden_and_logits(model, p)
        np.testing.assert_allclose(logits[b, : len(p)], ref_logits, **TOL)
        np.testing.assert_allclose(feats[b, : len(p)], _taps_ref(ref_hidden, slice(None)), **TOL)
    # two decode steps, per-request lengths differ
    for step in range(2):
        nxt = rng.integers(0, cfg.vocab_size, 2)
        logits, feats, cache = forward(
            params,
            cfg,
            jnp.asarray(nxt[:, None], jnp.int32),
            lens[:, None],
            cache,
            lens,
            jnp.ones((2, 1, 1), bool),
            TAPS,
        )
        for b in range(2):
            prompts[b].append(int(nxt[b]))
            ref_logits, ref_hidden = oracles.hf_hidden_and_logits(model, prompts[b])
            np.testing.assert_allclose(logits[b, 0], ref_logits[-1], **TOL)
            np.testing.assert_allclose(feats[b, 0], _taps_ref(ref_hidden, -1), **TOL)
        lens = lens + 1


@pytest.mark.parametrize("name", sorted(DENSE))
def test_tree_verify_matches_hf_paths(name):
    model, cfg, params, _ = _tiny(name)
    rng = np.random.default_rng(1)
    prompts = [list(rng.integers(0, cfg.vocab_size, 4)), list(rng.integers(0, cfg.vocab_size, 7))]
    _, _, cache, lens = _prefill(cfg, params, prompts, capacity=20)
    parents = np.array([[-1, 0, 0, 1, 1, 2, 3, 6], [-1, 0, 1, 2, 0, 4, 1, 5]], np.int32)
    depths = np.zeros_like(parents)
    for b in range(2):
        for i in range(1, parents.shape[1]):
            depths[b, i] = depths[b, parents[b, i]] + 1
    tokens = rng.integers(0, cfg.vocab_size, parents.shape).astype(np.int32)
    mask = ancestor_mask(jnp.asarray(parents))
    logits, feats, new_cache = forward(
        params, cfg, jnp.asarray(tokens), lens[:, None] + jnp.asarray(depths), cache, lens, mask, TAPS
    )
    for b in range(2):
        for node in range(parents.shape[1]):
            path, j = [], node
            while j >= 0:
                path.append(int(tokens[b, j]))
                j = parents[b, j]
            ref_logits, ref_hidden = oracles.hf_hidden_and_logits(model, prompts[b] + path[::-1])
            np.testing.assert_allclose(logits[b, node], ref_logits[-1], **TOL)
            np.testing.assert_allclose(feats[b, node], _taps_ref(ref_hidden, -1), **TOL)
    # the committed prefix rows are untouched; the tree rows sit at [lens, lens + N)
    for k_old, k_new in zip(cache.k, new_cache.k):
        for b in range(2):
            np.testing.assert_array_equal(k_old[b, : lens[b]], k_new[b, : lens[b]])
            assert np.abs(np.asarray(k_new[b, lens[b] : lens[b] + parents.shape[1]])).sum() > 0


def test_bf16_forward_close_to_fp32():
    _, cfg, params, _ = _tiny("qwen3")
    cfg16 = dataclasses.replace(cfg, dtype="bfloat16")
    params16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    toks = jnp.asarray(np.random.default_rng(2).integers(0, cfg.vocab_size, (1, 8)), jnp.int32)
    pos = jnp.arange(8, dtype=jnp.int32)[None]
    args = (toks, pos)
    ref, _, _ = forward(
        params, cfg, *args, decoder.init_cache(cfg, 1, 8), jnp.zeros(1, jnp.int32), _causal(1, 8)
    )
    out, feats, cache = forward(
        params16, cfg16, *args, decoder.init_cache(cfg16, 1, 8), jnp.zeros(1, jnp.int32), _causal(1, 8), (1,)
    )
    assert out.dtype == jnp.float32 and feats.dtype == jnp.bfloat16 and cache.k[0].dtype == jnp.bfloat16
    assert float(jnp.max(jnp.abs(out - ref))) < 0.05 * float(jnp.max(jnp.abs(ref)))


def test_forward_rejects_bad_inputs():
    _, cfg, params, _ = _tiny("qwen3")
    cache = decoder.init_cache(cfg, 1, 4)
    toks, pos, lens = jnp.zeros((1, 3), jnp.int32), jnp.zeros((1, 3), jnp.int32), jnp.zeros(1, jnp.int32)
    with pytest.raises(ValueError, match="taps"):
        decoder.forward(params, cfg, toks, pos, cache, lens, _causal(1, 3), taps=(cfg.num_layers,))
    with pytest.raises(ValueError, match="shapes"):
        decoder.forward(params, cfg, toks, pos, cache, lens, _causal(1, 2))
    with pytest.raises(ValueError, match="fit"):
        decoder.forward(
            params,
            cfg,
            jnp.zeros((1, 5), jnp.int32),
            jnp.zeros((1, 5), jnp.int32),
            cache,
            lens,
            _causal(1, 5),
        )
    with pytest.raises(ValueError, match="HF shape"):
        decoder.params_from_hf(cfg, lambda k: np.zeros((3,), np.float32), jnp.float32)


def test_pallas_dispatch_matches_xla():
    from pallas_kernels import tree_attention as ta

    if not hasattr(ta, "tree_attention"):
        pytest.skip("pallas_kernels.tree_attention.tree_attention not written yet (another helper's file)")
    _, cfg, params, _ = _tiny("qwen3")
    cfg_p = dataclasses.replace(cfg, attention_impl="pallas")
    toks = jnp.asarray(np.random.default_rng(3).integers(0, cfg.vocab_size, (2, 8)), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(8, dtype=jnp.int32), (2, 8))
    lens = jnp.zeros(2, jnp.int32)
    ref, _, _ = forward(params, cfg, toks, pos, decoder.init_cache(cfg, 2, 16), lens, _causal(2, 8))
    out, _, _ = forward(params, cfg_p, toks, pos, decoder.init_cache(cfg_p, 2, 16), lens, _causal(2, 8))
    np.testing.assert_allclose(out, ref, **TOL)


QWEN3_REAL = {  # qwen-targets.md §1.2 (config.json fields as on the hub: top-level rope_theta)
    "Qwen3-4B": dict(hidden_size=2560, intermediate_size=9728, tie_word_embeddings=True),
    "Qwen3-8B": dict(hidden_size=4096, intermediate_size=12288, tie_word_embeddings=False),
}


@pytest.mark.parametrize("name", sorted(QWEN3_REAL))
def test_real_config_shapes(name):
    d = dict(
        QWEN3_REAL[name],
        vocab_size=151936,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        rms_norm_eps=1e-6,
        rope_theta=1000000,
        rope_scaling=None,
        max_position_embeddings=40960,
        hidden_act="silu",
        attention_bias=False,
        use_sliding_window=False,
        model_type="qwen3",
    )
    cfg = decoder.config_from_hf(d)
    n = oracles.check_hf_contract(decoder, cfg, jnp.bfloat16)
    assert n == 1 + 36 * 11 + 1 + (0 if d["tie_word_embeddings"] else 1)
    shapes, h = decoder.hf_shapes(cfg), d["hidden_size"]
    assert shapes["model.layers.0.self_attn.q_proj.weight"] == (4096, h)
    assert shapes["model.layers.35.self_attn.k_proj.weight"] == (1024, h)
    assert shapes["model.layers.7.mlp.down_proj.weight"] == (h, d["intermediate_size"])
    ab = decoder.abstract_params(cfg, jnp.bfloat16)
    assert ab.layers[0].wo.shape == (4096, h) and ab.embed.shape == (151936, h)
    assert (ab.lm_head is None) == d["tie_word_embeddings"]
