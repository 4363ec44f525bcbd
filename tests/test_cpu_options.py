"""CPU generations with the weights baked in (``dtree_jax.cpu_options``): the same tokens and rounds as the
program that takes its weights as arguments, the drafter's own copy of the target's head, a program per params
object (never a stale one for new weights), nothing written to JAX's persistent compilation cache, and no baking
where it does not apply."""

import collections
import dataclasses
import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dtree_jax import api, cpu_options, loop, running
from dtree_jax.api import generate
from dtree_jax.models import drafter
from tests.test_decode import PROMPTS, models  # noqa: F401, F811  (the module's tiny target and Domino drafter)


def _unbaked(monkeypatch):
    monkeypatch.setattr(cpu_options, "bakes_weights", lambda *a: False)
    monkeypatch.setattr(running, "COMPILED", collections.OrderedDict())


@pytest.mark.parametrize("method", ["ar", "dominotree"])
def test_baked_program_gives_the_argument_programs_tokens(models, method, monkeypatch):
    _, target, draft = models
    assert cpu_options.bakes_weights(None, target.params, draft.params)
    monkeypatch.setattr(running, "COMPILED", collections.OrderedDict())
    baked = generate(target, PROMPTS, method, draft, budget=6, max_new_tokens=16, stop_ids=())
    (key,) = running.COMPILED
    assert key[1]  # compiled with the params' identity in its key: the weights are baked in
    _unbaked(monkeypatch)
    plain = generate(target, PROMPTS, method, draft, budget=6, max_new_tokens=16, stop_ids=())
    (key,) = running.COMPILED
    assert not key[1]
    assert baked.tokens == plain.tokens
    assert [s["rounds"] for s in baked.stats] == [s["rounds"] for s in plain.stats]  # the same drafts accepted


def test_the_drafter_gets_its_own_copy_of_the_targets_head(models):
    """``loop.unshared_heads``: the drafter's copy of the head gives the target head's logits on the draft rows,
    and a baked round holds it as a constant of its own shape (XLA:CPU merges identical constants and packs a
    weight for a dot only where no other dot shares it); baked without it, no such constant (control)."""
    _, target, draft = models
    knobs = dict(budget=6, node_topk=4, corr_topm=None, max_depth=None, max_new_tokens=8, prompt_bucket=16,
                 stop_ids=(), top_k=0, top_p=1.0)
    spec = api.make_spec(target, draft, "dominotree", **knobs)
    tparams, own = loop.unshared_heads(spec, target.params, draft.params)
    assert tparams is target.params and draft.params.lm_head is None
    h, v = target.cfg.hidden_size, target.cfg.vocab_size
    assert own.lm_head.shape == (h, v + drafter.OWN_HEAD_PAD)
    ph = jax.random.normal(jax.random.key(0), (2, 3, h))
    np.testing.assert_allclose(drafter.head_logits(own, spec.drafter_cfg, spec.target, tparams, spec.target_cfg, ph),
                               spec.target.lm_head(tparams, spec.target_cfg, ph), rtol=1e-5, atol=1e-5)
    prompt = PROMPTS[1]
    inputs = (jnp.asarray([prompt], jnp.int32), jnp.asarray([len(prompt)], jnp.int32), api.request_keys(0, 1))
    state = loop.prefill_on_device(spec, tparams, draft.params, *inputs, jnp.float32(0))
    own_shape = f"f32[{h},{v + drafter.OWN_HEAD_PAD}]"

    def own_head_constants(dparams) -> int:
        fn = functools.partial(loop.decode_round, spec)
        program = cpu_options.compile_baked(fn, (tparams, dparams), jnp.float32(0), state)
        return sum(own_shape in line and "constant(" in line for line in program.as_text().splitlines())

    assert own_head_constants(own) == 1
    assert own_head_constants(draft.params) == 0
    assert loop.unshared_heads(api.make_spec(target, None, "ar", **knobs), tparams, None) == (tparams, None)


