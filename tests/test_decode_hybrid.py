"""The decode loop on a hybrid Gated-DeltaNet target (Qwen3.5): every method equals ``ar``, long accepted paths
commit the right recurrent state, a tree-unaware verify is caught, and the CLI runs converted checkpoints."""

import collections
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from dtree_jax import api, convert, loop, running
from dtree_jax.api import generate
from dtree_jax.models import qwen3_5
from tests.oracles_hybrid import save_hybrid_pair
from tests.oracles import oracle_draft

PROMPTS = [[1, 5, 9, 3], [7, 8, 2, 4, 6, 11, 3, 40, 41]]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("hybrid")
    hf = save_hybrid_pair(root)
    target = api.load_model(root / "target")
    draft = api.load_model(root / "drafter")
    assert target.kind == "qwen3_5" and draft.kind == "drafter"
    ar = generate(target, PROMPTS, "ar", max_new_tokens=20, stop_ids=()).tokens
    return root, hf, target, draft, ar


def test_ar_equals_transformers(ckpts):
    _, hf, _, _, ar = ckpts
    for prompt, got in zip(PROMPTS, ar):
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False, eos_token_id=None,
                              pad_token_id=0)
        assert got == out[0, len(prompt):].tolist()


@pytest.mark.parametrize("method", ["dflash", "domino", "ddtree", "dominotree"])
def test_every_method_lossless_on_hybrid(ckpts, method):
    _, _, target, draft, ar = ckpts
    assert generate(target, PROMPTS, method, draft, budget=8, max_new_tokens=20, stop_ids=()).tokens == ar


def _oracle_run(ckpts, monkeypatch):
    _, _, target, draft, ar = ckpts
    reference = np.array([t + [0] * 40 for t in ar], np.int32)
    monkeypatch.setattr(loop, "draft", oracle_draft(reference, loop.draft, decoy=True))
    monkeypatch.setattr(running, "COMPILED", collections.OrderedDict())
    jax.clear_caches()
    try:
        return generate(target, PROMPTS, "dominotree", draft, budget=10, max_new_tokens=20, stop_ids=())
    finally:
        jax.clear_caches()


def test_long_accepted_paths_commit_the_recurrent_state(ckpts, monkeypatch):
    got = _oracle_run(ckpts, monkeypatch)
    assert got.tokens == ckpts[4]
    assert min(s["tau"] for s in got.stats) > 2.0


def test_tree_unaware_verify_is_caught(ckpts, monkeypatch):
    """Control: GDN layers that treat the tree as a chain in index order diverge from ar."""
    chain = lambda mask: jnp.broadcast_to(jnp.arange(mask.shape[-1], dtype=jnp.int32) - 1, mask.shape[:-1])
    monkeypatch.setattr(qwen3_5, "parents_from_mask", chain)
    got = _oracle_run(ckpts, monkeypatch)
    assert got.tokens != ckpts[4]


def test_cli_runs_a_converted_hybrid_checkpoint(ckpts, tmp_path, capsys):
    root, _, _, _, ar = ckpts
    convert.convert(root / "target", root / "drafter", out_dir=tmp_path / "conv", dtype="float32", progress=False)
    from dtree_jax.cli import main

    assert main(["generate", "--target", str(tmp_path / "conv" / "target"), "--drafter",
                 str(tmp_path / "conv" / "drafter"), "--method", "dominotree", "--budget", "8",
                 "--prompt-ids", ",".join(map(str, PROMPTS[0])), "--max-new-tokens", "20", "--json"]) == 0
    row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert row["tokens"] == ar[0]
