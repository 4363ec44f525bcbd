"""What is drafted, round by round, against the reference packages (greedy, fp32, CPU).

Equal final tokens prove losslessness whatever the drafter proposes; these tests compare every full round's
draft with the ``dflash`` package's ``dflash_generate`` (plain DFlash) and specforge's ``spec_generate``
(the Domino chain at full vocabulary), on random pairs whose feature taps include the target's last layer
(dense Qwen3 and hybrid Qwen3.5 targets), for every drafter config field the ``dflash`` package reads, and
on the shipped pair.  Our rounds come from ``generate(..., instrument=True).round_trees``.
"""

from __future__ import annotations

import copy
import functools
import json
import pathlib

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from dtree_jax import api
from dtree_jax.models import decoder, drafter, qwen3_5
from tests import oracles, oracles_hybrid

PROMPT = [int(t) for t in np.random.default_rng(0).integers(0, 120, 11)]
NEW_TOKENS = 20
SHIPPED = pathlib.Path(__file__).resolve().parent.parent / "checkpoints"


@functools.lru_cache(maxsize=None)
def _dense():
    model, d = oracles.tiny_qwen3(tie=False, seed=7)  # 5 layers
    cfg = decoder.config_from_hf(d, dtype="float32")
    return model, ("qwen3", cfg, decoder.params_from_hf(cfg, oracles.StateGetter(model), jnp.float32))


@functools.lru_cache(maxsize=None)
def _hybrid():
    model, d = oracles_hybrid.tiny_hybrid("qwen3_5", seed=5)  # 4 layers
    cfg = qwen3_5.config_from_hf(d, dtype="float32")
    state = oracles_hybrid.checkpoint_state(model)
    return model, ("qwen3_5", cfg, qwen3_5.params_from_hf(cfg, state.__getitem__, jnp.float32))


TAPS = {"dense": [0, 2, 4], "hybrid": [1, 3]}  # each includes the target's last layer


def _drafter_dict(target: str, head: bool, shift_label: bool = False, **fields) -> dict:
    d = oracles.tiny_drafter_config_dict(shift_label, head=head)
    d["dflash_config"]["target_layer_ids"] = TAPS[target]
    d["num_target_layers"] = TAPS[target][-1] + 1
    d.update(fields)
    return d


def _torch_drafters(d: dict, seed: int = 3):
    """specforge ``DominoDraftModel`` (when ``d`` has a head) and the ``dflash`` package's
    ``DFlashDraftModel`` sharing one backbone, built from the config dict ``d``."""
    from dflash.model import DFlashDraftModel
    from specforge.modeling.draft.domino import DominoDraftModel
    from transformers import Qwen3Config

    cfg = Qwen3Config(**copy.deepcopy(d))
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    domino = None
    if "projector_type" in d["dflash_config"]:
        domino = DominoDraftModel(cfg).eval()
        oracles.randomize_norms(domino, seed + 1)
        state = domino.state_dict()
    else:
        plain = DFlashDraftModel(cfg).eval()
        oracles.randomize_norms(plain, seed + 1)
        state = plain.state_dict()
    plain = DFlashDraftModel(cfg).eval()
    plain.load_state_dict(state, strict=False)
    return domino, plain, state


def _ours(target, d: dict, state: dict, method: str, prompt=PROMPT, new_tokens=NEW_TOKENS):
    """Our rounds ``{lens: [root, drafts...]}`` and output for ``method`` with the drafter ``(d, state)``."""
    cfg = drafter.config_from_hf(d, dtype="float32")
    params = drafter.params_from_hf(cfg, lambda k: state[k].detach().float().numpy(), jnp.float32)
    g = api.generate(target, [prompt], method, ("drafter", cfg, params), max_new_tokens=new_tokens,
                        stop_ids=(), instrument=True)
    return {r["lens"][0]: r["tokens"][0] for r in g.round_trees if r["active"][0]}, g.tokens[0]


