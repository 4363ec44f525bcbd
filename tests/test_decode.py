"""The decode loop: every method is lossless against ``ar`` (greedy, and in distribution when sampling),
``ar`` equals transformers ``generate``, stops and capacity are handled, and nothing recompiles."""

import collections
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from dtree_jax import api, loop, running
from dtree_jax.cost import auto_budget
from dtree_jax.api import Model, generate
from dtree_jax.models import decoder, drafter
from tests.oracles import StateGetter, oracle_draft, tiny_domino, tiny_qwen3

METHODS = ("dflash", "domino", "ddtree", "dominotree", "condstatic")
PROMPTS = [[1, 5, 9, 3], [7, 8, 2, 4, 6, 11, 3, 40, 41]]


@pytest.fixture(scope="module")
def models():
    hf, d = tiny_qwen3(tie=False, seed=3)
    cfg = decoder.config_from_hf(d, dtype="float32")
    target = Model("qwen3", cfg, decoder.params_from_hf(cfg, StateGetter(hf), "float32"))
    dom, _, dd = tiny_domino(shift_label=True, seed=4)
    dcfg = drafter.config_from_hf(dd, dtype="float32")
    draft = Model("drafter", dcfg, drafter.params_from_hf(dcfg, StateGetter(dom), "float32"))
    return hf, target, draft


@pytest.fixture(scope="module")
def ar_tokens(models):
    _, target, _ = models
    return generate(target, PROMPTS, "ar", max_new_tokens=24, stop_ids=()).tokens


def test_ar_equals_transformers_generate(models, ar_tokens):
    hf, _, _ = models
    for prompt, got in zip(PROMPTS, ar_tokens):
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, eos_token_id=None,
                              pad_token_id=0)
        assert got == out[0, len(prompt):].tolist()


@pytest.mark.parametrize("method", METHODS)
def test_greedy_lossless_with_random_drafter(models, ar_tokens, method):
    _, target, draft = models
    # Request 0 stops at its 7th token (a stop id it emits), request 1 runs to max_new_tokens.
    stop = ar_tokens[0][6]
    got = generate(target, PROMPTS, method, draft, budget=8, max_new_tokens=24, stop_ids=(stop,))
    want0 = ar_tokens[0][: ar_tokens[0].index(stop) + 1]
    assert got.tokens[0] == want0 and got.stats[0]["stop_reason"] == "eos"
    if stop in ar_tokens[1]:
        want1 = ar_tokens[1][: ar_tokens[1].index(stop) + 1]
    else:
        want1 = ar_tokens[1]
    assert got.tokens[1] == want1


@pytest.mark.parametrize("method", ["domino", "ddtree", "dominotree"])
def test_greedy_lossless_with_oracle_drafter_accepts_long_paths(models, ar_tokens, method, monkeypatch):
    _, target, draft = models
    reference = np.array([t + [0] * 40 for t in ar_tokens], np.int32)
    monkeypatch.setattr(loop, "draft", oracle_draft(reference, loop.draft))
    monkeypatch.setattr(running, "COMPILED", collections.OrderedDict())
    jax.clear_caches()
    got = generate(target, PROMPTS, method, draft, budget=10, max_new_tokens=24, stop_ids=())
    jax.clear_caches()
    assert got.tokens == ar_tokens
    assert min(s["tau"] for s in got.stats) > 2.5  # long paths accepted, many compactions exercised


def test_capacity_stops_cleanly(models, ar_tokens):
    _, target, draft = models
    got = generate(target, PROMPTS, "dominotree", draft, budget=8, max_new_tokens=24, stop_ids=(),
                   cache_len=32)
    for want, toks, st in zip(ar_tokens, got.tokens, got.stats):
        assert st["stop_reason"] == "capacity" and 0 < len(toks) < 24
        assert toks == want[: len(toks)]


def test_no_recompilation_within_a_bucket(models):
    _, target, draft = models
    generate(target, [[3, 4, 5]], "dominotree", draft, budget=8, max_new_tokens=8, stop_ids=())
    before = api.compilations()
    other = generate(target, [[9, 1, 2, 7, 7]], "dominotree", draft, budget=8, max_new_tokens=8, stop_ids=())
    assert api.compilations() == before and other.compile_seconds == 0.0


