"""One jitted generation on device: prefill, then ``lax.while_loop`` rounds of
draft -> build tree -> verify -> accept -> commit -> stop checks, for every method.

Methods differ only in the tree they verify:
  * ``ar``          the root alone (one target token per round, no drafter);
  * ``dflash``      the drafter's greedy block as a chain (marginal scorer, k = 1);
  * ``domino``      the Domino chain (GRU-corrected scorer, k = 1);
  * ``ddtree``      best-first tree over the marginal scorer;
  * ``dominotree``  best-first tree over the Domino conditional scorer (top-M candidates);
  * ``condstatic``  the ablation: correction once per depth along the greedy chain.

Shapes are static per (batch, prompt bucket, tree size); everything else (lengths, acceptance, stops) is
data, so a second prompt of the same bucket reuses the compiled loop.  The drafter's context length always
equals the target's committed length ``lens``: the root is the last committed token, whose features are
not known until it is verified.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dtree_jax import builders
from dtree_jax.convert import MODEL_MODULES
from dtree_jax.tree import Tree, chain_tree
from dtree_jax.verify import accept_sampled, sample_tokens

METHODS = tuple(builders.REGISTRY)  # the method registry's names, "ar" first
STOP_RUNNING, STOP_EOS, STOP_MAX_NEW, STOP_CAPACITY = 0, 1, 2, 3
STOP_REASONS = {STOP_RUNNING: "running", STOP_EOS: "eos", STOP_MAX_NEW: "max_new_tokens", STOP_CAPACITY: "capacity"}

_MODULES = MODEL_MODULES  # model kind -> module, the converter's map


@dataclasses.dataclass(frozen=True)
class Model:
    """A loaded model: ``kind`` names its module ("qwen3" / "qwen2" / "llama" (dense), "qwen3_5", "drafter");
    ``cfg`` is static."""

    kind: str
    cfg: Any
    params: Any
    path: str | None = None  # where it was loaded from (tokenizer lookup)
    eos_token_ids: tuple[int, ...] = ()  # from config.json / generation_config.json

    @property
    def module(self):
        if self.kind not in _MODULES:
            raise ValueError(f"unknown model kind {self.kind!r}; expected one of {sorted(_MODULES)}")
        return importlib.import_module(_MODULES[self.kind])


@dataclasses.dataclass(frozen=True)
class Spec:
    """Everything static about one compiled generation."""

    target_kind: str
    target_cfg: Any
    drafter_cfg: Any  # None for ar
    method: str
    budget: int
    node_topk: int
    corr_topm: int
    max_depth: int
    max_new_tokens: int
    cache_len: int
    stop_ids: tuple[int, ...]
    top_k: int
    top_p: float

    @property
    def target(self):
        return importlib.import_module(_MODULES[self.target_kind])

    @property
    def drafter(self):
        return importlib.import_module(_MODULES["drafter"])

    @property
    def record(self) -> builders.Method:
        """The method's registry entry."""
        return builders.get_method(self.method)

    @property
    def num_nodes(self) -> int:
        """Tree size N including the root."""
        depth = 0 if self.drafter_cfg is None else min(self.max_depth, self.drafter_cfg.num_draft_rows)
        return 1 + self.record.draft_nodes(self.budget, depth)

    @property
    def taps(self) -> tuple[int, ...]:
        return () if self.drafter_cfg is None else tuple(self.drafter_cfg.target_layer_ids)

    @property
    def draft_span(self) -> int:
        """Cache rows needed past ``lens`` in a round (tree for the target, block for the drafter)."""
        block = 0 if self.drafter_cfg is None else self.drafter_cfg.block_size
        return max(self.num_nodes, block)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeState:
    cache: Any  # target cache
    dcache: Any  # drafter context cache (None for ar)
    lens: jax.Array  # [B] committed tokens in the target cache (= drafter context length)
    root: jax.Array  # [B] last emitted token (not yet in the cache)
    out: jax.Array  # [B, max_new + N] generated tokens, -1 padded
    out_len: jax.Array  # [B]
    done: jax.Array  # [B] bool
    stop_reason: jax.Array  # [B] int32, STOP_*
    rounds: jax.Array  # [B] rounds run while active
    step: jax.Array  # [] round counter
    key: jax.Array


# ----------------------------------------------------------------------------------------------------------
# One round, stage by stage (shared by the while loop and the instrumented mode)
# ----------------------------------------------------------------------------------------------------------