def _assert_rounds_equal(ours: dict, ref: dict, *, prefix: bool = False, end: int = len(PROMPT) + NEW_TOKENS):
    """Every reference round that starts before ``end - 1`` (our loop stops once ``end`` tokens exist) has
    our round at the same start with the same draft (``prefix``: our draft starts with the reference's, for
    ``shift_label``, where we draft one slot more, as Domino-Tree does)."""
    ref = {s: r for s, r in ref.items() if s < end - 1}
    assert len(ref) >= 5, "too few full rounds to compare"
    bad = {s: (ours.get(s), r) for s, r in ref.items() if (ours.get(s) or [])[: len(r) if prefix else None] != r}
    assert not bad, f"{len(bad)} of {len(ref)} rounds differ (start: (ours, reference)): {dict(list(bad.items())[:3])}"


def test_dflash_rounds_match_the_dflash_package():
    tmodel, tgt = _dense()
    d = _drafter_dict("dense", head=False)
    _, plain, state = _torch_drafters(d)
    ids, ref = oracles.dflash_draft_rounds(plain, tmodel, PROMPT, NEW_TOKENS)
    ours, out = _ours(tgt, d, state, "dflash")
    _assert_rounds_equal(ours, ref)
    assert out == ids[len(PROMPT) : len(PROMPT) + len(out)]


@pytest.mark.parametrize("shift_label", [False, True])
def test_domino_chain_rounds_match_specforge(shift_label):
    """The chain corrects over the full vocabulary by default, as specforge's does."""
    tmodel, tgt = _dense()
    d = _drafter_dict("dense", head=True, shift_label=shift_label)
    domino, _, state = _torch_drafters(d)
    ids, ref = oracles.specforge_draft_rounds(domino, tmodel, PROMPT, NEW_TOKENS)
    ours, out = _ours(tgt, d, state, "domino")
    _assert_rounds_equal(ours, ref, prefix=shift_label)
    assert out == ids[len(PROMPT) : len(PROMPT) + len(out)]


@pytest.mark.parametrize("method", ["dflash", "domino"])
def test_hybrid_target_rounds_match_the_references_from_context(method):
    """On a hybrid target the reference loops are not lossless (transformers cannot roll a GDN cache back
    after a partial acceptance), so every round is redrafted by the reference drafter from the target's
    hidden states of the greedy prefix, without caches."""
    tmodel, tgt = _hybrid()
    d = _drafter_dict("hybrid", head=method == "domino")
    domino, plain, state = _torch_drafters(d)
    ours, out = _ours(tgt, d, state, method)
    with torch.no_grad():
        seq = tmodel.generate(torch.tensor([PROMPT]), max_new_tokens=NEW_TOKENS, do_sample=False,
                              eos_token_id=None, pad_token_id=0)[0].tolist()
    assert out == seq[len(PROMPT) :]
    ref = oracles.context_drafts(plain, tmodel, seq, sorted(s for s in ours if s < len(seq)), domino)
    _assert_rounds_equal(ours, ref)


SLIDING = dict(use_sliding_window=True, sliding_window=5, layer_types=["sliding_attention", "full_attention"])
CONFIG_FIELDS = {  # each changes what the dflash package drafts (checked below against the plain config)
    "input_embedding_scale": lambda d: d["dflash_config"].update(input_embedding_scale=1.7),
    "is_causal": lambda d: d.update(is_causal=True),
    "sliding_window": lambda d: d.update(SLIDING),  # sliding layers are causal unless is_causal says not
    "sliding_window_noncausal": lambda d: d.update(SLIDING, is_causal=False),
}


@functools.lru_cache(maxsize=None)
def _plain_reference_rounds():
    tmodel, _ = _dense()
    d = _drafter_dict("dense", head=False)
    _, plain, state = _torch_drafters(d)
    return oracles.dflash_draft_rounds(plain, tmodel, PROMPT, NEW_TOKENS)[1], state


@pytest.mark.parametrize("field", sorted(CONFIG_FIELDS))
def test_drafter_config_field_matches_the_dflash_package(field):
    """The prompt (11) plus the generation (20) is longer than the sliding window (5)."""
    tmodel, tgt = _dense()
    d = _drafter_dict("dense", head=False)
    CONFIG_FIELDS[field](d)
    plain_ref, state = _plain_reference_rounds()
    _, reference, _ = _torch_drafters(d)
    reference.load_state_dict(state)
    _, ref = oracles.dflash_draft_rounds(reference, tmodel, PROMPT, NEW_TOKENS)
    assert sum(ref.get(s) != r for s, r in plain_ref.items()) >= 3, "the field hardly changes the reference"
    ours, _ = _ours(tgt, d, state, "dflash")
    _assert_rounds_equal(ours, ref)