def test_careless_input_is_refused_before_compiling(models):
    """Issue 16, items 6, 8, 9: everything silently accepted before is a ValueError saying what to change."""
    import dataclasses

    _, target, draft = models
    for t in (-0.5, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="temperature must be a finite number >= 0"):
            generate(target, PROMPTS, "ar", temperature=t)
    with pytest.raises(ValueError, match="token ids must be integers"):
        generate(target, [[1, 2.7]], "ar")
    with pytest.raises(ValueError, match="stop_ids: token ids must be integers"):
        generate(target, PROMPTS, "ar", stop_ids=[5000])
    with pytest.raises(ValueError, match="not a target model"):
        generate(draft, PROMPTS, "ar")
    narrow = dataclasses.replace(draft.cfg, target_layer_ids=(0, 2, 9))
    with pytest.raises(ValueError, match=r"does not fit the target.*tap layers \[0, 2, 9\]"):
        generate(target, PROMPTS, "dominotree", Model("drafter", narrow, draft.params))
    with pytest.raises(ValueError, match="max_position_embeddings"):
        generate(target, [[1] * 500], "ar", max_new_tokens=64)
    with pytest.raises(ValueError, match="lower budget"):
        generate(target, PROMPTS, "ddtree", draft, budget=200_000)
    with pytest.raises(ValueError, match="lower max_new_tokens"):
        big = Model("qwen3", dataclasses.replace(target.cfg, max_position_embeddings=10**9), target.params)
        generate(big, PROMPTS, "ar", max_new_tokens=10**8)
    got = generate(target, PROMPTS, "ar", budget="auto", max_new_tokens=2)  # ar has no budget to choose
    assert all(len(t) == 2 for t in got.tokens)


def test_a_request_samples_from_its_own_stream(models):
    """Issue 16, item 16: at T > 0 a request's output does not depend on the other requests of its batch."""
    _, target, draft = models
    one = generate(target, [PROMPTS[0], PROMPTS[1]], "dominotree", draft, budget=6, max_new_tokens=10,
                   temperature=1.0, seed=3, stop_ids=())
    other = generate(target, [PROMPTS[0], [9, 9, 9]], "dominotree", draft, budget=6, max_new_tokens=10,
                     temperature=1.0, seed=3, stop_ids=())
    assert one.tokens[0] == other.tokens[0]
    same = generate(target, [PROMPTS[1], PROMPTS[1]], "dominotree", draft, budget=6, max_new_tokens=10,
                    temperature=1.0, seed=3, stop_ids=())
    assert same.tokens[1] == one.tokens[1] and same.tokens[0] != same.tokens[1]  # streams: seed and index


def test_bad_input(models):
    _, target, draft = models
    with pytest.raises(ValueError, match="unknown method"):
        generate(target, PROMPTS, "beam", draft)
    with pytest.raises(ValueError, match="needs a drafter"):
        generate(target, PROMPTS, "ddtree")
    with pytest.raises(ValueError, match=r"token ids must be integers in \[0, 128\)"):
        generate(target, [[1, 999]], "ar")
    with pytest.raises(ValueError, match="at least one"):
        generate(target, [[]], "ar")
    plain = Model("drafter", draft.cfg.__class__(**{**draft.cfg.__dict__, "projector_type": None}), draft.params)
    with pytest.raises(ValueError, match="Domino drafter"):
        generate(target, PROMPTS, "dominotree", plain)


# ------------------------------------------------------------------------------------------------
# Sampling: the distribution of the generated tokens is the target's
# ------------------------------------------------------------------------------------------------