def _draft(spec: Spec, tparams, dparams, state: DecodeState) -> builders.DraftRound | None:
    """Drafter block for the current root: ph rows, base logits and the root's GRU state."""
    if not spec.record.drafts:
        return None
    ph, base, root_state = spec.drafter.draft_round(
        dparams, spec.drafter_cfg, spec.target, tparams, spec.target_cfg, state.dcache, state.lens, state.root
    )
    return builders.DraftRound(ph=ph, base=base, root_state=root_state, root=state.root)


def _build_tree(spec: Spec, tparams, dparams, rnd: builders.DraftRound | None, state: DecodeState) -> Tree:
    if not spec.record.drafts:
        return chain_tree(state.root[:, None])
    return builders.build_tree(
        spec.method,
        rnd,
        dparams.head,
        tparams.embed,
        budget=spec.num_nodes - 1,
        k=spec.node_topk,
        M=spec.corr_topm,
        P=spec.drafter_cfg.pure_draft_prefix_len,
        max_depth=spec.max_depth,
        mask_token_id=spec.drafter_cfg.mask_token_id,
    )


def _write_lens(spec: Spec, state: DecodeState) -> jax.Array:  # [B]
    """Where this round writes its N tree rows: ``lens``, clamped for finished rows so that their (discarded)
    writes stay inside the cache instead of being shifted onto committed rows."""
    return jnp.where(state.done, jnp.minimum(state.lens, spec.cache_len - spec.num_nodes), state.lens)


def _verify(spec: Spec, tparams, tree: Tree, state: DecodeState):
    """One target pass over the tree; done rows run on a clamped slot and are discarded later."""
    lens = _write_lens(spec, state)
    return spec.target.forward(
        tparams, spec.target_cfg, tree.tokens, tree.positions(lens), state.cache, lens, tree.mask, spec.taps
    )


def _accept_commit(spec: Spec, dparams, tree: Tree, logits, feats, cache, state: DecodeState, temperature):
    """Acceptance, stop checks, KV compaction, drafter context update and output append."""
    key, sub = jax.random.split(state.key)
    acc = accept_sampled(tree.parents, tree.tokens, logits, sub, temperature, spec.top_k, spec.top_p)
    n = spec.num_nodes
    pos = jnp.arange(n)
    num = acc.num_emitted
    active = ~state.done
    # Stop at the first stop id among the emitted tokens (inclusive).
    is_stop = _is_stop(spec, acc.emitted) & (pos < num[:, None])
    first_stop = jnp.where(jnp.any(is_stop, -1), jnp.argmax(is_stop, -1) + 1, n + 1)
    room = spec.max_new_tokens - state.out_len
    num = jnp.minimum(jnp.minimum(num, first_stop), room)
    num = jnp.where(active, num, 0)
    reason = jnp.where(
        num == first_stop, STOP_EOS, jnp.where(state.out_len + num >= spec.max_new_tokens, STOP_MAX_NEW, STOP_RUNNING)
    )
    # Commit the root and the accepted drafts (path[:num]); the bonus becomes the next root.
    cache = spec.target.commit(spec.target_cfg, cache, state.lens, acc.path, num)
    dcache = state.dcache
    if spec.drafter_cfg is not None:
        path_feats = jnp.take_along_axis(feats, jnp.clip(acc.path, 0)[:, :, None], axis=1)
        ctx_lens = _write_lens(spec, state)
        dcache = spec.drafter.append_context(
            dparams, spec.drafter_cfg, dcache, ctx_lens, path_feats, ctx_lens[:, None] + pos
        )
    written = jnp.where(pos < num[:, None], acc.emitted, -1)
    out = jax.vmap(lambda o, w, at: jax.lax.dynamic_update_slice(o, w, (at,)))(state.out, written, state.out_len)
    last = jnp.take_along_axis(acc.emitted, jnp.maximum(num - 1, 0)[:, None], -1)[:, 0]
    lens = state.lens + num
    done = state.done | (reason != STOP_RUNNING)
    # Capacity: the next round needs draft_span free rows past lens.
    full = (~done) & (lens + spec.draft_span > spec.cache_len)
    reason = jnp.where(full, STOP_CAPACITY, reason)
    return DecodeState(
        cache=cache,
        dcache=dcache,
        lens=lens,
        root=jnp.where(num > 0, last, state.root),
        out=out,
        out_len=state.out_len + num,
        done=done | full,
        stop_reason=jnp.where(active, reason, state.stop_reason),
        rounds=state.rounds + active.astype(jnp.int32),
        step=state.step + 1,
        key=key,
    )