def test_output_multiplier_and_softcap_match_the_dflash_package():
    """They leave greedy chains alone (monotone) but change the scores the tree builders rank by."""
    from dtree_jax import builders

    tmodel, (_, tcfg, tparams) = _dense()
    d = _drafter_dict("dense", head=False)
    d["dflash_config"].update(output_multiplier=0.5, final_logit_softcapping=2.0)
    _, reference, state = _torch_drafters(d)
    cfg = drafter.config_from_hf(d, dtype="float32")
    params = drafter.params_from_hf(cfg, lambda k: state[k].detach().float().numpy(), jnp.float32)
    ph = np.random.default_rng(4).standard_normal((2, cfg.num_draft_rows, tcfg.hidden_size)).astype(np.float32)
    ours = drafter.path_logits(params, cfg, decoder, tparams, tcfg, jnp.asarray(ph), jnp.zeros(ph.shape[:2], jnp.int32))
    with torch.no_grad():
        ref = reference.compute_logits(torch.from_numpy(ph), tmodel.lm_head).numpy()
    np.testing.assert_allclose(ours, ref, rtol=2e-5, atol=2e-5)
    plain = np.asarray(decoder.lm_head(tparams, tcfg, jnp.asarray(ph)))
    trees = [
        builders.build_tree("ddtree", builders.DraftRound(ph=jnp.asarray(ph), base=jnp.asarray(base), root_state=None,
                                                    root=jnp.zeros((2,), jnp.int32)), budget=30, node_topk=8,
                         mask_token_id=cfg.mask_token_id)
        for base in (ours, plain)
    ]
    assert not np.array_equal(trees[0].tokens, trees[1].tokens)


def _shipped_pair():
    from dflash.model import DFlashDraftModel
    from safetensors.torch import load_file
    from specforge.modeling.draft.domino import DominoDraftModel
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tmodel = Qwen3ForCausalLM.from_pretrained(SHIPPED / "tiny-target", dtype=torch.float32).eval()
    d = json.loads((SHIPPED / "tiny-domino" / "config.json").read_text())
    cfg = Qwen3Config(**d)
    cfg._attn_implementation = "eager"
    state = load_file(SHIPPED / "tiny-domino" / "model.safetensors")
    domino, plain = DominoDraftModel(cfg).eval(), DFlashDraftModel(cfg).eval()
    domino.load_state_dict({k: v.float() for k, v in state.items()})
    plain.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
    tcfg = decoder.config_from_hf(json.loads((SHIPPED / "tiny-target" / "config.json").read_text()), dtype="float32")
    target = api.Model("qwen3", tcfg, decoder.params_from_hf(tcfg, lambda k: tmodel.state_dict()[k].numpy(),
                                                                jnp.float32))
    return tmodel, target, d, state, domino, plain


def test_shipped_pair_rounds_match_both_references():
    """The issue's prompt; the shipped drafter taps the target's last layer (3 of 4)."""
    prompt = [160, 175, 229, 148, 198, 213, 57, 14, 76, 72, 223, 233, 1, 127, 210, 33, 204, 30, 119]
    tmodel, target, d, state, domino, plain = _shipped_pair()
    assert max(d["dflash_config"]["target_layer_ids"]) == tmodel.config.num_hidden_layers - 1
    _, ref = oracles.dflash_draft_rounds(plain, tmodel, prompt, 48)
    ours, _ = _ours(target, d, state, "dflash", prompt, 48)
    _assert_rounds_equal(ours, ref, end=len(prompt) + 48)
    _, ref = oracles.specforge_draft_rounds(domino, tmodel, prompt, 48)
    ours, _ = _ours(target, d, state, "domino", prompt, 48)
    _assert_rounds_equal(ours, ref, end=len(prompt) + 48)