def _chi2_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Pearson chi-square with cells of expected count < 5 pooled into one."""
    n = counts.sum()
    expected = probs * n
    small = expected < 5
    obs = np.append(counts[~small], counts[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    keep = exp > 0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    return float(jax.scipy.special.gammaincc((keep.sum() - 1) / 2.0, stat / 2.0))


def _exact_second_token(target: Model, prompt: list[int], temperature: float) -> np.ndarray:
    """P(second generated token) = sum_t1 p(t1 | prompt) p(t2 | prompt, t1) under the target."""
    v = target.cfg.vocab_size
    ids = np.array([prompt + [t] for t in range(v)], np.int32)
    b, t = ids.shape
    cache = decoder.init_cache(target.cfg, b, t)
    logits, _, _ = decoder.forward(target.params, target.cfg, jnp.asarray(ids), jnp.broadcast_to(jnp.arange(t), (b, t)),
                                 cache, jnp.zeros((b,), jnp.int32), jnp.broadcast_to(jnp.tri(t, dtype=bool), (b, t, t)))
    logits = np.asarray(logits, np.float64) / temperature
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return p[0, -2] @ p[:, -1]  # row 0's position -2 is the prompt's last token: p(t1)


def test_sampling_is_lossless_in_distribution(models):
    _, target, draft = models
    prompt = [1, 5, 9, 3]
    n = 3000
    got = generate(target, [prompt] * n, "dominotree", draft, budget=6, max_new_tokens=2, temperature=1.0,
                   seed=11, stop_ids=())
    second = np.array([t[1] for t in got.tokens])
    counts = np.bincount(second, minlength=target.cfg.vocab_size)
    assert _chi2_pvalue(counts, _exact_second_token(target, prompt, 1.0)) > 1e-3
    # Control: the same samples are rejected against a slightly different distribution (temperature 0.8).
    assert _chi2_pvalue(counts, _exact_second_token(target, prompt, 0.8)) < 1e-4
    # Sampling with a fixed seed is reproducible.
    again = generate(target, [prompt] * n, "dominotree", draft, budget=6, max_new_tokens=2, temperature=1.0,
                     seed=11, stop_ids=())
    assert again.tokens == got.tokens


def test_cli_generate_json(models, tmp_path, capsys):
    hf, _, _ = models
    dom, _, _ = tiny_domino(shift_label=True, seed=4)
    hf.save_pretrained(tmp_path / "target")
    dom.save_pretrained(tmp_path / "drafter")
    from dtree_jax.cli import main

    rc = main(["generate", "--target", str(tmp_path / "target"), "--drafter", str(tmp_path / "drafter"),
               "--method", "ddtree", "--budget", "8", "--prompt-ids", "1,5,9,3", "--max-new-tokens", "12", "--json"])
    assert rc == 0
    row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert len(row["tokens"]) == 12 and row["rounds"] >= 1 and row["tau"] >= 1


def test_auto_budget_is_wide_at_small_batch_and_shrinks():
    taus = {4: 2.0, 8: 2.6, 16: 3.0, 32: 3.2}
    # A memory-bound machine: a round costs 1 ms plus 0.02 ms per verified token beyond 512 tokens.
    seconds = lambda b, n: 1e-3 + 2e-5 * max(0, b * (n + 1) - 512)
    cal = dict(tau_by_budget=taus, round_seconds={bs: {n: seconds(bs, n) for n in taus} for bs in (1, 4, 16, 64)})
    chosen = [auto_budget(cal, b) for b in (1, 2, 4, 8, 16, 32, 64, 128)]
    assert chosen[0] == 32 and chosen[-1] == 4
    assert all(x >= y for x, y in zip(chosen, chosen[1:]))
    with pytest.raises(ValueError, match="calibration"):
        auto_budget(dict(tau_by_budget=taus), 1)
    # Budget 0 (plain ar: tau 1, one token verified) measured on the same machine: ar wins only where the
    # batch makes every tree compute-bound, and exactly where its rate beats the best tree's.
    batches = (1, 4, 16, 64, 256)
    with_ar = dict(tau_by_budget={0: 1.0, **taus},
                   round_seconds={bs: {n: seconds(bs, n) for n in (0, *taus)} for bs in batches})
    for bs in batches:
        best_tree = max(bs * t / seconds(bs, n) for n, t in taus.items())
        assert (auto_budget(with_ar, bs) == 0) == (bs / seconds(bs, 0) > best_tree)
    assert auto_budget(with_ar, 1) == 32 and auto_budget(with_ar, 256) == 0
    with pytest.raises(ValueError, match="tau must be 1"):
        auto_budget(dict(with_ar, tau_by_budget={0: 1.5, **taus}), 1)


def test_generate_auto_budget_uses_the_calibration(models):
    _, target, draft = models
    cal = dict(tau_by_budget={2: 1.5, 6: 3.0}, round_seconds={1: {2: 1.0, 6: 1.0}, 8: {2: 1.0, 6: 10.0}})
    one = generate(target, PROMPTS[:1], "dominotree", draft, budget="auto", calibration=cal, max_new_tokens=4)
    assert one.stats[0]["budget"] == 6
    eight = generate(target, PROMPTS[:1] * 8, "dominotree", draft, budget="auto", calibration=cal, max_new_tokens=4)
    assert eight.stats[0]["budget"] == 2 and eight.stats[0]["method"] == "dominotree"
    # With plain ar calibrated (budget 0) and cheaper per token at batch 8, auto runs ar there.
    cal_ar = dict(tau_by_budget={0: 1.0, **cal["tau_by_budget"]},
                  round_seconds={1: {0: 1.0, **cal["round_seconds"][1]}, 8: {0: 0.5, **cal["round_seconds"][8]}})
    one = generate(target, PROMPTS[:1], "dominotree", draft, budget="auto", calibration=cal_ar, max_new_tokens=4)
    assert one.stats[0]["method"] == "dominotree" and one.stats[0]["budget"] == 6
    eight = generate(target, PROMPTS[:1] * 8, "dominotree", draft, budget="auto", calibration=cal_ar, max_new_tokens=4)
    assert [s["method"] for s in eight.stats] == ["ar"] * 8 and eight.stats[0]["budget"] is None
    assert all(s["rounds"] == s["generated"] - 1 for s in eight.stats)  # one token a round: no drafts
    assert eight.tokens == [generate(target, PROMPTS[:1], "ar", max_new_tokens=4).tokens[0]] * 8
    with pytest.raises(ValueError, match="calibration"):
        generate(target, PROMPTS, "dominotree", draft, budget="auto", max_new_tokens=4)


def test_auto_budget_measures_this_machine_once(models, tmp_path, monkeypatch):
    """Tau from the calibration, seconds per round measured here (plain ar and each budget), cached by machine and
    program: the second run reads the cache; made-up costs steer the choice, ar included."""
    from dtree_jax import cpu_dot, round_costs

    _, target, draft = models
    monkeypatch.setenv("DTREE_JAX_CACHE", str(tmp_path))
    cal = dict(tau_by_budget={2: 1.5, 6: 2.5})
    measured = []
    real = round_costs.measure
    monkeypatch.setattr(round_costs, "measure", lambda *a, **k: measured.append(1) or real(*a, **k))
    first = generate(target, PROMPTS[:1], "dominotree", draft, budget="auto", calibration=cal, max_new_tokens=4)
    # Where the few-row kernel builds, the rounds are measured with it and with XLA's dots, together: one entry.
    (entry,) = (tmp_path / "round-costs").iterdir()
    variants = ["the few-row kernel", "XLA's dots"] if cpu_dot.available() else ["the few-row kernel"]
    stored = json.loads(entry.read_text())
    assert list(stored["seconds"]) == variants and measured == [1]
    assert [p["dots"] == "xla" for p in stored["programs"].values()] == [False, True][: len(variants)]
    for seconds in stored["seconds"].values():
        assert "0" in seconds and all(s > 0 for s in seconds.values())
    assert first.auto.startswith("budget auto: ") and "measured now on this machine" in first.auto
    second = generate(target, PROMPTS[:1], "dominotree", draft, budget="auto", calibration=cal, max_new_tokens=6)
    assert measured == [1] and str(entry) in second.auto
    assert second.stats[0]["method"] == first.stats[0]["method"]
    # Made-up costs (the same for both dots): a tree that pays, then one that does not (ar runs, token for token
    # ar's output).
    for costs, method, budget in (({0: 1.0, 2: 1.0, 6: 1.2}, "dominotree", 6), ({0: 0.5, 2: 1.0, 6: 1.5}, "ar", None)):
        entry.write_text(json.dumps(dict(stored, seconds=dict.fromkeys(variants, costs))))
        got = generate(target, PROMPTS[:1], "dominotree", draft, budget="auto", calibration=cal, max_new_tokens=6)
        assert (got.stats[0]["method"], got.stats[0]["budget"]) == (method, budget), got.auto
    assert got.tokens == generate(target, PROMPTS[:1], "ar", max_new_tokens=6).tokens
    # A damaged cache entry, or one without a variant's ar step, is measured again.
    for damaged in ("{broken", json.dumps(dict(stored, seconds=dict.fromkeys(variants, {2: 1.0})))):
        entry.write_text(damaged)
        generate(target, PROMPTS[:1], "dominotree", draft, budget="auto", calibration=cal, max_new_tokens=4)
        assert json.loads(entry.read_text())["seconds"][variants[-1]]["0"] > 0
    assert measured == [1] * 3
    # Costs measured by other code (another digest of the package's source) are not read.
    monkeypatch.setattr(round_costs, "code_digest", lambda: "another version")
    generate(target, PROMPTS[:1], "dominotree", draft, budget="auto", calibration=cal, max_new_tokens=4)
    assert measured == [1] * 4 and len(list((tmp_path / "round-costs").iterdir())) == 2


def test_auto_budget_keeps_xla_dots_where_they_measure_faster(models, tmp_path, monkeypatch):
    """Where XLA's dots give more tokens/s than the few-row kernel (made-up costs in the cache), ``auto`` compiles
    the generation without packing its weights for the kernel, says so, and the output is still ar's; where the
    kernel is faster, the generation packs them."""
    from dtree_jax import cpu_dot, cpu_options

    if not cpu_dot.available():
        pytest.skip(f"the few-row kernel does not build here: {cpu_dot.status()}")
    _, target, draft = models
    monkeypatch.setenv("DTREE_JAX_CACHE", str(tmp_path))
    cal = dict(tau_by_budget={2: 1.5, 6: 2.5})
    generate(target, PROMPTS[:1], "dominotree", draft, budget="auto", calibration=cal, max_new_tokens=4)  # measures
    (entry,) = (tmp_path / "round-costs").iterdir()
    stored = json.loads(entry.read_text())
    packed = []
    real = cpu_options.pack_dense
    monkeypatch.setattr(cpu_options, "pack_dense", lambda tree: packed.append(1) or real(tree))
    ar = generate(target, PROMPTS[:1], "ar", max_new_tokens=7).tokens
    compiled = set()
    slow, fast, fast_ar = {0: 2.0, 2: 2.0, 6: 2.4}, {0: 1.0, 2: 1.0, 6: 1.2}, {0: 1.0, 2: 2.0, 6: 2.4}
    # (kernel's costs, XLA's costs, the dots chosen, plain ar's fastest): the last has the kernel's trees win
    # while XLA's dots give the faster ar step, which the fair baseline then runs.
    for kernel_costs, xla_costs, dots, ar_dots in ((slow, fast, "xla", "xla"), (fast, slow, "kernel", "kernel"),
                                                   ({**fast, 0: 2.0}, fast_ar, "kernel", "xla")):
        costs = {"the few-row kernel": kernel_costs, "XLA's dots": xla_costs}
        entry.write_text(json.dumps(dict(stored, seconds=costs)))
        packed.clear()
        got = generate(target, PROMPTS[:1], "dominotree", draft, budget="auto", calibration=cal, max_new_tokens=7)
        assert got.stats[0]["budget"] == 6 and got.tokens == ar
        assert (got.cpu_dots, got.ar_cpu_dots) == (dots, ar_dots), got.auto
        assert ("dots: XLA's dots, where the few-row kernel gave" in got.auto) == (dots == "xla"), got.auto
        assert ("plain ar's step is faster with XLA's dots" in got.auto) == (dots != ar_dots), got.auto
        # The kernel's programs pack their weights when compiled (once per process); XLA's never do.
        assert bool(packed) == (dots == "kernel" and dots not in compiled)
        compiled.add(dots)
    # Dots named by the caller: auto reads (or measures) those alone, and "xla" never packs.
    for budget in ("auto", 6):
        packed.clear()
        got = generate(target, PROMPTS[:1], "dominotree", draft, budget=budget, calibration=cal, cpu_dots="xla",
                       max_new_tokens=7)
        assert (got.cpu_dots, got.ar_cpu_dots, got.tokens, packed) == ("xla", "xla", ar, [])
        assert got.stats[0]["budget"] == 6 and (budget == 6 or "dots:" not in got.auto)
    with pytest.raises(ValueError, match="cpu_dots must be one of auto, kernel, xla"):
        generate(target, PROMPTS[:1], "dominotree", draft, budget=6, cpu_dots="fast", max_new_tokens=7)


def test_round_costs_time_every_program_in_pairs_with_one_ar_step(monkeypatch):
    """Other work on the machine while one program is timed (3x slower, budget 2 here) slows that program's
    reference ar steps as well: the costs come out as the programs' own (ar 1 s, budget 2 2 s, budget 4 3 s), not
    6 s for budget 2.  A second variant (another way of compiling) is timed against the same reference, so a load
    while its ar step runs does not make it look slower than it is.  Each variant's measuring stops at its first
    budget whose expected rate falls below its previous tree's."""
    from dtree_jax import round_costs

    now, load = [0.0], [1.0]
    own = {("a", 0): 1.0, ("a", 2): 2.0, ("a", 4): 3.0, ("a", 8): 4.0, ("b", 0): 0.8, ("b", 2): 1.5, ("b", 4): 3.0}
    loaded = {("a", 2), ("b", 0)}

    def program(spec, *_):  # a "compiled round" that advances the fake clock by its cost times the load
        load[0] = 3.0 if spec in loaded else 1.0
        return lambda: now.__setitem__(0, now[0] + own[spec] * load[0])

    monkeypatch.setattr(round_costs, "round_program", program)
    monkeypatch.setattr(round_costs, "clock", lambda: now[0])
    taus = {0: 1.0, 2: 1.9, 4: 2.9, 8: 3.0}

    def variants(*names):
        return {n: {b: (n, b) for v, b in own if v == n} for n in names}

    seconds = round_costs.measure(variants("a", "b"), None, None, (), taus, log=None)
    # a's 8 measured, then it stops (0.75 < 0.97); b's 4 (0.97 < 1.27) measured, the last it has.
    assert seconds == {"a": pytest.approx({0: 1.0, 2: 2.0, 4: 3.0, 8: 4.0}),
                       "b": pytest.approx({0: 0.8, 2: 1.5, 4: 3.0})}
    timed_alone = program(("b", 0))
    t0 = now[0]
    timed_alone()
    assert now[0] - t0 == pytest.approx(2.4)  # control: the load is real; timed alone, b's ar would cost 2.4 s
    seconds = round_costs.measure(variants("a"), None, None, (), {**taus, 4: 2.5}, log=None)
    assert sorted(seconds["a"]) == [0, 2, 4]  # budget 4's rate (0.83) falls below budget 2's (0.95): 8 is not measured


