"""The MoE targets end to end (issue 27): Qwen3-MoE (``decoder``) and Qwen3.5-MoE (``qwen3_5``, the hybrid
stack with a shared expert) read from ``save_pretrained`` checkpoints, decode like transformers' ``generate``,
every method equals ``ar`` at temperature 0 and samples the target's distribution above it.  Controls: a
routing bug (experts in another order, or top-k not renormalised) breaks parity with transformers; the
chi-square test rejects a slightly different distribution.  Checkpoints storing the experts fused (as
transformers 5 holds them in memory) read to the same params.  The per-layer parity of prefill, decode and tree
verify runs in ``tests/test_qwen3.py`` (case ``qwen3-moe``) and ``tests/test_qwen3_5.py`` (``qwen3_5_moe``)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from dtree_jax import api, convert
from tests import oracles, oracles_hybrid
from tests.test_decode import _chi2_pvalue

PROMPTS = [[1, 5, 9, 3], [7, 8, 2, 4, 6, 11, 3, 40, 41]]
KINDS = ("qwen3_moe", "qwen3_5_moe")
METHODS = ("dflash", "domino", "ddtree", "dominotree")
TOL = 2e-4  # the parity tests' tolerance (fp32)


def tiny_hf(kind: str):
    if kind == "qwen3_moe":
        return oracles.tiny_dense("qwen3_moe", tie=False, seed=5)[0]
    return oracles_hybrid.tiny_hybrid(kind, seed=5)[0]


@pytest.fixture(scope="module", params=KINDS)
def pair(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    hf = oracles.save_pair(root, tiny_hf(request.param))
    target, draft = api.load_model(root / "target"), api.load_model(root / "drafter")
    assert any(target.cfg.moe_layers) and target.cfg.num_experts == (8 if request.param == "qwen3_moe" else 6)
    ar = api.generate(target, PROMPTS, "ar", max_new_tokens=16, stop_ids=()).tokens
    return request.param, root, hf, target, draft, ar


def test_ar_equals_transformers_generate(pair):
    _, _, hf, _, _, ar = pair
    for prompt, got in zip(PROMPTS, ar):
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, eos_token_id=None,
                              pad_token_id=0)
        assert got == out[0, len(prompt):].tolist()


@pytest.mark.parametrize("method", METHODS)
def test_every_method_equals_ar(pair, method):
    _, _, _, target, draft, ar = pair
    assert api.generate(target, PROMPTS, method, draft, budget=8, max_new_tokens=16, stop_ids=()).tokens == ar


def _last_logits(target: api.Model, ids: np.ndarray) -> np.ndarray:  # [B, T] -> [B, V] fp64
    """The target's logits after each whole row of ``ids``, by its own prefill (no tree, no cache reuse)."""
    b, t = ids.shape
    cache = target.module.init_cache(target.cfg, b, t)
    logits, _, _ = target.module.prefill(target.params, target.cfg, jnp.asarray(ids), cache,
                                         jnp.full((b,), t, jnp.int32))
    return np.asarray(logits[:, -1], np.float64)


def _softmax(x: np.ndarray, temperature: float) -> np.ndarray:
    x = x / temperature
    p = np.exp(x - x.max(-1, keepdims=True))
    return p / p.sum(-1, keepdims=True)


def test_sampling_keeps_the_targets_distribution(pair):
    """The second generated token of 2000 samples at T = 1 against its exact law (sum over the first)."""
    _, _, _, target, draft, _ = pair
    prompt, v, n = [1, 5, 9, 3], target.cfg.vocab_size, 2000
    got = api.generate(target, [prompt] * n, "dominotree", draft, budget=6, max_new_tokens=2, temperature=1.0,
                       seed=7, stop_ids=())
    counts = np.bincount([t[1] for t in got.tokens], minlength=v)
    first = _last_logits(target, np.asarray([prompt]))[0]
    second = _last_logits(target, np.asarray([prompt + [t] for t in range(v)]))
    law = lambda temp: _softmax(first, temp) @ _softmax(second, temp)  # noqa: E731
    assert _chi2_pvalue(counts, law(1.0)) > 1e-3
    assert _chi2_pvalue(counts, law(0.6)) < 1e-4  # control: another temperature's law is rejected


