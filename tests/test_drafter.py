"""DFlash/Domino drafter vs the ``dflash`` package's ``DFlashDraftModel`` (block hidden states) and
specforge's ``DominoDraftModel.apply_logits_head`` (GRU correction), tiny random fp32 models on CPU."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from dtree_jax.models import decoder, drafter
from dtree_jax.models.config import DrafterConfig, default_target_layer_ids
from tests import oracles

TOL = dict(rtol=2e-4, atol=2e-4)
append_context = jax.jit(drafter.append_context, static_argnames=("cfg",))
draft_block = jax.jit(drafter.draft_block, static_argnames=("cfg", "target"))


@functools.lru_cache(maxsize=None)
def _target():
    model, d = oracles.tiny_qwen3(tie=False, seed=7)
    cfg = decoder.config_from_hf(d, dtype="float32")
    return model, cfg, decoder.params_from_hf(cfg, oracles.StateGetter(model), jnp.float32)


@functools.lru_cache(maxsize=None)
def _drafter(shift_label: bool):
    domino, dflash, d = oracles.tiny_domino(shift_label, seed=11 if shift_label else 12)
    cfg = drafter.config_from_hf(d, dtype="float32")
    getter = oracles.StateGetter(domino)
    params = drafter.params_from_hf(cfg, getter, jnp.float32)
    return domino, dflash, cfg, params, getter


def _dflash_block(dflash, tmodel, feats, root, cfg, ctx_len):
    """Reference block hidden states for one request with ``ctx_len`` context rows (no cache)."""
    ids = torch.tensor([[root] + [cfg.mask_token_id] * (cfg.block_size - 1)])
    with torch.no_grad():
        noise = tmodel.model.embed_tokens(ids)
        out = dflash(
            target_hidden=torch.from_numpy(np.asarray(feats[None, :ctx_len])),
            noise_embedding=noise,
            position_ids=torch.arange(ctx_len + cfg.block_size)[None],
        )
    return out[0].numpy()


def test_config_from_hf():
    d = oracles.tiny_drafter_config_dict(shift_label=True)
    cfg = drafter.config_from_hf(d)
    assert cfg.has_head and cfg.shift_label and cfg.num_draft_rows == cfg.block_size == 6
    assert (cfg.target_layer_ids, cfg.mask_token_id, cfg.pure_draft_prefix_len) == ((0, 2, 3), 127, 1)
    assert (cfg.emb_dim, cfg.gru_hidden_dim, cfg.model.num_layers) == (16, 24, 2)
    legacy = dict(d, dflash_config=dict(d["dflash_config"], projector_type="causal_v5", shift_label=False))
    assert drafter.config_from_hf(legacy).has_head and drafter.config_from_hf(legacy).num_draft_rows == 5
    plain = drafter.config_from_hf(oracles.tiny_drafter_config_dict(shift_label=False, head=False))
    assert not plain.has_head and not plain.shift_label and plain.pure_draft_prefix_len == 0
    assert "prefix_gru.weight_ih_l0" not in drafter.hf_shapes(plain)
    no_ids = dict(d, dflash_config={k: v for k, v in d["dflash_config"].items() if k != "target_layer_ids"})
    assert drafter.config_from_hf(no_ids).target_layer_ids == default_target_layer_ids(5, 2) == (1, 2)
    assert default_target_layer_ids(36, 5) == (1, 9, 17, 25, 33)
    assert default_target_layer_ids(64, 5) == (1, 16, 31, 46, 61)
    assert default_target_layer_ids(36, 1) == (18,)
    top_emb = dict(d, emb_dim=20)  # SGLang reads emb_dim from the top level first
    assert drafter.config_from_hf(top_emb).emb_dim == 20
    with pytest.raises(ValueError, match="projector_type"):
        drafter.config_from_hf(dict(d, dflash_config=dict(d["dflash_config"], projector_type="medusa")))
    with pytest.raises(ValueError, match="mask_token_id"):
        drafter.config_from_hf(dict(d, dflash_config={"target_layer_ids": [0, 1]}))
    with pytest.raises(ValueError, match="emb_dim"):
        drafter.config_from_hf(
            dict(d, dflash_config={"mask_token_id": 1, "target_layer_ids": [0], "projector_type": "domino"})
        )
    assert hash(cfg)


@pytest.mark.parametrize("shift_label", [True, False])
def test_hf_shapes_match_specforge(shift_label):
    domino, _, cfg, _, getter = _drafter(shift_label)
    ref = {k: tuple(v.shape) for k, v in domino.state_dict().items()}
    assert drafter.hf_shapes(cfg) == ref
    assert sorted(getter.reads) == sorted(ref)


def test_block_matches_dflash_across_rounds():
    """Context appended in rounds with per-request valid counts (rows past them are overwritten next round),
    block drafted between rounds without committing its K/V; compared with dflash on the whole context."""
    tmodel, tcfg, tparams = _target()
    _, dflash, cfg, params, _ = _drafter(True)
    rng = np.random.default_rng(0)
    b, h = 2, tcfg.hidden_size
    total = [9, 5]
    feats = rng.standard_normal((b, 9, cfg.num_features * h)).astype(np.float32)
    roots = rng.integers(0, tcfg.vocab_size, (3, b)).astype(np.int32)
    cache = drafter.init_drafter_cache(cfg, b, 9 + cfg.block_size)
    ctx = np.zeros(b, np.int32)
    rounds = [(np.array([4, 2]), 4), (np.array([5, 3]), 5)]  # (valid rows per request, chunk width T)
    for r, (valid, width) in enumerate(rounds):
        chunk = np.zeros((b, width, feats.shape[-1]), np.float32)
        for i in range(b):
            chunk[i, : valid[i]] = feats[i, ctx[i] : ctx[i] + valid[i]]
            chunk[i, valid[i] :] = rng.standard_normal((width - valid[i], feats.shape[-1]))  # junk rows
        pos = ctx[:, None] + np.arange(width, dtype=np.int32)
        cache = append_context(params, cfg, cache, jnp.asarray(ctx), jnp.asarray(chunk), jnp.asarray(pos))
        ctx = ctx + valid
        ph_full = draft_block(params, cfg, decoder, tparams, cache, jnp.asarray(ctx), jnp.asarray(roots[r]))
        assert ph_full.shape == (b, cfg.block_size, h)
        for i in range(b):
            ref = _dflash_block(dflash, tmodel, feats[i], int(roots[r, i]), cfg, int(ctx[i]))
            np.testing.assert_allclose(ph_full[i], ref, **TOL)
    assert list(ctx) == total


@pytest.mark.parametrize("shift_label", [True, False])
def test_path_logits_match_specforge_head(shift_label):
    tmodel, tcfg, tparams = _target()
    domino, _, cfg, params, _ = _drafter(shift_label)
    rng = np.random.default_rng(1)
    b, bs = 3, cfg.block_size
    ph_full = rng.standard_normal((b, bs, tcfg.hidden_size)).astype(np.float32)
    tokens = rng.integers(0, tcfg.vocab_size, (b, bs))  # [anchor, t_1, ..., t_{bs-1}] teacher tokens
    with torch.no_grad():
        hs = torch.from_numpy(ph_full)[:, None]
        ref = domino.apply_logits_head(
            tmodel.lm_head(hs),
            prev_token_embeddings=tmodel.model.embed_tokens(torch.from_numpy(tokens))[:, None],
            hidden_states=hs,
        )[
            :, 0
        ].numpy()  # [B, bs, V], row r per specforge's slot convention
    ph = drafter.draft_rows(jnp.asarray(ph_full), cfg)
    k = cfg.num_draft_rows
    assert ph.shape == (b, k, tcfg.hidden_size)
    out = drafter.path_logits(params, cfg, decoder, tparams, tcfg, ph, jnp.asarray(tokens[:, :k], jnp.int32))
    offset = 0 if shift_label else 1  # ph[d] = ph_full[d + offset]
    np.testing.assert_allclose(out, ref[:, offset:], **TOL)
    # rows before pure_draft_prefix_len are the base logits; later rows really are corrected
    base = np.asarray(decoder.lm_head(tparams, tcfg, ph))
    np.testing.assert_allclose(
        out[:, : cfg.pure_draft_prefix_len], base[:, : cfg.pure_draft_prefix_len], **TOL
    )
    assert (
        np.abs(np.asarray(out)[:, cfg.pure_draft_prefix_len :] - base[:, cfg.pure_draft_prefix_len :]).min()
        > 0
    )


def test_plain_dflash_params_and_logits():
    _, tcfg, tparams = _target()
    d = oracles.tiny_drafter_config_dict(shift_label=False, head=False)
    cfg = drafter.config_from_hf(d, dtype="float32")
    shapes = drafter.hf_shapes(cfg)
    rng = np.random.default_rng(2)
    params = drafter.params_from_hf(
        cfg, lambda k: rng.standard_normal(shapes[k]).astype(np.float32), jnp.float32
    )
    assert params.head is None
    ph = drafter.draft_rows(
        jnp.asarray(rng.standard_normal((1, cfg.block_size, tcfg.hidden_size)), jnp.float32), cfg
    )
    out = drafter.path_logits(params, cfg, decoder, tparams, tcfg, ph, jnp.zeros((1, ph.shape[1]), jnp.int32))
    np.testing.assert_allclose(out, decoder.lm_head(tparams, tcfg, ph), rtol=1e-6)


def _real_drafter(hidden, inter, vocab, n_target, ids, mask, theta, shift, head=True):
    dc = dict(mask_token_id=mask, target_layer_ids=ids)
    if head:
        dc.update(
            projector_type="domino",
            pure_draft_prefix_len=1,
            emb_dim=256,
            gru_hidden_dim=1024,
            shift_label=shift,
        )
    return dict(
        architectures=["DFlashDraftModel"],
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=5,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        rms_norm_eps=1e-6,
        rope_theta=theta,
        rope_scaling=None,
        vocab_size=vocab,
        tie_word_embeddings=False,
        max_position_embeddings=40960,
        layer_types=["full_attention"] * 5,
        block_size=16,
        num_target_layers=n_target,
        **({"emb_dim": 256} if head else {}),
        dflash_config=dc,
    )


REAL_DRAFTERS = {  # domino-dflash-ddtree.md §1.1 / §2.1 / §3.2
    "Qwen3-4B-DFlash-b16": _real_drafter(
        2560, 9728, 151936, 36, [1, 9, 17, 25, 33], 151669, 1e6, None, head=False
    ),
    "Qwen3-8B-Domino-b16": _real_drafter(4096, 12288, 151936, 36, [1, 9, 17, 25, 33], 151669, 1e6, True),
    "Qwen3.6-27B-Domino": _real_drafter(5120, 17408, 248320, 64, [1, 16, 31, 46, 61], 248070, 1e7, False),
}


@pytest.mark.parametrize("name", sorted(REAL_DRAFTERS))
def test_real_drafter_shapes(name):
    cfg = drafter.config_from_hf(REAL_DRAFTERS[name])
    n = oracles.check_hf_contract(drafter, cfg, jnp.bfloat16)
    assert n == 3 + 5 * 11 + (4 if cfg.has_head else 0)
    shapes, h = drafter.hf_shapes(cfg), cfg.model.hidden_size
    assert shapes["fc.weight"] == (h, 5 * h)
    if cfg.has_head:
        assert shapes["prefix_gru.weight_ih_l0"] == (3072, h)
        assert shapes["embed_proj.0.weight"] == (256, h + 1024)
        assert shapes["embed_proj.2.weight"] == (cfg.model.vocab_size, 256)
        ab = drafter.abstract_params(cfg, jnp.bfloat16)
        assert ab.head.w_ih.shape == (h, 3072) and ab.head.w1.shape == (h + 1024, 256)
    assert cfg.num_draft_rows == (16 if cfg.shift_label else 15)
    assert isinstance(cfg, DrafterConfig)


def test_every_config_field_is_honoured_or_refused():
    d = oracles.tiny_drafter_config_dict(shift_label=False, head=False)
    base = drafter.config_from_hf(d)
    assert base.causal_layers == (False, False) and base.layer_windows == (None, None)
    assert (base.input_embedding_scale, base.output_multiplier, base.final_logit_softcapping) == (1.0, 1.0, None)
    scaled = drafter.config_from_hf(dict(d, dflash_config=dict(d["dflash_config"], input_embedding_scale=2.0)))
    assert scaled.input_embedding_scale == 2.0
    assert drafter.config_from_hf(dict(d, is_causal=True)).causal_layers == (True, True)
    # use_sliding_window with layer_types: sliding layers get the window and are causal unless is_causal=False
    sw = dict(d, use_sliding_window=True, sliding_window=7, layer_types=["full_attention", "sliding_attention"])
    cfg = drafter.config_from_hf(sw)
    assert cfg.layer_windows == (None, 7) and cfg.causal_layers == (False, True)
    assert drafter.config_from_hf(dict(sw, is_causal=False)).causal_layers == (False, False)
    # without use_sliding_window HF drops the window; without layer_types it follows max_window_layers
    assert drafter.config_from_hf(dict(sw, use_sliding_window=False)).layer_windows == (None, None)
    by_depth = drafter.config_from_hf(dict(d, use_sliding_window=True, sliding_window=7, max_window_layers=1))
    assert by_depth.layer_windows == (None, 7)
    for bad, match in (
        (dict(d, layer_types=["full_attention"]), "layer_types"),
        (dict(d, layer_types=["full_attention", "chunked_attention"]), "layer_types"),
        (dict(sw, sliding_window=0), "sliding_window"),
        (dict(d, use_mrope=True), "use_mrope"),
        (dict(d, dflash_config=dict(d["dflash_config"], selector_rank=8)), "dflash_config.selector_rank"),
        (dict(d, architectures=["DFlash2DraftModel"]), "DFlash2DraftModel"),
        (dict(d, attention_bias=True), "attention_bias"),
        (dict(d, hidden_act="gelu"), "hidden_act"),
        (dict(d, model_type="llama"), "model_type"),
    ):
        with pytest.raises(ValueError, match=match):
            drafter.config_from_hf(bad)
    domino = oracles.tiny_drafter_config_dict(shift_label=False)
    with pytest.raises(ValueError, match="output_multiplier"):
        drafter.config_from_hf(dict(domino, dflash_config=dict(domino["dflash_config"], output_multiplier=2.0)))
    # the generic fields transformers writes are accepted
    from transformers import Qwen3Config

    written = dict(Qwen3Config(**{k: v for k, v in d.items() if k != "dflash_config"}).to_dict(), **d)
    assert drafter.config_from_hf(written).model == base.model


def test_block_honours_causal_window_and_embedding_scale():
    """The drafter block vs the dflash package's model on one context, for each attention variant."""
    from dflash.model import DFlashDraftModel
    from transformers import Qwen3Config

    tmodel, tcfg, tparams = _target()
    _, dflash, _, _, getter = _drafter(False)
    rng = np.random.default_rng(5)
    ctx = 9
    d0 = oracles.tiny_drafter_config_dict(shift_label=False)
    feats = rng.standard_normal((1, ctx, 3 * tcfg.hidden_size)).astype(np.float32)
    root = 17
    variants = {
        "causal": dict(is_causal=True),
        "window": dict(use_sliding_window=True, sliding_window=4, layer_types=["sliding_attention"] * 2),
        "window_noncausal": dict(use_sliding_window=True, sliding_window=3, is_causal=False,
                                 layer_types=["full_attention", "sliding_attention"]),
        "scale": dict(dflash_config=dict(d0["dflash_config"], input_embedding_scale=1.5)),
        "llama3_rope": dict(rope_parameters=dict(rope_type="llama3", rope_theta=10000.0, factor=8.0,
                                                 low_freq_factor=1.0, high_freq_factor=4.0,
                                                 original_max_position_embeddings=4)),
    }
    plain = None
    for name, extra in variants.items():
        d = dict(d0, **extra)
        cfg = drafter.config_from_hf(d, dtype="float32")
        params = drafter.params_from_hf(cfg, getter, jnp.float32)
        hf = Qwen3Config(**d)
        hf._attn_implementation = "eager"
        ref_model = DFlashDraftModel(hf).eval()
        ref_model.load_state_dict(dflash.state_dict())
        ids = torch.tensor([[root] + [cfg.mask_token_id] * (cfg.block_size - 1)])
        with torch.no_grad():
            noise = tmodel.model.embed_tokens(ids) * cfg.input_embedding_scale
            ref = ref_model(target_hidden=torch.from_numpy(feats), noise_embedding=noise,
                            position_ids=torch.arange(ctx + cfg.block_size)[None])[0].numpy()
        cache = drafter.init_drafter_cache(cfg, 1, ctx + cfg.block_size)
        pos = jnp.arange(ctx, dtype=jnp.int32)[None]
        cache = append_context(params, cfg, cache, jnp.zeros((1,), jnp.int32), jnp.asarray(feats), pos)
        ours = draft_block(params, cfg, decoder, tparams, cache, jnp.asarray([ctx]), jnp.asarray([root]))[0]
        np.testing.assert_allclose(ours, ref, **TOL, err_msg=name)
        if plain is None:
            base_cfg = drafter.config_from_hf(d0, dtype="float32")
            plain = draft_block(drafter.params_from_hf(base_cfg, getter, jnp.float32), base_cfg, decoder, tparams, cache,
                                jnp.asarray([ctx]), jnp.asarray([root]))[0]
        assert np.abs(np.asarray(ours) - np.asarray(plain)).max() > 1e-3, f"{name} changed nothing"