def test_round_costs_key_names_the_implementations_not_where_they_are_installed(models):
    """An installed copy and a source checkout of the package share a machine's round costs."""
    from dtree_jax import api, round_costs

    _, target, draft = models
    spec = api.make_spec(target, draft, "dominotree", budget=4, node_topk=4, corr_topm=None, max_depth=None,
                         max_new_tokens=8, prompt_bucket=16, stop_ids=(), top_k=0, top_p=1.0)
    key = round_costs.program_key(spec, 1, True)["spec"]
    assert "drafter='dtree_jax.models.drafter'" in key and ".py" not in key and "/" not in key


def test_pallas_attention_in_interpret_mode_stays_lossless(models, ar_tokens):
    """The decode loop on the Pallas tree-attention kernel (interpret mode on CPU), target and drafter."""
    import dataclasses

    _, target, draft = models
    pallas_target = Model("qwen3", dataclasses.replace(target.cfg, attention_impl="pallas"), target.params)
    dcfg = dataclasses.replace(draft.cfg, model=dataclasses.replace(draft.cfg.model, attention_impl="pallas"))
    pallas_draft = Model("drafter", dcfg, draft.params)
    got = generate(pallas_target, PROMPTS, "dominotree", pallas_draft, budget=8, max_new_tokens=12, stop_ids=())
    assert got.tokens == [t[:12] for t in ar_tokens]