def test_a_draft_vocabulary_changes_the_drafts_never_the_output(tmp_path, monkeypatch):
    """``draft_vocab``: the drafter's own head holds only the listed columns (the target head's logits there; the
    drafts' logits span only those tokens).  Drafting from the tokens ar emits still gets drafts accepted;
    drafting from none of them (control) gets none accepted (a round per token); the tokens are ar's every time.
    "auto" reads the drafter's draft_vocab.json; bad ids, and ids where the weights are not baked in, are one
    ValueError."""
    from dtree_jax.cli import SHIPPED_TINY, shipped

    target, draft = (api.load_model(shipped(n)) for n in SHIPPED_TINY)  # the trained byte-level pair
    v, h = target.cfg.vocab_size, target.cfg.hidden_size
    prompts = [list(b"def add(a, b):\n    return"), list(b"The quick brown fox")]
    kw = dict(budget=6, max_new_tokens=16, stop_ids=())
    ar = generate(target, prompts, "ar", **kw)
    emitted = sorted({t for ts in ar.tokens for t in ts} | {p[-1] for p in prompts})
    full = generate(target, prompts, "dominotree", draft, draft_vocab=None, **kw)
    assert full.tokens == ar.tokens and sum(s["rounds"] for s in full.stats) < sum(s["generated"] - 1 for s in full.stats)
    knobs = dict(budget=6, node_topk=4, corr_topm=None, max_depth=None, max_new_tokens=8, prompt_bucket=16,
                 stop_ids=(), top_k=0, top_p=1.0)
    vocab = api.draft_vocabulary(target, draft, emitted)
    spec = api.make_spec(target, draft, "dominotree", draft_vocab=vocab, **knobs)
    _, own = loop.unshared_heads(spec, target.params, draft.params)
    assert own.lm_head.shape == (h, len(emitted)) and own.vocab_ids.tolist() == emitted
    ph = jax.random.normal(jax.random.key(0), (2, 3, h))
    got = drafter.head_logits(own, spec.drafter_cfg, spec.target, target.params, spec.target_cfg, ph)
    want = spec.target.lm_head(target.params, spec.target_cfg, ph)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want)[..., emitted], rtol=1e-5, atol=1e-5)
    same = generate(target, prompts, "dominotree", draft, draft_vocab=emitted, **kw)
    assert same.tokens == ar.tokens and sum(s["rounds"] for s in same.stats) < sum(s["generated"] - 1 for s in same.stats)
    others = [t for t in range(v) if t not in emitted]
    none = generate(target, prompts, "dominotree", draft, draft_vocab=others, **kw)
    assert none.tokens == ar.tokens and all(s["rounds"] == s["generated"] - 1 for s in none.stats)
    (tmp_path / "draft_vocab.json").write_text(json.dumps(dict(token_ids=others)))
    assert api.draft_vocabulary(target, dataclasses.replace(draft, path=str(tmp_path)), "auto").ids == tuple(others)
    assert api.draft_vocabulary(target, draft, "auto") is None  # no file beside it: every token
    for bad, message in (([], "non-empty"), ([0, 0], "repeated"), ([v], rf"\[0, {v}\)"), ("some", "'auto', None")):
        with pytest.raises(ValueError, match=message):
            generate(target, prompts, "dominotree", draft, draft_vocab=bad, **kw)
    monkeypatch.setattr(cpu_options, "bakes_weights", lambda *a: False)
    with pytest.raises(ValueError, match="baked in"):
        api.draft_vocabulary(target, draft, emitted)
    assert api.draft_vocabulary(target, dataclasses.replace(draft, path=str(tmp_path)), "auto") is None


def test_new_weights_of_the_same_shapes_get_their_own_program(models, monkeypatch):
    """A baked program answers for its own weights only: the same shapes with other weights compile again and
    give those weights' tokens (a cache keyed on shapes alone would replay the first model's)."""
    _, target, _ = models
    monkeypatch.setattr(running, "COMPILED", collections.OrderedDict())
    first = generate(target, PROMPTS, "ar", max_new_tokens=12, stop_ids=())
    other = dataclasses.replace(target, params=jax.tree.map(lambda x: x[::-1] if x.ndim == 2 else x, target.params))
    second = generate(other, PROMPTS, "ar", max_new_tokens=12, stop_ids=())
    assert len(running.COMPILED) == 2 and second.tokens != first.tokens
    _unbaked(monkeypatch)
    assert generate(other, PROMPTS, "ar", max_new_tokens=12, stop_ids=()).tokens == second.tokens


