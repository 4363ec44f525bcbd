"""Self-distillation of a drafter (dtree_jax.distill, experiments/train_smollm2.py) on a tiny random Llama
target: the data shards hold what the target says and exactly the taps the decode loop serves, generation and
training resume where they stopped, the candidate objective equals the full heads at the candidates, and the
exported drafter is lossless under every method."""

from __future__ import annotations

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dtree_jax import distill, train
from dtree_jax.api import METHODS, Model, generate
from dtree_jax.models import decoder, drafter
from tests import oracles

TAPS = (1, 4)  # includes the last layer (post-final-norm)
PROMPT_TOKENS, MAX_NEW, SHARD = 12, 10, 4


@functools.lru_cache(maxsize=None)
def _target():
    model, d = oracles.tiny_dense("llama", tie=True, seed=21)
    cfg = decoder.config_from_hf(d, dtype="float32")
    params = decoder.params_from_hf(cfg, oracles.StateGetter(model), jnp.float32)
    return d, Model("llama", cfg, params, None, (5,))


def _prompts(n=10, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(6, 128, int(rng.integers(3, PROMPT_TOKENS + 1))).tolist() for _ in range(n)]


def _write(tmp, prompts=None, **kw):
    _, target = _target()
    args = dict(
        taps=TAPS,
        max_new_tokens=MAX_NEW,
        prompt_tokens=PROMPT_TOKENS,
        shard_size=SHARD,
        top_k=8,
        progress=False,
    )
    return distill.generate_shards(target, prompts or _prompts(), tmp, **dict(args, **kw))


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("distill")
    _write(d)
    return d


def test_shards_hold_the_targets_responses_and_taps(data_dir):
    _, target = _target()
    prompts = _prompts()
    data = distill.load_shards(data_dir)
    assert len(data) == len(prompts) and data.tokens.shape[1] == PROMPT_TOKENS + MAX_NEW
    ar = generate(target, prompts, "ar", max_new_tokens=MAX_NEW, prompt_bucket=PROMPT_TOKENS)
    b, t = data.tokens.shape
    logits, feats, _ = decoder.forward(
        target.params,
        target.cfg,
        jnp.asarray(data.tokens),
        jnp.tile(jnp.arange(t), (b, 1)),
        decoder.init_cache(target.cfg, b, t),
        jnp.zeros(b, jnp.int32),
        jnp.tile(jnp.tri(t, dtype=bool), (b, 1, 1)),
        TAPS,
    )  # causal: padding is harmless
    logp = np.asarray(jax.nn.log_softmax(logits, -1))
    for i, (p, resp) in enumerate(zip(prompts, ar.tokens)):
        n = len(p) + len(resp)
        assert data.prompt_lens[i] == len(p) and data.lens[i] == n
        assert data.tokens[i, :n].tolist() == p + resp
        np.testing.assert_allclose(data.feats[i, :n].astype(np.float32), feats[i, :n], rtol=1e-2, atol=1e-2)
        top = np.argsort(-logp[i, :n], -1)[:, :8]
        np.testing.assert_array_equal(data.top_ids[i, :n], top)
        np.testing.assert_allclose(
            data.top_logp[i, :n].astype(np.float32), np.take_along_axis(logp[i, :n], top, -1), atol=2e-2
        )
    h = target.cfg.hidden_size  # the last tap is the post-final-norm stream, not the raw residual
    assert not np.allclose(data.feats[0, :5, h:].astype(np.float32), 0)
    stats = distill.data_stats(data_dir)
    assert stats["shards"] == 3 and stats["sequences"] == len(prompts) and stats["generate_seconds"] > 0


def test_generation_resumes_and_refuses_other_settings(tmp_path, monkeypatch):
    import dtree_jax.api as api

    def contents():
        out = {}
        for f in sorted(tmp_path.glob("shard-*.npz")):
            with np.load(f) as z:
                out[f.name] = {k: z[k].tolist() for k in z.files if not k.endswith("_seconds")}
        return out

    _write(tmp_path)
    before = contents()
    (tmp_path / "shard-00001.npz").unlink()
    calls = []
    real = api.generate
    monkeypatch.setattr(api, "generate", lambda *a, **k: calls.append(1) or real(*a, **k))
    _write(tmp_path)
    assert len(calls) == 1  # only the missing shard was generated again
    assert contents() == before
    with pytest.raises(ValueError, match="top_k"):
        _write(tmp_path, top_k=4)
    (tmp_path / "shard-00002.npz").unlink()
    with pytest.raises(ValueError, match="shards missing"):
        distill.load_shards(tmp_path)