def test_package_exports_generate_lazily():
    import subprocess
    import sys

    code = "import sys, dtree_jax; assert 'dtree_jax.api' not in sys.modules; print(dtree_jax.generate.__module__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "dtree_jax.api"


def test_every_target_module_satisfies_the_target_protocol():
    """The loop calls these and nothing else on a target (no duck typing of optional hooks)."""
    from dtree_jax.models import families, protocol

    targets = set(families.target_kinds())
    assert targets >= {"qwen3", "qwen2", "llama", "qwen3_5"}
    for kind in targets:
        assert isinstance(Model(kind, None, None).module, protocol.TargetModel), kind
    assert not isinstance(Model("drafter", None, None).module, protocol.TargetModel)
    assert isinstance(Model("drafter", None, None).module, protocol.DrafterModel)
    assert not isinstance(Model("qwen3", None, None).module, protocol.DrafterModel)


def test_stats_are_per_request_and_plain_numbers(models):
    """Issue 16, item 13: a request that stops early reports its own (shorter) time; tau is a float; the
    instrumented mode reports its compilation apart from the stage times."""
    _, target, draft = models
    got = generate(target, PROMPTS, "dominotree", draft, budget=6, max_new_tokens=20, stop_ids=())
    short = generate(target, PROMPTS, "dominotree", draft, budget=6, max_new_tokens=20,
                     stop_ids=(got.tokens[0][2],))  # request 0 stops after 3 tokens, request 1 (probably) later
    first, second = short.stats
    assert type(first["tau"]) is float and first["rounds"] < second["rounds"]
    assert first["seconds"] < second["seconds"] <= short.seconds + 1e-9
    inst = generate(target, PROMPTS, "dominotree", draft, budget=6, max_new_tokens=8, stop_ids=(), instrument=True)
    assert inst.compile_seconds > 0 and all(v < inst.compile_seconds for v in inst.stage_seconds.values())


