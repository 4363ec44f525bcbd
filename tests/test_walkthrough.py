"""The README's walkthroughs, as a newcomer would follow them: adding a target family is one ``Family`` record
(the converter, the API and the decode loop then read its checkpoints), and adding a drafting method is one
``Method`` (its scorer factory; every entry point then runs it by name, losslessly)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from dtree_jax import api, builders, train
from dtree_jax.builders import methods
from dtree_jax.models import decoder, drafter, families
from tests.oracles import StateGetter, tiny_domino, tiny_qwen3

PROMPTS = [[1, 5, 9, 3], [7, 8, 2, 4, 6, 11, 3, 40, 41]]


@pytest.fixture(scope="module")
def pair():
    hf, d = tiny_qwen3(tie=False, seed=3)
    cfg = decoder.config_from_hf(d, dtype="float32")
    target = api.Model("qwen3", cfg, decoder.params_from_hf(cfg, StateGetter(hf), "float32"))
    dom, _, dd = tiny_domino(shift_label=True, seed=4)
    dcfg = drafter.config_from_hf(dd, dtype="float32")
    return d, target, api.Model("drafter", dcfg, drafter.params_from_hf(dcfg, StateGetter(dom), "float32"))


def test_adding_a_target_family(pair, tmp_path, monkeypatch):
    """A family whose checkpoints say ``model_type: "toy"`` and name their tensors ``transformer.*``, served by
    the dense module: one record, and such a checkpoint loads and decodes like the model it holds."""
    monkeypatch.setattr(families, "FAMILIES", dict(families.FAMILIES))  # the registry as it was, after the test
    d, target, draft = pair
    families.register_family(families.Family(
        "toy", "dtree_jax.models.decoder", model_types=("toy",), renamed_prefixes=(("transformer.", "model."),)))
    tensors = {k.replace("model.", "transformer.", 1): v for k, v in train.hf_tensors(decoder, target.cfg,
                                                                                        target.params).items()}
    train.save_hf(tmp_path, dict(d, model_type="toy"), tensors)
    toy = api.load_model(tmp_path)
    assert toy.kind == "toy" and toy.module is decoder and not toy.is_drafter
    for method in ("ar", "dominotree"):
        got = api.generate(toy, PROMPTS, method, draft, budget=6, max_new_tokens=12, stop_ids=())
        want = api.generate(target, PROMPTS, method, draft, budget=6, max_new_tokens=12, stop_ids=())
        assert got.tokens == want.tokens, method
    with pytest.raises(ValueError, match="already registered"):
        families.register_family(families.Family("toy2", "dtree_jax.models.decoder", model_types=("toy",)))


def test_adding_a_drafting_method(pair, monkeypatch):
    """A tree method whose scorer sharpens the drafter's per-depth distributions (so its best-first trees weigh
    depth differently from DDTree's): one ``Method``; it decodes losslessly by name."""
    monkeypatch.setattr(methods, "REGISTRY", dict(methods.REGISTRY))
    _, target, draft = pair

    def sharp_marginal(rnd, head, embed, *, k, M, pure_depths):
        return builders.marginal_scorer(dataclasses.replace(rnd, base=rnd.base * 3.0), k=k)

    builders.register_method(builders.Method("sharptree", sharp_marginal, tree=True))
    ar = api.generate(target, PROMPTS, "ar", max_new_tokens=16, stop_ids=())
    got = api.generate(target, PROMPTS, "sharptree", draft, budget=6, max_new_tokens=16, stop_ids=(),
                       instrument=True)
    assert got.tokens == ar.tokens
    ddtree = api.generate(target, PROMPTS, "ddtree", draft, budget=6, max_new_tokens=16, stop_ids=(),
                          instrument=True)
    first = lambda g: np.asarray(g.round_trees[0]["tokens"])  # noqa: E731  the first round's trees
    assert first(got).shape == first(ddtree).shape
    assert not np.array_equal(first(got), first(ddtree))  # the new scorer is the one that ran
    with pytest.raises(ValueError, match="already"):
        builders.register_method(builders.Method("ddtree", sharp_marginal, tree=True))
    with pytest.raises(ValueError, match="callable"):
        builders.register_method(builders.Method("typo", "marginal", tree=True))
