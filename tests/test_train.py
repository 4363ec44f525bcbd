"""Training of the shipped pair: tokenizer, corpus split, the drafter objective equals inference, a smoke run."""

import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dtree_jax import train
from dtree_jax.api import generate
from dtree_jax.models import decoder, drafter


def test_tokenizer_is_bytes_plus_specials():
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(train.tokenizer_json())
    text = "def f(x):\n    return x  # é\t"
    assert tok.encode(text).ids == [train.BOS] + train.encode(text)
    assert tok.encode("<|mask|><|eos|>").ids == [train.BOS, train.MASK, train.EOS]
    assert tok.decode(train.encode(text)) == text


def test_corpus_split_is_by_file_and_disjoint():
    tr, ho = train.stdlib_files("train"), train.stdlib_files("heldout")
    assert tr and ho and not set(tr) & set(ho)
    assert 0.03 < len(ho) / (len(tr) + len(ho)) < 0.2
    with pytest.raises(ValueError):
        train.stdlib_files("test")


@pytest.fixture(scope="module")
def tiny_pair():
    import experiments.train_tiny as tt

    tdict = dict(tt.TARGET_CONFIG, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=16)
    tcfg = decoder.config_from_hf(tdict, dtype="float32")
    tparams = train.init_params(decoder, tcfg, jax.random.key(0), std=0.3)
    ddict = tt.drafter_config(block_size=4, shift_label=False)
    ddict.update(hidden_size=32, intermediate_size=48, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                 num_target_layers=2)
    ddict["dflash_config"] = dict(ddict["dflash_config"], target_layer_ids=[0, 1], emb_dim=8, gru_hidden_dim=8)
    dcfg = drafter.config_from_hf(ddict, dtype="float32")
    dparams = train.init_params(drafter, dcfg, jax.random.key(1), std=0.3)
    return tcfg, tparams, dcfg, dparams


def test_drafter_objective_is_the_inference_computation(tiny_pair):
    """Training logits for a block anchored at a equal the logits the decode loop computes after committing
    tokens[:a] and drafting from root tokens[a]."""
    tcfg, tparams, dcfg, dparams = tiny_pair
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (1, 24)), jnp.int32)
    anchors = jnp.array([[5, 11]], jnp.int32)
    base, final, labels = train.drafter_logits(dparams, dcfg, decoder, tparams, tcfg, tokens, anchors)
    for j, a in enumerate([5, 11]):
        cache = decoder.init_cache(tcfg, 1, 32)
        pos = jnp.arange(a)[None]
        _, feats, _ = decoder.forward(tparams, tcfg, tokens[:, :a], pos, cache, jnp.zeros(1, jnp.int32),
                                    jnp.tri(a, dtype=bool)[None], tuple(dcfg.target_layer_ids))
        dcache = drafter.init_drafter_cache(dcfg, 1, 32)
        dcache = drafter.append_context(dparams, dcfg, dcache, jnp.zeros(1, jnp.int32), feats, pos)
        ph = drafter.draft_rows(drafter.draft_block(dparams, dcfg, decoder, tparams, dcache, jnp.array([a]), tokens[:, a]), dcfg)
        np.testing.assert_allclose(base[j], decoder.lm_head(tparams, tcfg, ph)[0], atol=2e-4)
        np.testing.assert_array_equal(labels[j], tokens[0, a + 1 : a + 1 + dcfg.num_draft_rows])
    assert not np.allclose(final, base)  # the head contributes


def test_drafter_training_step_reduces_loss(tiny_pair):
    tcfg, tparams, dcfg, dparams = tiny_pair
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 64, (2, 20)), jnp.int32)
    anchors = jnp.array([[3, 9], [4, 12]], jnp.int32)
    batches = iter([(tokens, anchors)] * 12)
    loss = lambda p, b, s: train.drafter_loss(p, dcfg, decoder, tparams, tcfg, b[0], b[1], 0.5)
    _, log = train.fit(dparams, loss, batches, steps=12, lr=1e-2, warmup=1, log_every=1)
    assert log.losses[-1] < log.losses[0]


def test_smoke_run_trains_and_generates(tmp_path, monkeypatch):
    import experiments.train_tiny as tt

    monkeypatch.setattr(sys, "argv", ["train_tiny.py"])
    monkeypatch.setattr(tt.tempfile, "mkdtemp", lambda prefix: str(tmp_path))
    assert tt.main(["--smoke"]) == 0
    assert (tmp_path / "results" / "train_target.json").is_file()
    got = generate(str(tmp_path / "tiny-target"), [[train.BOS, 100, 101]], "dominotree", str(tmp_path / "tiny-domino"),
                   budget=4, max_new_tokens=4)
    assert len(got.tokens[0]) >= 1


def test_shipped_tiny_pair_decodes_with_its_calibration(capsys):
    """The shipped tiny pair from checkpoints/, with --budget auto (its calibration.json and this machine's round
    costs: on a CPU where a tree does not pay at this size it may choose ar) and the ar baseline; at a fixed
    budget the trained drafter gets drafts accepted."""
    import json

    from dtree_jax.cli import SHIPPED_TINY, main, shipped

    target, drafter = (shipped(name) for name in SHIPPED_TINY)
    rows = []
    for budget in ("auto", "4"):
        assert main(["generate", "--target", target, "--drafter", drafter, "--max-new-tokens", "24", "--compare-ar",
                     "--prompt", "import os\n", "--json", "--budget", budget, "--timing-pairs", "1"]) == 0
        rows.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1]))
    auto, fixed = rows
    assert auto["auto"].startswith("budget auto: ") and len(auto["tokens"]) == 24 and auto["text"]
    assert fixed["tokens"] == auto["tokens"] and fixed["speedup_vs_ar"] > 0 and fixed["budget"] == 4
    assert fixed["tau"] > 1.0  # the trained drafter gets drafts accepted