def test_a_tied_target_loaded_on_cpu_gets_its_own_output_head():
    """``api.load_model`` gives a tied target (the shipped tiny one) a contiguous ``[H, V]`` copy of its table
    on CPU; every method decodes the same tokens with it as with the tied table itself."""
    from dtree_jax import cli

    loaded = api.load_model(cli.checkpoints_dir() / "tiny-target")
    draft = api.load_model(cli.checkpoints_dir() / "tiny-domino")
    assert loaded.cfg.tie_word_embeddings
    np.testing.assert_array_equal(np.asarray(loaded.params.lm_head), np.asarray(loaded.params.embed).T)
    tied = Model(loaded.kind, loaded.cfg, dataclasses.replace(loaded.params, lm_head=None), loaded.path)
    assert api.cpu_layout(api.load_model(draft)) is draft  # drafters keep their layout
    prompts = [[1, 5, 9, 3], [7, 8, 2, 4, 6, 11]]
    for method in ("ar", "dominotree"):
        own = generate(loaded, prompts, method, draft, budget=4, max_new_tokens=12, stop_ids=())
        table = generate(tied, prompts, method, draft, budget=4, max_new_tokens=12, stop_ids=())
        assert own.tokens == table.tokens


def test_streaming_hands_over_every_committed_token_in_order(models, ar_tokens):
    _, target, draft = models
    seen = [[] for _ in PROMPTS]
    calls = []

    def sink(new):
        calls.append(new)
        for s, n in zip(seen, new):
            s.extend(n)

    got = generate(target, PROMPTS, "dominotree", draft, budget=8, max_new_tokens=24, stop_ids=(), stream=sink)
    assert seen == got.tokens == ar_tokens
    assert len(calls) == 1 + max(s["rounds"] for s in got.stats)  # the root after prefill, then every round
    with pytest.raises(ValueError, match="stream must be a callable"):
        generate(target, PROMPTS, "ar", stream="print")


def test_a_generation_that_does_not_stream_has_no_host_call(models):
    """Not streaming costs nothing: the program has no callback in it (control: the streaming one has)."""
    _, target, draft = models
    spec, args = api.abstract_generation(target, draft, "dominotree", budget=4)
    lowered = {s: loop.generate_on_device.trace(dataclasses.replace(spec, stream=s), *args).lower().as_text()
               for s in (False, True)}
    assert "callback" not in lowered[False] and "callback" in lowered[True]