def _drafter_dict():
    from experiments.train_smollm2 import drafter_config

    d, _ = _target()
    return drafter_config(d, layers=1, block_size=4, taps=list(TAPS), gru=8, emb=8)


def _drafter(seed=0):
    dcfg = drafter.config_from_hf(_drafter_dict(), dtype="float32")
    return dcfg, train.init_params(drafter, dcfg, jax.random.key(seed), std=0.2)


def test_candidate_logits_are_the_full_heads_at_the_candidates():
    _, target = _target()
    dcfg, dparams = _drafter()
    rng = np.random.default_rng(3)
    k = dcfg.num_draft_rows
    ph = jnp.asarray(rng.normal(size=(5, k, target.cfg.hidden_size)), jnp.float32)
    path = jnp.asarray(rng.integers(0, 128, (5, k)), jnp.int32)
    own = jnp.asarray(rng.integers(0, 128, (5, k, 7)), jnp.int32)
    shared = jnp.asarray(rng.integers(0, 128, 4), jnp.int32)
    base, final = distill.candidate_logits(dparams, dcfg, decoder, target.params, target.cfg, ph, path, own, shared)
    cand = jnp.concatenate([own, jnp.broadcast_to(shared, (5, k, 4))], -1)
    full_final = drafter.path_logits(dparams, dcfg, decoder, target.params, target.cfg, ph, path)
    full_base = decoder.lm_head(target.params, target.cfg, ph)
    np.testing.assert_allclose(final, jnp.take_along_axis(full_final, cand, -1), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(base, jnp.take_along_axis(full_base, cand, -1), rtol=1e-5, atol=1e-5)
    assert not np.allclose(final[:, 1:], base[:, 1:])  # the head corrects rows past the pure prefix
    np.testing.assert_array_equal(final[:, 0], base[:, 0])


def _fit(data, ckpt, dcfg, dparams, steps, stop_at=None, meta=None):
    _, target = _target()

    def loss(p, b, step):
        return distill.distill_loss(
            p, dcfg, decoder, target.params, target.cfg, b, distill.lambda_base(step, steps // 2, steps // 2)
        )

    def batch(step):
        return distill.batch_at(data, step, batch=4, blocks=3, negatives=16, vocab=128, seed=1)

    return distill.fit_resumable(
        dparams,
        loss,
        batch,
        ckpt,
        steps=steps,
        lr=1e-2,
        warmup=2,
        save_every=2,
        log_every=1,
        stop_at=stop_at,
        meta=meta or dict(run="test"),
        progress=False,
    )


def test_training_lowers_the_loss_and_resumes_exactly(data_dir, tmp_path):
    data = distill.load_shards(data_dir)
    dcfg, dparams = _drafter()
    straight, log = _fit(data, tmp_path / "a", dcfg, dparams, 8)
    assert log["steps"] == list(range(8)) and np.mean(log["loss"][-2:]) < log["loss"][0]
    _, first = _fit(data, tmp_path / "b", dcfg, dparams, 8, stop_at=3)
    assert first["steps"] == [0, 1, 2] and first["step"] == 3
    resumed, log_b = _fit(data, tmp_path / "b", dcfg, dparams, 8)
    assert log_b["steps"] == log["steps"]
    np.testing.assert_allclose(log_b["loss"], log["loss"], rtol=1e-6)
    for a, b in zip(jax.tree.leaves(straight), jax.tree.leaves(resumed)):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="other settings"):
        _fit(data, tmp_path / "b", dcfg, dparams, 8, meta=dict(run="other"))


def test_several_directories_train_together(data_dir, tmp_path):
    one = distill.load_shards(data_dir)
    both = distill.load_shards(data_dir, data_dir)
    assert len(both) == 2 * len(one) and both.settings == (one.settings[0],) * 2 and both.taps == list(TAPS)
    for field in ("tokens", "lens", "feats", "top_ids"):
        np.testing.assert_array_equal(getattr(both, field), np.concatenate([getattr(one, field)] * 2))
    assert distill.data_stats(data_dir, data_dir)["sequences"] == 2 * len(one)
    _write(tmp_path, _prompts(4, seed=9), top_k=4)
    with pytest.raises(ValueError, match="differ in top_k"):
        distill.load_shards(data_dir, tmp_path)


def test_batches_are_a_function_of_the_step(data_dir):
    data = distill.load_shards(data_dir)
    kw = dict(batch=4, blocks=3, negatives=16, vocab=128, seed=1)
    a, b, c = (distill.batch_at(data, s, **kw) for s in (1, 1, 2))
    assert all(np.array_equal(a[k], b[k]) for k in a) and not np.array_equal(a["anchors"], c["anchors"])
    idx = [np.flatnonzero((data.tokens == row).all(1))[0] for row in a["tokens"]]
    assert np.all(a["anchors"] >= data.prompt_lens[idx][:, None]) and np.all(
        a["anchors"] <= data.lens[idx][:, None] - 2
    )


def test_cli_trains_resumes_exports_and_the_drafter_is_lossless(data_dir, tmp_path, monkeypatch):
    from experiments import train_smollm2 as ts

    d, target = _target()
    tdir = tmp_path / "target"
    train.save_hf(tdir, d, train.hf_tensors(decoder, target.cfg, target.params))
    (tdir / "generation_config.json").write_text(json.dumps(dict(eos_token_id=5)))
    args = [
        "--target",
        str(tdir),
        "--data",
        str(data_dir),
        "--ckpt",
        str(tmp_path / "ckpt"),
        "--out",
        str(tmp_path / "drafter"),
        "--layers",
        "1",
        "--block-size",
        "4",
        "--gru",
        "8",
        "--emb",
        "8",
        "--backbone-steps",
        "2",
        "--head-steps",
        "2",
        "--batch",
        "4",
        "--blocks",
        "3",
        "--negatives",
        "16",
        "--save-every",
        "2",
        "--warmup",
        "1",
        "--results",
        str(tmp_path / "results"),
        "--loss-decay-gamma",
        "4",
    ]
    for stage in ("data", "text"):  # these stages write one directory
        with pytest.raises(SystemExit):
            ts.main([stage, "--data", str(tmp_path / "x"), str(tmp_path / "y")])
    with pytest.raises(SystemExit):
        ts.main(["train", *args, "--loss-decay-gamma", "0"])
    with pytest.raises(SystemExit):  # before the target loads
        ts.main(["text", "--data", str(tmp_path / "t"), "--passage-tokens", "20", "--context-tokens", "19"])
    with pytest.raises(ValueError, match="holds generated shards"):  # nothing written into it
        ts.main(["text", "--data", str(data_dir)])
    assert not (data_dir / ts.PROMPTS_FILE).exists()
    gammas, real_loss = [], distill.distill_loss
    monkeypatch.setattr(distill, "distill_loss", lambda *a: gammas.append(a[7]) or real_loss(*a))
    ts.main(["train", *args, "--stop-at", "2"])
    assert gammas and set(gammas) == {4.0}  # the flag reaches the objective
    assert not (tmp_path / "drafter").exists()
    with pytest.raises(ValueError, match="--resume"):
        ts.main(["train", *args])
    ts.main(["train", *args, "--resume"])
    log = json.loads((tmp_path / "results" / "train_smollm2_drafter.json").read_text())
    assert log["step"] == 4 and log["steps"][-1] == 3 and log["recipe"]["head_steps"] == 2
    assert log["recipe"]["loss_decay_gamma"] == 4
    assert log["recipe"]["prompts"] == [None]  # data made by distill.generate_shards directly: no prompts.json
    ts.main(["export", *args])  # the export stage alone gives the same files
    import safetensors.numpy

    tensors = safetensors.numpy.load_file(str(tmp_path / "drafter" / "model.safetensors"))
    assert {str(v.dtype) for v in tensors.values()} == {"bfloat16"}
    prompts = _prompts(3, seed=5)
    knobs = dict(max_new_tokens=12, budget=4)
    ref = generate(target, prompts, "ar", max_new_tokens=12)
    for method in METHODS[1:]:
        got = generate(target, prompts, method, str(tmp_path / "drafter"), **knobs)
        assert got.tokens == ref.tokens, method
    # Warm start from the exported drafter: its architecture wins over the flags, and with a vanishing learning
    # rate one step leaves its weights as they were.
    warm = [*args[:4], "--ckpt", str(tmp_path / "ckpt-warm"), "--out", str(tmp_path / "warm"), *args[8:]]
    warm[warm.index("--gru") + 1] = "16"
    warm[warm.index("--negatives") + 1] = "0"
    warm += ["--init", str(tmp_path / "drafter"), "--backbone-steps", "0", "--head-steps", "1", "--lr", "1e-12"]
    # ... trained over a draft vocabulary, which reaches the objective and is exported beside the drafter
    vocab_file = tmp_path / "vocab.json"
    vocab_file.write_text(json.dumps(dict(token_ids=list(range(0, 128, 3)), size=43)))
    with pytest.raises(SystemExit):
        ts.main(["train", *warm, "--draft-vocab", str(vocab_file), "--negatives", "4"])
    (tmp_path / "bad.json").write_text(json.dumps(dict(token_ids=[1, 1, 2])))
    with pytest.raises(ValueError, match="bad.json: not a draft vocabulary.*repeated"):
        ts.main(["train", *warm, "--draft-vocab", str(tmp_path / "bad.json")])
    vocabs = []
    monkeypatch.setattr(distill, "distill_loss", lambda *a: vocabs.append(a[8]) or real_loss(*a))
    ts.main(["train", *warm, "--draft-vocab", str(vocab_file)])
    assert vocabs and all(np.array_equal(v, np.arange(0, 128, 3)) for v in vocabs)
    assert (tmp_path / "warm" / "draft_vocab.json").read_text() == vocab_file.read_text()
    again = safetensors.numpy.load_file(str(tmp_path / "warm" / "model.safetensors"))
    assert again.keys() == tensors.keys()
    for k in tensors:
        np.testing.assert_array_equal(again[k], tensors[k], err_msg=k)
    log = json.loads((tmp_path / "results" / "train_smollm2_drafter.json").read_text())
    assert log["recipe"]["init"]["path"] == str((tmp_path / "drafter").resolve())
    assert log["recipe"]["draft_vocab"]["size"] == 43
    assert set(log["recipe"]["draft_vocab"]) == {"size", "digest"}  # no path: a moved file resumes and exports
    moved = tmp_path / "moved.json"
    moved.write_text(vocab_file.read_text())
    ts.main(["export", *warm, "--draft-vocab", str(moved)])
    assert (tmp_path / "warm" / "draft_vocab.json").read_text() == vocab_file.read_text()
    other = tmp_path / "other.json"
    other.write_text(json.dumps(dict(token_ids=list(range(0, 128, 2)))))
    exported = {f.name: f.read_bytes() for f in (tmp_path / "warm").iterdir()}
    for flags, msg in (([], "pass that --draft-vocab"), (["--draft-vocab", str(other)], "not the vocabulary trained")):
        with pytest.raises(ValueError, match=msg):  # the export stage checks the file it copies
            ts.main(["export", *warm, *flags])
    assert {f.name: f.read_bytes() for f in (tmp_path / "warm").iterdir()} == exported  # before writing anything
    with pytest.raises(ValueError, match="other settings"):  # a resume must keep the vocabulary
        ts.main(["train", *warm, "--resume", "--draft-vocab", str(other)])
    with pytest.raises(ValueError, match="full vocabulary; --draft-vocab does not apply"):
        ts.main(["export", *args, "--negatives", "0", "--draft-vocab", str(moved)])
    (tmp_path / "drafter" / "draft_vocab.json").write_text(moved.read_text())
    ts.main(["export", *args])  # a drafter trained over the full vocabulary: a stale file goes
    assert not (tmp_path / "drafter" / "draft_vocab.json").exists()
    config = json.loads((tmp_path / "drafter" / "config.json").read_text())
    (tmp_path / "drafter" / "config.json").write_text(
        json.dumps(dict(config, dflash_config=dict(config["dflash_config"], target_layer_ids=[0])))
    )
    with pytest.raises(ValueError, match="taps"):
        ts.main(["train", *warm, "--ckpt", str(tmp_path / "ckpt-other")])


def test_prompts_come_from_disjoint_files_and_are_reproducible():
    train_p = distill.stdlib_prompts("train", 40, seed=0)
    held = distill.stdlib_prompts("heldout", 12, seed=1)
    assert held == distill.stdlib_prompts("heldout", 12, seed=1)
    assert not {p.source for p in train_p} & {p.source for p in held}
    assert sum(p.kind == "chat" for p in train_p) == 30 and {p.kind for p in held} == {"chat", "continue"}
    assert sum(p.kind == "chat" for p in distill.stdlib_prompts("train", 40, seed=0, chat_fraction=0.6)) == 24
    with pytest.raises(ValueError, match="at most"):
        distill.stdlib_prompts("heldout", 10**6)


def test_full_vocabulary_objective_is_the_block_objective_on_greedy_data(data_dir):
    """With one-hot target distributions, the full-vocabulary KD on stored features is ``train.drafter_loss``
    (which recomputes the target's features): the same blocks, rows, labels and curriculum mix."""
    _, target = _target()
    data = distill.load_shards(data_dir)
    dcfg, dparams = _drafter(seed=4)
    keep = np.flatnonzero(data.lens - data.prompt_lens > dcfg.num_draft_rows + 1)[:4]
    assert len(keep) >= 2
    anchors = np.stack([data.prompt_lens[keep], data.prompt_lens[keep] + 1], 1).astype(np.int32)
    one_hot = np.where(np.arange(data.top_logp.shape[-1]) == 0, 0.0, -1e4).astype(np.float16)
    b = dict(
        tokens=data.tokens[keep],
        lens=data.lens[keep],
        feats=data.feats[keep],
        top_ids=data.top_ids[keep],
        top_logp=np.broadcast_to(one_hot, data.top_logp[keep].shape),
        anchors=anchors,
        negatives=np.zeros((0,), np.int32),
    )
    kd = jax.jit(lambda b: distill.distill_loss(dparams, dcfg, decoder, target.params, target.cfg, b, 0.25)[0])
    want = jax.jit(lambda t: train.drafter_loss(dparams, dcfg, decoder, target.params, target.cfg, t, anchors, 0.25))
    np.testing.assert_allclose(kd(b), want(b["tokens"]), rtol=1e-2)
    sampled = kd(dict(b, negatives=np.arange(6, 40, dtype=np.int32)))
    assert abs(float(sampled) - float(want(b["tokens"]))) > 1e-3  # the sampled denominator is an estimate


def test_draft_vocabulary_objective_is_the_softmax_over_those_tokens(data_dir):
    """With a draft vocabulary the KD is the cross-entropy from the target's top-K kept inside it (renormalised)
    to the drafter's softmax over it alone, computed here from the full heads; every token as the vocabulary is
    the full-vocabulary objective; a vocabulary without the target's top-1 tokens ranks none of them first."""
    _, target = _target()
    data = distill.load_shards(data_dir)
    dcfg, dparams = _drafter(seed=6)
    keep = np.flatnonzero(data.lens - data.prompt_lens > dcfg.num_draft_rows + 1)[:4]
    anchors = data.prompt_lens[keep][:, None].astype(np.int32)
    b = dict(tokens=data.tokens[keep], lens=data.lens[keep], feats=data.feats[keep], top_ids=data.top_ids[keep],
             top_logp=data.top_logp[keep], anchors=anchors, negatives=np.zeros((0,), np.int32))
    lam = 0.4
    loss = jax.jit(lambda b, vocab: distill.distill_loss(
        dparams, dcfg, decoder, target.params, target.cfg, b, lam, None, vocab))
    full, full_aux = loss(b, None)
    every, every_aux = loss(b, jnp.arange(128, dtype=jnp.int32))
    np.testing.assert_allclose(every, full, rtol=1e-5)
    np.testing.assert_allclose(every_aux["top1"], full_aux["top1"])

    # a random vocabulary, without one valid row's candidates (that row drops out)
    dropped = np.asarray(b["top_ids"])[0, anchors[0, 0] + 1]
    vocab = np.setdiff1d(np.random.default_rng(0).choice(128, 48, replace=False), dropped).astype(np.int32)
    got, aux = loss(b, jnp.asarray(vocab))
    # the reference: the full heads' logits, the softmax over the vocabulary's columns, p kept inside it
    k = dcfg.num_draft_rows
    ph = train.draft_hidden(dparams, dcfg, decoder, target.params, b["feats"], b["tokens"], anchors)
    path = train.block_gather(b["tokens"], anchors, jnp.arange(k))
    top_ids = np.asarray(train.block_gather(b["top_ids"], anchors, jnp.arange(k)))
    p = np.asarray(jax.nn.softmax(train.block_gather(b["top_logp"], anchors, jnp.arange(k)).astype(jnp.float32)))
    label_pos = anchors.reshape(-1)[:, None] + 1 + np.arange(k)
    valid = label_pos < b["lens"][:, None]
    inside = np.isin(top_ids, vocab)
    p = np.where(inside, p, 0.0)
    mass = p.sum(-1)
    valid &= mass > 0
    p = p / np.maximum(mass, 1e-30)[..., None]

    def kd(logits):
        logp = np.asarray(jax.nn.log_softmax(logits[..., vocab], -1))
        col = np.searchsorted(vocab, top_ids).clip(0, len(vocab) - 1)
        ce = -np.sum(np.where(inside, p * np.take_along_axis(logp, col, -1), 0.0), -1)
        return ce[valid].mean()

    base = np.asarray(decoder.lm_head(target.params, target.cfg, ph))
    final = np.asarray(drafter.path_logits(dparams, dcfg, decoder, target.params, target.cfg, ph, path))
    assert valid.sum() >= 2 and not inside.all() and not inside[0, 0].any()
    np.testing.assert_allclose(got, (1 - lam) * kd(final) + lam * kd(base), rtol=1e-4)
    first = np.take_along_axis(final[..., vocab], np.searchsorted(vocab, top_ids).clip(0, len(vocab) - 1), -1)
    ranked_first = (np.where(inside, first, -np.inf).argmax(-1) == 0) & inside[..., 0]
    np.testing.assert_allclose(aux["top1"], ranked_first[valid].mean(), rtol=1e-6)
    assert abs(float(got) - float(full)) > 1e-3  # the control: another softmax, another loss

    without_top1 = np.setdiff1d(np.arange(128), top_ids[..., 0]).astype(np.int32)
    _, aux = loss(b, jnp.asarray(without_top1))
    assert float(aux["top1"]) == 0.0 and float(full_aux["top1"]) > 0.0
    with pytest.raises(ValueError, match="do not combine"):
        loss(dict(b, negatives=np.arange(6, 10, dtype=np.int32)), jnp.asarray(vocab))
    for bad in ([], [3, 2], [4, 4], [-1, 5], [5, 128]):
        with pytest.raises(ValueError, match="ascending distinct token ids"):
            distill.distill_loss(dparams, dcfg, decoder, target.params, target.cfg, b, lam, None,
                                 jnp.asarray(bad, jnp.int32))


def test_loss_decay_weights_the_early_rows(data_dir):
    """``decay_gamma`` -> 0 leaves only row 0 in the mean: the objective equals the unweighted one on the same
    blocks cut (by ``lens``) to their first label; a huge gamma is the unweighted objective; gamma = 1 is
    neither (the control)."""
    _, target = _target()
    data = distill.load_shards(data_dir)
    dcfg, dparams = _drafter(seed=5)
    keep = np.flatnonzero(data.lens - data.prompt_lens > dcfg.num_draft_rows + 1)[:4]
    assert len(keep) >= 2
    anchors = data.prompt_lens[keep][:, None].astype(np.int32)
    b = dict(tokens=data.tokens[keep], lens=data.lens[keep], feats=data.feats[keep], top_ids=data.top_ids[keep],
             top_logp=data.top_logp[keep], anchors=anchors, negatives=np.zeros((0,), np.int32))
    loss = jax.jit(
        lambda b, gamma: distill.distill_loss(dparams, dcfg, decoder, target.params, target.cfg, b, 0.5, gamma)[0],
        static_argnums=1,
    )
    first_row_only = loss(dict(b, lens=anchors[:, 0] + 2), None)
    np.testing.assert_allclose(loss(b, 1e-4), first_row_only, rtol=1e-5)
    np.testing.assert_allclose(loss(b, 1e9), loss(b, None), rtol=1e-5)
    assert abs(float(loss(b, 1.0)) - float(loss(b, None))) > 1e-3
    assert abs(float(loss(b, 1.0)) - float(first_row_only)) > 1e-3
    np.testing.assert_allclose(distill.row_weights(3, 2.0), np.exp([0.0, -0.5, -1.0]), rtol=1e-6)
    with pytest.raises(ValueError, match="decay_gamma"):
        distill.row_weights(3, 0.0)


def test_text_shards_record_the_targets_forward_over_stored_text(tmp_path):
    """``record_text_shards``: nothing generated; each passage (cut to ``length``) with the target's taps and
    top-K at every position, anchors only after the context; a passage too short for one block is dropped;
    the stats count text tokens apart from generated ones; resuming keeps what was written."""
    _, target = _target()
    rng = np.random.default_rng(7)
    passages = [rng.integers(6, 128, n).tolist() for n in (30, 3, 17, 24, 9)]  # 3 < context + 2: dropped
    args = dict(taps=TAPS, length=20, context_tokens=4, shard_size=2, top_k=8, progress=False)
    distill.record_text_shards(target, passages, tmp_path, **args)
    data = distill.load_shards(tmp_path)
    kept = [p[:20] for p in passages if len(p) >= 6]
    assert len(data) == 4 and data.tokens.shape[1] == 20
    assert data.lens.tolist() == [len(p) for p in kept] and data.prompt_lens.tolist() == [4] * 4
    _, feats = train.causal_forward(decoder, target.params, target.cfg, jnp.asarray(data.tokens), TAPS)
    logits, _ = train.causal_forward(decoder, target.params, target.cfg, jnp.asarray(data.tokens))
    for i, p in enumerate(kept):
        assert data.tokens[i, : len(p)].tolist() == p
        np.testing.assert_allclose(data.feats[i, : len(p)].astype(np.float32), feats[i, : len(p)], rtol=1e-2,
                                   atol=1e-2)
        top = np.argsort(-np.asarray(logits[i, : len(p)]), -1)[:, :8]
        np.testing.assert_array_equal(data.top_ids[i, : len(p)], top)
    b = distill.batch_at(data, 0, batch=2, blocks=5, negatives=0, vocab=128, seed=0)
    assert (b["anchors"] >= 4).all() and (b["anchors"] <= (b["lens"] - 2)[:, None]).all()
    stats = distill.data_stats(tmp_path)
    assert stats["text_tokens"] == sum(len(p) - 4 for p in kept) and stats["generated_tokens"] == 0
    before = {f.name: f.stat().st_mtime_ns for f in tmp_path.glob("shard-*.npz")}
    (tmp_path / "shard-00001.npz").unlink()
    distill.record_text_shards(target, passages, tmp_path, **args)
    after = {f.name: f.stat().st_mtime_ns for f in tmp_path.glob("shard-*.npz")}
    assert after.keys() == before.keys() and after["shard-00000.npz"] == before["shard-00000.npz"]
    with pytest.raises(ValueError, match="other settings"):
        distill.record_text_shards(target, passages, tmp_path, **dict(args, context_tokens=5))
    with pytest.raises(ValueError, match="context_tokens"):
        distill.record_text_shards(target, passages, tmp_path / "x", **dict(args, context_tokens=19))


def test_label_counts_are_the_targets_greedy_tokens(data_dir):
    """``label_counts`` (what a draft vocabulary is ranked by): on greedy data the target's top-1 after the prompt
    is the next token of its response, so the counts are the responses' tokens, and no prompt token is counted."""
    _, target = _target()
    data = distill.load_shards(data_dir)
    counts = distill.label_counts(target.cfg.vocab_size, data_dir)
    responses = np.concatenate([t[p:n] for t, p, n in zip(data.tokens, data.prompt_lens, data.lens)])
    np.testing.assert_array_equal(counts, np.bincount(responses, minlength=target.cfg.vocab_size))
    assert counts.sum() == distill.data_stats(data_dir)["generated_tokens"]


def test_passages_come_from_train_files_and_are_reproducible():
    train_files = {str(f) for f in train.stdlib_files("train")}
    got = distill.stdlib_passages("train", 6, seed=3)
    assert got == distill.stdlib_passages("train", 6, seed=3) != distill.stdlib_passages("train", 6, seed=4)
    root = train.stdlib_root()
    assert all(p.kind == "text" and str(root / p.source) in train_files and p.text for p in got)
    for p in got:  # whole lines, in order, of one file
        lines = (root / p.source).read_text(encoding="utf-8", errors="replace").splitlines()
        part = p.text.splitlines()
        assert 1 <= len(part) <= 120 and any(lines[i : i + len(part)] == part for i in range(len(lines)))