def _is_stop(spec: Spec, tokens: jax.Array) -> jax.Array:
    stops = jnp.asarray(spec.stop_ids or (-2,), jnp.int32)
    return jnp.any(tokens[..., None] == stops, axis=-1)


def _round(spec: Spec, tparams, dparams, temperature, state: DecodeState) -> DecodeState:
    rnd = _draft(spec, tparams, dparams, state)
    tree = _build_tree(spec, tparams, dparams, rnd, state)
    logits, feats, cache = _verify(spec, tparams, tree, state)
    return _accept_commit(spec, dparams, tree, logits, feats, cache, state, temperature)


# ----------------------------------------------------------------------------------------------------------
# Prefill and the whole generation
# ----------------------------------------------------------------------------------------------------------


def _prefill(spec: Spec, tparams, dparams, prompts, prompt_lens, key, temperature) -> DecodeState:
    b, p = prompts.shape
    tg = spec.target
    cache = tg.init_cache(spec.target_cfg, b, spec.cache_len)
    zeros = jnp.zeros((b,), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
    logits, feats, cache = tg.prefill(tparams, spec.target_cfg, prompts, cache, prompt_lens, spec.taps)
    key, sub = jax.random.split(key)
    last_logits = jnp.take_along_axis(logits, (prompt_lens - 1)[:, None, None], axis=1)[:, 0]
    root = sample_tokens(sub, last_logits, temperature, spec.top_k, spec.top_p)
    dcache = None
    if spec.drafter_cfg is not None:
        dcache = spec.drafter.init_drafter_cache(spec.drafter_cfg, b, spec.cache_len)
        dcache = spec.drafter.append_context(dparams, spec.drafter_cfg, dcache, zeros, feats, positions)
    n = spec.num_nodes
    out = jnp.full((b, spec.max_new_tokens + n), -1, jnp.int32).at[:, 0].set(root)
    is_stop = _is_stop(spec, root)
    reason = jnp.where(is_stop, STOP_EOS, jnp.where(spec.max_new_tokens <= 1, STOP_MAX_NEW, STOP_RUNNING))
    full = (reason == STOP_RUNNING) & (prompt_lens + spec.draft_span > spec.cache_len)
    reason = jnp.where(full, STOP_CAPACITY, reason)
    return DecodeState(
        cache=cache,
        dcache=dcache,
        lens=prompt_lens,
        root=root,
        out=out,
        out_len=jnp.ones((b,), jnp.int32),
        done=reason != STOP_RUNNING,
        stop_reason=reason.astype(jnp.int32),
        rounds=jnp.zeros((b,), jnp.int32),
        step=jnp.int32(0),
        key=key,
    )


def _generate(spec: Spec, tparams, dparams, prompts, prompt_lens, key, temperature) -> DecodeState:
    state = _prefill(spec, tparams, dparams, prompts, prompt_lens, key, temperature)
    return jax.lax.while_loop(
        lambda s: jnp.any(~s.done) & (s.step < spec.max_new_tokens),
        lambda s: _round(spec, tparams, dparams, temperature, s),
        state,
    )


generate_on_device = jax.jit(_generate, static_argnums=0)
prefill_jit = jax.jit(_prefill, static_argnums=0)


def trace_generation(target: "Model", drafter: "Model | None", method: str, *, batch: int = 1,
                     prompt_bucket: int = 16, temperature: float = 0.0, **knobs) -> jax.stages.Traced:
    """``generate_on_device`` (prefill + the while_loop) traced for ``batch`` prompts of one bucket, without
    running it; params may be abstract (``abstract_params``).  ``.lower(lowering_platforms=("tpu",))`` then
    cross-lowers the whole generation (give the configs a fixed ``kernel_platform`` to get that platform's
    kernels: ``with_kernels``).  ``knobs`` go to ``make_spec`` (defaults: budget 8, k 4, 16 new tokens)."""
    knobs = dict(dict(budget=8, node_topk=4, corr_topm=None, max_depth=None, max_new_tokens=16, stop_ids=(),
                      top_k=0, top_p=1.0), **knobs)
    spec = make_spec(target, drafter, method, prompt_bucket=prompt_bucket, **knobs)
    prompts = jax.ShapeDtypeStruct((batch, prompt_bucket), jnp.int32)
    lens = jax.ShapeDtypeStruct((batch,), jnp.int32)
    dparams = drafter.params if builders.get_method(method).drafts else None
    return generate_on_device.trace(spec, target.params, dparams, prompts, lens, jax.random.key(0),
                                    jnp.float32(temperature))


# ----------------------------------------------------------------------------------------------------------
# Instrumented mode: the same stages, jitted separately and timed per round
# ----------------------------------------------------------------------------------------------------------

_draft_jit = jax.jit(_draft, static_argnums=0)
_build_jit = jax.jit(_build_tree, static_argnums=0)
_verify_jit = jax.jit(_verify, static_argnums=0)
_commit_jit = jax.jit(_accept_commit, static_argnums=0)


def _timed(fn, *args):
    t0 = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
    return out, time.perf_counter() - t0


_COMPILED: dict = {}


def _compiled(args):
    """The compiled generation for these static knobs and argument shapes (compiled once, then reused)."""
    leaves, treedef = jax.tree_util.tree_flatten(args[1:])
    key = (args[0], treedef, tuple((jnp.shape(x), jnp.result_type(x)) for x in leaves))
    if key in _COMPILED:
        return _COMPILED[key], 0.0
    t0 = time.perf_counter()
    _COMPILED[key] = generate_on_device.lower(*args).compile()
    return _COMPILED[key], time.perf_counter() - t0


def compilations() -> int:
    """How many distinct generations have been compiled in this process (for recompilation checks)."""
    return len(_COMPILED)


def _run_instrumented(spec, tparams, dparams, prompts, lens, key, temperature):
    state = jax.block_until_ready(prefill_jit(spec, tparams, dparams, prompts, lens, key, temperature))
    stages = {"draft": [], "build": [], "verify": [], "commit": []}
    trees = []
    while bool(jnp.any(~state.done)) and int(state.step) < spec.max_new_tokens:
        rnd, t_draft = _timed(_draft_jit, spec, tparams, dparams, state)
        tree, t_build = _timed(_build_jit, spec, tparams, dparams, rnd, state)
        (logits, feats, cache), t_verify = _timed(_verify_jit, spec, tparams, tree, state)
        before = state
        state, t_commit = _timed(_commit_jit, spec, dparams, tree, logits, feats, cache, state, temperature)
        for name, t in zip(stages, (t_draft, t_build, t_verify, t_commit)):
            stages[name].append(t)
        trees.append(
            dict(
                active=(~np.asarray(before.done)).tolist(),
                lens=np.asarray(before.lens).tolist(),
                tokens=np.asarray(tree.tokens).tolist(),
                parents=np.asarray(tree.parents).tolist(),
                emitted=(np.asarray(state.out_len) - np.asarray(before.out_len)).tolist(),
            )
        )
    return state, stages, trees


# ----------------------------------------------------------------------------------------------------------
# Python API
# ----------------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Generation:
    tokens: list[list[int]]  # generated ids per request (stop token included, nothing after it)
    stats: list[dict]  # per request: generated, rounds, tau, seconds, tokens_per_second, stop_reason
    compile_seconds: float
    stage_seconds: dict | None = None  # instrumented mode: mean seconds per round of each stage
    # Instrumented mode: per round, per request: active, lens (committed length), the tree's tokens and
    # parents (node 0 = the root) and the number of tokens emitted.
    round_trees: list[dict] | None = None
    texts: list[str] | None = None  # text prompts only: ``tokens`` decoded (special tokens skipped)


def _eos_ids(path) -> tuple[int, ...]:
    """EOS ids from ``generation_config.json`` (preferred) or ``config.json`` (int or list)."""
    import json
    import pathlib

    for name in ("generation_config.json", "config.json"):
        f = pathlib.Path(path) / name
        if f.is_file():
            d = json.loads(f.read_text())
            d = d.get("text_config", d) if "eos_token_id" not in d else d
            eos = d.get("eos_token_id")
            if eos is not None:
                return tuple(int(e) for e in (eos if isinstance(eos, list) else [eos]))
    return ()


def _as_model(m) -> Model | None:
    if m is None or isinstance(m, Model):
        return m
    if isinstance(m, (str, bytes)) or hasattr(m, "__fspath__"):
        from dtree_jax.convert import load_model, model_dir

        path = model_dir(m)  # a GGUF file: its converted copy in the cache
        kind, cfg, params = load_model(path)
        return Model(kind, cfg, params, str(path), _eos_ids(path))
    if isinstance(m, tuple) and len(m) == 3:
        return Model(*m)
    raise TypeError(f"expected a Model, a (kind, cfg, params) tuple or a checkpoint path, got {type(m).__name__}")


def with_kernels(model: Model | None, attention_impl: str | None = None, kernel_platform: str | None = None):
    """``model`` with its config's ``attention_impl`` ("xla" | "pallas") and ``kernel_platform`` ("tpu" | "gpu" |
    "cpu"; whose kernels "pallas" runs) replaced where given (None keeps the config's; a drafter's apply to its
    backbone).  ``models.kernels`` documents which kernel runs where."""
    if model is None or (attention_impl is None and kernel_platform is None):
        return model
    from dtree_jax.models.config import ATTENTION_IMPLS, check_kernel_platform

    if attention_impl is not None and attention_impl not in ATTENTION_IMPLS:
        raise ValueError(f"attention_impl must be one of {ATTENTION_IMPLS}, got {attention_impl!r}")
    check_kernel_platform(kernel_platform)
    knobs = {k: v for k, v in dict(attention_impl=attention_impl, kernel_platform=kernel_platform).items() if v}
    cfg = model.cfg
    if model.kind == "drafter":
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, **knobs))
    else:
        cfg = dataclasses.replace(cfg, **knobs)
    return dataclasses.replace(model, cfg=cfg)