def test_compiled_programs_are_bounded(models, monkeypatch):
    """The process keeps the ``MAX_COMPILED`` most recently used generations: an older one is freed (its code
    and baked weights) and compiles again when asked for; the recently used one is still reused."""
    _, target, _ = models
    monkeypatch.setattr(running, "COMPILED", collections.OrderedDict())
    monkeypatch.setattr(running, "MAX_COMPILED", 2)
    run = lambda n: generate(target, PROMPTS, "ar", max_new_tokens=n, stop_ids=())  # noqa: E731
    before = api.compilations()
    run(4), run(5), run(4)  # 4 is now the most recently used
    assert api.compilations() == before + 2 and len(running.COMPILED) == 2
    run(6)  # evicts 5
    assert len(running.COMPILED) == 2 and api.compilations() == before + 3
    assert run(4).compile_seconds == 0.0
    assert run(5).compile_seconds > 0.0 and api.compilations() == before + 4


def test_baked_weights_held_are_bounded_by_the_hosts_memory(models, monkeypatch):
    """Past ``MAX_BAKED_FRACTION`` of the host's memory in baked weights the oldest baked program is freed, even
    under ``MAX_COMPILED``; the newest always stays.  Control: with room for both, both stay."""
    _, target, _ = models
    weights = sum(x.nbytes for x in jax.tree.leaves(target.params))
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    run = lambda n: generate(target, PROMPTS, "ar", max_new_tokens=n, stop_ids=())  # noqa: E731
    for room, kept in ((2.5, 2), (1.5, 1)):
        monkeypatch.setattr(running, "COMPILED", collections.OrderedDict())
        monkeypatch.setattr(running, "MAX_BAKED_FRACTION", room * weights / memory)  # room for 2.5 / 1.5 programs
        run(4), run(5)
        assert len(running.COMPILED) == kept and all(e[3] == weights for e in running.COMPILED.values())
        assert run(5).compile_seconds == 0.0  # the newest is the one kept


def test_baked_programs_stay_out_of_the_persistent_cache(tmp_path):
    """Control first: a plain program is written to the cache; a baked one is not; the cache works after."""
    before = (jax.config.jax_compilation_cache_dir, jax.config.jax_persistent_cache_min_compile_time_secs)
    jax.config.update("jax_compilation_cache_dir", str(tmp_path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    try:
        w = jnp.asarray(np.random.default_rng(0).standard_normal((64, 96), np.float32))
        x = jnp.ones((5, 64))
        jax.jit(lambda w, x: jnp.tanh(x @ w) * 3).lower(w, x).compile()
        written = set(os.listdir(tmp_path))
        assert written
        program = cpu_options.compile_baked(lambda w, x: jnp.tanh(x @ w) * 5, (w,), x)
        assert set(os.listdir(tmp_path)) == written
        assert np.allclose(program(x), np.tanh(np.asarray(x) @ np.asarray(w)) * 5, atol=1e-4)
        jax.jit(lambda x: jnp.sin(x) * 7).lower(jnp.ones(3)).compile()
        assert len(os.listdir(tmp_path)) > len(written)
    finally:
        jax.config.update("jax_compilation_cache_dir", before[0])
        jax.config.update("jax_persistent_cache_min_compile_time_secs", before[1])


def test_no_baking_on_a_mesh_or_past_the_limit(models, monkeypatch):
    _, target, draft = models
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    assert not cpu_options.bakes_weights(mesh, target.params)
    monkeypatch.setattr(cpu_options, "BAKE_LIMIT_BYTES", cpu_options.params_bytes(target.params) - 1)
    assert not cpu_options.bakes_weights(None, target.params)
    assert cpu_options.bakes_weights(None, draft.params)