def _max_logit_error(target: api.Model, hf, params=None, cfg=None) -> float:
    ids = np.asarray([PROMPTS[1]])
    model = dataclasses.replace(target, params=params or target.params, cfg=cfg or target.cfg)
    ours = _last_logits(model, ids)[0]
    ref, _ = oracles.hf_hidden_and_logits(hf, PROMPTS[1])
    return float(np.max(np.abs(ours - ref[-1])))


def test_a_routing_bug_breaks_parity(pair):
    """Controls for the parity tests: the same weights with experts 0 and 1 swapped, or with the top-k weights
    (not) renormalised against the config (``norm_topk_prob`` flipped), give logits well outside the parity
    tolerance."""
    _, _, hf, target, _, _ = pair
    assert _max_logit_error(target, hf) < TOL
    swap = lambda w: w.at[jnp.array([0, 1])].set(w[jnp.array([1, 0])])  # noqa: E731

    def swapped(layer):
        mlp = getattr(layer, "moe", getattr(layer, "mlp", None))
        if mlp is None or not hasattr(mlp, "router"):
            return layer
        mlp = dataclasses.replace(mlp, w_gate=swap(mlp.w_gate), w_up=swap(mlp.w_up), w_down=swap(mlp.w_down))
        return dataclasses.replace(layer, **{"moe" if hasattr(layer, "moe") else "mlp": mlp})

    params = dataclasses.replace(target.params, layers=tuple(swapped(x) for x in target.params.layers))
    assert _max_logit_error(target, hf, params=params) > 4 * TOL
    flipped = dataclasses.replace(target.cfg, norm_topk_prob=not target.cfg.norm_topk_prob)
    assert _max_logit_error(target, hf, cfg=flipped) > 4 * TOL


def test_fused_expert_checkpoints_read_like_per_expert_ones(pair, tmp_path):
    """A checkpoint holding ``mlp.experts.gate_up_proj [E, 2I, H]`` / ``down_proj [E, H, I]`` (transformers 5's
    in-memory layout) gives the params of the per-expert checkpoint, each expert read as its own slice."""
    from safetensors.numpy import save_file

    _, root, hf, target, _, _ = pair
    state = {k: v.detach().float().numpy() for k, v in hf.state_dict().items()}
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in state)
    (tmp_path / "config.json").write_text((root / "target" / "config.json").read_text())
    save_file(state, str(tmp_path / "model.safetensors"))
    _, _, params = convert.load_hf(tmp_path, "float32", progress=False)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(target.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    bad = dict(state)
    key = next(k for k in bad if k.endswith("mlp.experts.down_proj"))
    bad[key] = bad[key][0]  # a fused tensor without its expert axis
    save_file(bad, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="fused experts .* have shape"):
        convert.load_hf(tmp_path, "float32", progress=False)


@pytest.mark.parametrize("shared", [False, True])
def test_the_three_groupings_compute_the_same(shared):
    """``moe_mlp``'s ragged / gather / dense runs of the routed experts agree (random layer, 1 to 9 tokens,
    with and without a shared expert); an unknown grouping is refused."""
    from dtree_jax.models import moe
    from dtree_jax.models.layers import DenseMLP

    ks = jax.random.split(jax.random.key(3), 8)
    h, e, i = 16, 6, 8
    p = moe.MoEParams(
        router=jax.random.normal(ks[0], (h, e)), w_gate=jax.random.normal(ks[1], (e, h, i)) * 0.3,
        w_up=jax.random.normal(ks[2], (e, h, i)) * 0.3, w_down=jax.random.normal(ks[3], (e, i, h)) * 0.3,
        shared=DenseMLP(*(jax.random.normal(k, s) * 0.3 for k, s in zip(ks[4:7], ((h, 5), (h, 5), (5, h)))))
        if shared else None,
        shared_gate=jax.random.normal(ks[7], (h, 1)) if shared else None)
    for tokens in (1, 4, 9):
        x = jax.random.normal(jax.random.fold_in(ks[0], tokens), (1, tokens, h))
        outs = [moe.moe_mlp(p, x, top_k=2, norm_topk_prob=True, grouping=g) for g in moe.GROUPINGS]
        for out in outs[1:]:
            np.testing.assert_allclose(out, outs[0], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="grouping"):
        moe.moe_mlp(p, x, top_k=2, norm_topk_prob=True, grouping="sorted")