def _bucket(n: int, multiple: int = 16) -> int:
    return max(multiple, -(-n // multiple) * multiple)


def make_spec(
    target: Model,
    drafter: Model | None,
    method: str,
    *,
    budget: int,
    node_topk: int,
    corr_topm: int | None,
    max_depth: int | None,
    max_new_tokens: int,
    prompt_bucket: int,
    stop_ids: Sequence[int],
    top_k: int,
    top_p: float,
    cache_len: int | None = None,
) -> Spec:
    """Validates the knobs and returns the static description of a generation."""
    record = builders.get_method(method)
    if record.drafts:
        if drafter is None:
            raise ValueError(f"method {method!r} needs a drafter")
        if drafter.kind != "drafter":
            raise ValueError(f"the drafter checkpoint is a {drafter.kind!r} model, not a DFlash/Domino drafter")
        if record.needs_head and not drafter.cfg.has_head:
            raise ValueError(f"method {method!r} needs a Domino drafter (with the GRU head); this is plain DFlash")
    for name, v in dict(budget=budget, node_topk=node_topk, max_new_tokens=max_new_tokens).items():
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    corr_topm = record.corr_topm if corr_topm is None else corr_topm
    if not isinstance(corr_topm, int) or corr_topm < 0:
        raise ValueError(f"corr_topm must be a non-negative integer (0 = full vocabulary), got {corr_topm!r}")
    if top_k < 0 or not 0 < top_p <= 1:
        raise ValueError(f"need top_k >= 0 and 0 < top_p <= 1, got top_k={top_k}, top_p={top_p}")
    dcfg = drafter.cfg if record.drafts else None
    depth_cap = dcfg.num_draft_rows if dcfg is not None else 1
    max_depth = depth_cap if max_depth is None else max_depth
    if not isinstance(max_depth, int) or max_depth < 1:
        raise ValueError(f"max_depth must be a positive integer, got {max_depth!r}")
    spec = Spec(
        target_kind=target.kind,
        target_cfg=target.cfg,
        drafter_cfg=dcfg,
        method=method,
        budget=budget,
        node_topk=node_topk,
        corr_topm=corr_topm,
        max_depth=min(max_depth, depth_cap),
        max_new_tokens=max_new_tokens,
        cache_len=0,
        stop_ids=tuple(int(s) for s in stop_ids),
        top_k=top_k,
        top_p=float(top_p),
    )
    need = prompt_bucket + max_new_tokens + spec.draft_span
    if cache_len is None:
        cache_len = _bucket(need, 64)
    elif cache_len < prompt_bucket + spec.draft_span:
        raise ValueError(f"cache_len {cache_len} cannot hold a {prompt_bucket}-token prompt bucket plus one round")
    return dataclasses.replace(spec, cache_len=cache_len)


CALIBRATION_FILE = "calibration.json"


def auto_budget(calibration: dict, batch: int) -> int:
    """The node budget ``cost.choose_budget`` picks for ``batch`` from a calibration measured on this machine:
    ``{"tau_by_budget": {budget: tau}, "round_seconds": {batch: {budget: seconds per round}}}``.  Seconds for
    an unmeasured batch are interpolated log-linearly between measured batches (proportionally beyond)."""
    from dtree_jax.cost import choose_budget

    try:
        taus = {int(b): float(t) for b, t in calibration["tau_by_budget"].items()}
        table = {int(bs): {int(b): float(t) for b, t in row.items()} for bs, row in calibration["round_seconds"].items()}
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ValueError(f"malformed calibration (need tau_by_budget and round_seconds): {e}") from e
    batches = sorted(table)
    if not batches or any(set(table[b]) < set(taus) for b in batches):
        raise ValueError("calibration round_seconds must cover every budget in tau_by_budget at every batch")

    def seconds(b: int, verify_tokens: int) -> float:
        budget = verify_tokens - 1
        if b <= batches[0]:
            return table[batches[0]][budget]
        if b >= batches[-1]:
            return table[batches[-1]][budget] * b / batches[-1]
        hi = next(x for x in batches if x >= b)
        lo = max(x for x in batches if x <= b)
        if hi == lo:
            return table[lo][budget]
        w = (np.log(b) - np.log(lo)) / (np.log(hi) - np.log(lo))
        return float(np.exp((1 - w) * np.log(table[lo][budget]) + w * np.log(table[hi][budget])))

    return choose_budget(batch, taus, seconds)


def _load_calibration(calibration, drafter: Model | None) -> dict:
    import json
    import pathlib

    if isinstance(calibration, dict):
        return calibration
    path = calibration or (drafter and drafter.path and pathlib.Path(drafter.path) / CALIBRATION_FILE)
    if not path or not pathlib.Path(path).is_file():
        raise ValueError(
            f"budget='auto' needs a calibration ({CALIBRATION_FILE} beside the drafter, or calibration=...); "
            "experiments/run_experiments.py measures one"
        )
    return json.loads(pathlib.Path(path).read_text())


def generate(
    target,
    prompts: Sequence[Sequence[int]],
    method: str = "dominotree",
    drafter=None,
    *,
    budget: int | str = 32,
    node_topk: int = 8,
    corr_topm: int | None = None,
    max_depth: int | None = None,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    max_new_tokens: int = 64,
    stop_ids: Sequence[int] | None = None,
    prompt_bucket: int | None = None,
    cache_len: int | None = None,
    instrument: bool = False,
    calibration: dict | str | None = None,
    attention_impl: str | None = None,
    kernel_platform: str | None = None,
    chat: bool = False,
) -> Generation:
    """Generates continuations of ``prompts`` with ``method`` on device.

    ``prompts`` are token-id lists, or strings encoded with the target's ``tokenizer.json``; with ``chat``
    each string is one user message, wrapped in the checkpoint's chat template first (the result's ``texts``
    then hold the decoded responses).  ``target`` and ``drafter`` are ``Model``s, ``(kind, cfg, params)``
    tuples, or checkpoint paths (converted or HF directories; a target may be a GGUF file).  ``budget`` is the number of non-root tree nodes (tree methods), ``node_topk`` the
    branching cap k, ``corr_topm`` the Domino candidate width M (0 = full vocabulary; default: the reference's, full for
    ``domino`` and 64 for ``dominotree``).  Temperature 0 is
    greedy; above 0 the target is sampled at every node (lossless).  ``stop_ids`` default to the target's
    EOS ids.  Prompts are right-padded to ``prompt_bucket`` (default: the longest rounded up to 16) so
    prompts of one bucket share one compilation.  ``attention_impl`` ("xla" | "pallas") and ``kernel_platform``
    ("tpu" | "gpu" | "cpu") override both models' configs (``with_kernels``; None keeps them).
    """
    target, drafter = _as_model(target), _as_model(drafter)
    target = with_kernels(target, attention_impl, kernel_platform)
    drafter = with_kernels(drafter, attention_impl, kernel_platform)
    text_prompts = bool(prompts) and all(isinstance(p, str) for p in prompts)
    if chat and not text_prompts:
        raise ValueError("chat=True needs text prompts (one user message per prompt)")
    if text_prompts:
        from dtree_jax.text import encode_prompts

        prompts = encode_prompts(target.path, prompts, chat=chat)
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("need at least one prompt, and every prompt needs at least one token")
    vocab = target.cfg.vocab_size
    for i, p in enumerate(prompts):
        bad = [t for t in p if not 0 <= int(t) < vocab]
        if bad:
            raise ValueError(f"prompt {i} has token ids outside [0, {vocab}): {bad[:5]}")
    longest = max(len(p) for p in prompts)
    prompt_bucket = _bucket(longest) if prompt_bucket is None else prompt_bucket
    if prompt_bucket < longest:
        raise ValueError(f"prompt_bucket {prompt_bucket} is shorter than the longest prompt ({longest})")
    if stop_ids is None:
        stop_ids = target.eos_token_ids
    if budget == "auto":
        budget = auto_budget(_load_calibration(calibration, drafter), len(prompts))
    spec = make_spec(
        target, drafter, method, budget=budget, node_topk=node_topk, corr_topm=corr_topm, max_depth=max_depth,
        max_new_tokens=max_new_tokens, prompt_bucket=prompt_bucket, stop_ids=stop_ids, top_k=top_k, top_p=top_p,
        cache_len=cache_len,
    )
    padded = np.zeros((len(prompts), prompt_bucket), np.int32)
    for i, p in enumerate(prompts):
        padded[i, : len(p)] = p
    lens = np.asarray([len(p) for p in prompts], np.int32)
    key = jax.random.key(seed)
    temp = jnp.float32(temperature)
    dparams = drafter.params if spec.record.drafts else None
    args = (spec, target.params, dparams, jnp.asarray(padded), jnp.asarray(lens), key, temp)
    stage_seconds = round_trees = None
    if instrument:
        state, stages, round_trees = _run_instrumented(*args)
        compile_seconds = float("nan")
        seconds = sum(sum(v) for v in stages.values())
        stage_seconds = {k: float(np.mean(v)) if v else 0.0 for k, v in stages.items()}
    else:
        compiled, compile_seconds = _compiled(args)
        t1 = time.perf_counter()
        state = jax.block_until_ready(compiled(*args[1:]))
        seconds = time.perf_counter() - t1
    out, out_len = np.asarray(state.out), np.asarray(state.out_len)
    rounds, reasons = np.asarray(state.rounds), np.asarray(state.stop_reason)
    tokens, stats = [], []
    for i in range(len(prompts)):
        toks = out[i, : out_len[i]].tolist()
        tokens.append(toks)
        stats.append(
            dict(
                generated=len(toks),
                rounds=int(rounds[i]),
                tau=(len(toks) - 1) / rounds[i] if rounds[i] else float("nan"),
                seconds=seconds,
                tokens_per_second=len(toks) / seconds if seconds > 0 else float("nan"),
                stop_reason=STOP_REASONS[int(reasons[i])],
                budget=spec.budget if spec.record.tree else None,
            )
        )
    texts = None
    if text_prompts:
        from dtree_jax.text import load_tokenizer

        texts = [load_tokenizer(target.path).decode(t) for t in tokens]
    return Generation(tokens, stats, compile_seconds, stage_seconds, round_trees, texts)


# ----------------------------------------------------------------------------------------------------------
# CLI: dtree-jax generate
# ----------------------------------------------------------------------------------------------------------

SHIPPED_TARGET = "checkpoints/tiny-target"
SHIPPED_DRAFTER = "checkpoints/tiny-domino"


def _shipped(name: str) -> str:
    """Path of a shipped checkpoint, looked up beside the package and in the working directory."""
    import pathlib

    for root in (pathlib.Path(__file__).resolve().parent.parent, pathlib.Path.cwd()):
        if (root / name / "config.json").exists():
            return str(root / name)
    raise ValueError(f"no --target/--drafter given and no shipped checkpoint found at {name}")


def _read_prompts(args, target_path) -> list[list[int]]:
    from dtree_jax.text import encode_prompts

    if args.prompt_ids:
        if args.chat:
            raise ValueError("--chat needs a text prompt (--prompt or --prompts-file), not --prompt-ids")
        try:
            return [[int(t) for t in args.prompt_ids.split(",")]]
        except ValueError:
            raise ValueError(f"--prompt-ids must be comma-separated integers, got {args.prompt_ids!r}") from None
    if args.prompt is None and args.prompts_file is None:
        args.prompt = DEFAULT_PROMPT
    texts = [args.prompt] if args.prompt is not None else open(args.prompts_file).read().splitlines()
    texts = [t for t in texts if t.strip()] if args.prompts_file else texts
    return encode_prompts(target_path, texts, chat=args.chat)


def _run_cli(args) -> int:
    import json
    import sys

    from dtree_jax.text import load_tokenizer

    shipped = args.target is None
    target_path = args.target or _shipped(SHIPPED_TARGET)
    drafts = builders.get_method(args.method).drafts
    drafter_path = args.drafter or (_shipped(SHIPPED_DRAFTER) if drafts else None)
    target = _as_model(target_path)
    drafter = _as_model(drafter_path) if drafter_path else None
    tokenizer = load_tokenizer(target.path)
    prompts = _read_prompts(args, target.path)
    knobs = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                 max_new_tokens=args.max_new_tokens, attention_impl=args.attention_impl,
                 kernel_platform=args.kernel_platform)
    result = generate(target, prompts, args.method, drafter, budget=args.budget, node_topk=args.k, corr_topm=args.m,
                      **knobs)
    compare = shipped if args.compare_ar is None else args.compare_ar
    baseline = generate(target, prompts, "ar", **knobs) if compare and drafts else None
    for i, (toks, st) in enumerate(zip(result.tokens, result.stats)):
        text = tokenizer.decode(toks) if tokenizer is not None else None
        speedup = st["tokens_per_second"] / baseline.stats[i]["tokens_per_second"] if baseline else None
        if args.json:
            print(json.dumps(dict(tokens=toks, text=text, rounds=st["rounds"], tau=st["tau"], seconds=st["seconds"],
                                  tokens_per_second=st["tokens_per_second"], stop_reason=st["stop_reason"],
                                  budget=st["budget"], speedup_vs_ar=speedup)))
            continue
        sys.stdout.write((text if text is not None else " ".join(map(str, toks))) + "\n")
        label = args.method if st["budget"] is None else f"{args.method} budget {st['budget']}"
        line = (f"[{label}] {st['generated']} tokens in {st['rounds']} rounds, tau {st['tau']:.2f}, "
                f"{st['tokens_per_second']:.1f} tok/s")
        if speedup is not None:
            line += f", {speedup:.2f}x ar ({baseline.stats[i]['tokens_per_second']:.1f} tok/s)"
        print(line + f", stop: {st['stop_reason']}", file=sys.stderr)
    return 0


DEFAULT_PROMPT = "import os\nimport sys\n\n\ndef main(argv=None):\n    "


def _budget_arg(value: str):
    if value == "auto":
        return value
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--budget must be an integer or 'auto', got {value!r}") from None


def add_cli(sub) -> None:
    p = sub.add_parser("generate", help="generate with a target (and drafter) on device")
    p.add_argument("--target", help="converted or HF target checkpoint, or a GGUF file (default: the shipped pair)")
    p.add_argument("--drafter", help="converted or HF DFlash/Domino drafter (default: the shipped pair)")
    p.add_argument("--method", choices=METHODS, default="dominotree")
    p.add_argument("--budget", type=_budget_arg, default=32,
                   help="non-root tree nodes (tree methods), or 'auto' (cost model fed this machine's calibration)")
    p.add_argument("--k", type=int, default=8, help="children per node (node_topk)")
    p.add_argument("--m", type=int, default=None,
                   help="Domino candidate width (0 = full vocabulary; default: full for domino, 64 for dominotree)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--attention-impl", choices=("xla", "pallas"), default=None,
                   help="attention (and tree-GDN verify) implementation: the jnp/XLA path or the Pallas kernels "
                        "(default: the checkpoint config's, xla)")
    p.add_argument("--kernel-platform", choices=("tpu", "gpu", "cpu"), default=None,
                   help="whose kernels --attention-impl pallas runs: tpu (Mosaic), gpu (Triton), cpu (interpret "
                        "mode) (default: the platform this runs on)")
    p.add_argument("--compare-ar", action=argparse.BooleanOptionalAction, default=None,
                   help="also run ar on the same prompts and report the speedup (default: on for the shipped pair)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", help="text prompt (uses tokenizer.json of the target)")
    src.add_argument("--prompt-ids", help="comma-separated token ids")
    src.add_argument("--prompts-file", help="one text prompt per line")
    p.add_argument("--chat", action="store_true",
                   help="wrap each text prompt as a user message in the checkpoint's chat template")
    p.add_argument("--json", action="store_true", help="one JSON object per request")
    p.set_defaults(func=_run_cli)
