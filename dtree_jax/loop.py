"""One jitted generation on device: prefill, then ``lax.while_loop`` rounds of
draft -> build tree -> verify -> accept -> commit, for every method.

Methods differ only in the tree they verify (``builders.REGISTRY``): ``ar`` verifies the root alone,
the chain methods the drafter's greedy block, the tree methods a best-first tree.  Shapes are static per
(batch, prompt bucket, tree size); everything else (lengths, acceptance, stops) is data, so a second prompt
of the same bucket reuses the compiled loop.  The drafter's context length always equals the target's
committed length ``lens``: the root is the last committed token, whose features are not known until it is
verified.  ``dtree_jax.api`` builds a ``Spec`` and calls ``generate_on_device``.

Under a mesh (``Spec.mesh``) nothing here changes but ``constrain_state``: the caller places the params on the
mesh (``models.sharding.place``) and traces inside ``jax.set_mesh(spec.mesh)``, which the Pallas kernels read to
run per shard.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from dtree_jax import builders
from dtree_jax.models import sharding
from dtree_jax.models.sharding import axes
from dtree_jax.tree import Tree, chain_tree
from dtree_jax.verify import accept_sampled, sample_tokens

STOP_RUNNING, STOP_EOS, STOP_MAX_NEW, STOP_CAPACITY = 0, 1, 2, 3
STOP_REASONS = {STOP_RUNNING: "running", STOP_EOS: "eos", STOP_MAX_NEW: "max_new_tokens", STOP_CAPACITY: "capacity"}


@dataclasses.dataclass(frozen=True)
class Spec:
    """Everything static about one compiled generation."""

    target: Any  # the target's implementation (``models.protocol.TargetModel``): a module or a hashable object
    target_cfg: Any
    drafter: Any  # the drafter's implementation (``models.protocol.DrafterModel``); None for ar
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
    mesh: Any = None  # a jax.sharding.Mesh (axes "data", "model"): state constrained to its leaves' declared axes
    stream: bool = False  # hand every round's committed tokens to the host as they are committed (``streaming``)
    draft_vocab: Any = None  # a ``drafter.DraftVocab`` for programs with baked weights (``unshared_heads``); None: all
    cpu_kernel: bool = True  # baked CPU programs: dense dots on ``cpu_dot``'s kernel (where it builds), else XLA's

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
    def draft_depth(self) -> int:
        """Draft rows a round uses: the deepest tree depth it can reach (a tree of ``budget`` nodes reaches no
        deeper than ``budget``), so the drafter's output head runs on no row the builder cannot use."""
        return min(self.max_depth, self.budget) if self.record.tree else self.max_depth

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
    lens: jax.Array = axes("batch")  # [B] committed tokens in the target cache (= drafter context length)
    root: jax.Array = axes("batch")  # [B] last emitted token (not yet in the cache)
    out: jax.Array = axes("batch", None)  # [B, max_new + N] generated tokens, -1 padded
    out_len: jax.Array = axes("batch")  # [B]
    done: jax.Array = axes("batch")  # [B] bool
    stop_reason: jax.Array = axes("batch")  # [B] int32, STOP_*
    rounds: jax.Array = axes("batch")  # [B] rounds run while active
    step: jax.Array = axes()  # [] round counter
    key: jax.Array = axes("batch")  # [B] one random stream per request


def constrain_state(spec: Spec, state: DecodeState) -> DecodeState:
    """Pins the caches and per-request vectors to their shardings on ``spec.mesh`` (``models.sharding``), so
    the while loop's carry keeps one layout; the identity without a mesh."""
    if spec.mesh is None:
        return state
    cache = sharding.constrain(state.cache, spec.mesh, spec.target_cfg)
    dcache = sharding.constrain(state.dcache, spec.mesh, spec.drafter_cfg)
    rest = sharding.constrain(dataclasses.replace(state, cache=None, dcache=None), spec.mesh)
    return dataclasses.replace(rest, cache=cache, dcache=dcache)


# ----------------------------------------------------------------------------------------------------------
# Streaming: committed tokens to the host while the loop runs
# ----------------------------------------------------------------------------------------------------------

_SINKS: list[Callable[[np.ndarray, np.ndarray], None]] = []  # innermost ``streaming`` context last


@contextlib.contextmanager
def streaming(sink: Callable[[np.ndarray, np.ndarray], None]):
    """While open, a generation compiled with ``Spec.stream`` calls ``sink(tokens [B, T], num [B])`` on the
    host each time tokens are committed (the root after prefill, then every round): request b's new tokens are
    ``tokens[b, :num[b]]``, in order.  A generation without ``Spec.stream`` is a different program with no host
    call in it, so not streaming costs nothing."""
    _SINKS.append(sink)
    try:
        yield
    finally:
        _SINKS.remove(sink)


def _emit(tokens, num) -> None:
    if _SINKS:
        _SINKS[-1](np.asarray(tokens), np.asarray(num))


def stream_tokens(spec: Spec, tokens: jax.Array, num: jax.Array) -> None:  # [B, T] int32, [B] int32
    """Hands ``tokens[b, :num[b]]`` to the host sink (in commit order) when ``spec.stream``; nothing otherwise."""
    if spec.stream:
        jax.debug.callback(_emit, tokens, num, ordered=True)


def split_keys(keys: jax.Array) -> tuple[jax.Array, jax.Array]:  # [B] -> ([B], [B])
    """Advances every request's stream: (the stream's next state, a key to draw with now)."""
    pairs = jax.vmap(jax.random.split)(keys)
    return pairs[:, 0], pairs[:, 1]


# ----------------------------------------------------------------------------------------------------------
# One round, stage by stage (shared by the while loop and the instrumented mode)
# ----------------------------------------------------------------------------------------------------------


def unshared_heads(spec: Spec, tparams, dparams) -> tuple:
    """The weights a program bakes in (``cpu_options.compile_here``'s ``bake``): the drafter gets its own copy of
    the target's output head (``drafter.with_own_head``; only the draft vocabulary's columns when the spec has
    one), so XLA:CPU packs the draft's and the verify's heads."""
    if dparams is None or not spec.record.drafts:
        return tparams, dparams
    return tparams, spec.drafter.with_own_head(dparams, spec.drafter_cfg, spec.target, tparams, spec.target_cfg,
                                               spec.draft_vocab)


def draft(spec: Spec, tparams, dparams, state: DecodeState) -> builders.DraftRound | None:
    """Drafter block for the current root: ph rows, base logits and the root's GRU state."""
    if not spec.record.drafts:
        return None
    ph, base, root_state, vocab_ids = spec.drafter.draft_round(
        dparams, spec.drafter_cfg, spec.target, tparams, spec.target_cfg, state.dcache, state.lens, state.root,
        rows=spec.draft_depth,
    )
    return builders.DraftRound(ph=ph, base=base, root_state=root_state, root=state.root, vocab_ids=vocab_ids)


def build_tree(spec: Spec, tparams, dparams, rnd: builders.DraftRound | None, state: DecodeState) -> Tree:
    if not spec.record.drafts:
        return chain_tree(state.root[:, None])
    return builders.build_tree(
        spec.method,
        rnd,
        budget=spec.num_nodes - 1,
        node_topk=spec.node_topk,
        corr_topm=spec.corr_topm,
        max_depth=spec.draft_depth,
        **spec.drafter.tree_inputs(dparams, spec.drafter_cfg, spec.target, tparams),
    )


def write_lens(spec: Spec, state: DecodeState) -> jax.Array:  # [B]
    """Where this round writes its N tree rows: ``lens``, clamped for finished rows so that their (discarded)
    writes stay inside the cache instead of being shifted onto committed rows."""
    return jnp.where(state.done, jnp.minimum(state.lens, spec.cache_len - spec.num_nodes), state.lens)


def verify(spec: Spec, tparams, tree: Tree, state: DecodeState):
    """One target pass over the tree; done rows run on a clamped slot and are discarded later."""
    lens = write_lens(spec, state)
    return spec.target.forward(
        tparams, spec.target_cfg, tree.tokens, tree.positions(lens), state.cache, lens, tree.mask, spec.taps
    )


def accept_commit(spec: Spec, dparams, tree: Tree, logits, feats, cache, state: DecodeState, temperature):
    """Acceptance, stop checks, KV compaction, drafter context update and output append."""
    key, sub = split_keys(state.key)
    acc = accept_sampled(tree.parents, tree.tokens, logits, sub, temperature, spec.top_k, spec.top_p)
    pos = jnp.arange(spec.num_nodes)
    active = ~state.done
    num, reason = stop_rule(spec, acc.emitted, acc.num_emitted, state.out_len, active)
    # Commit the root and the accepted drafts (path[:num]); the bonus becomes the next root.
    cache = spec.target.commit(spec.target_cfg, cache, state.lens, acc.path, num)
    dcache = state.dcache
    if spec.drafter_cfg is not None:
        path_feats = jnp.take_along_axis(feats, jnp.clip(acc.path, 0)[:, :, None], axis=1)
        ctx_lens = write_lens(spec, state)
        dcache = spec.drafter.append_context(
            dparams, spec.drafter_cfg, dcache, ctx_lens, path_feats, ctx_lens[:, None] + pos
        )
    written = jnp.where(pos < num[:, None], acc.emitted, -1)
    stream_tokens(spec, written, num)
    out = jax.vmap(lambda o, w, at: jax.lax.dynamic_update_slice(o, w, (at,)))(state.out, written, state.out_len)
    last = jnp.take_along_axis(acc.emitted, jnp.maximum(num - 1, 0)[:, None], -1)[:, 0]
    lens = state.lens + num
    reason = capacity_rule(spec, reason, lens)
    return constrain_state(spec, DecodeState(
        cache=cache,
        dcache=dcache,
        lens=lens,
        root=jnp.where(num > 0, last, state.root),
        out=out,
        out_len=state.out_len + num,
        done=state.done | (reason != STOP_RUNNING),
        stop_reason=jnp.where(active, reason, state.stop_reason),
        rounds=state.rounds + active.astype(jnp.int32),
        step=state.step + 1,
        key=key,
    ))


def stop_rule(
    spec: Spec,
    emitted: jax.Array,  # [B, N] int32 tokens emitted this step, in order
    num: jax.Array,  # [B] int32 how many of them are valid
    out_len: jax.Array,  # [B] int32 tokens generated before them
    active: jax.Array,  # [B] bool rows still generating
) -> tuple[jax.Array, jax.Array]:  # (kept [B] int32, reason [B] int32 STOP_*)
    """The stop rule shared by prefill (the root alone) and every round: keep ``emitted[:num]`` up to and
    including the first stop id and within ``max_new_tokens`` (nothing for inactive rows); the reason is
    STOP_EOS, STOP_MAX_NEW or STOP_RUNNING after those tokens."""
    stops = jnp.asarray(spec.stop_ids or (-2,), jnp.int32)
    pos = jnp.arange(emitted.shape[1])
    hit = jnp.any(emitted[..., None] == stops, axis=-1) & (pos < num[:, None])
    first_stop = jnp.where(jnp.any(hit, -1), jnp.argmax(hit, -1) + 1, emitted.shape[1] + 1)
    num = jnp.where(active, jnp.minimum(jnp.minimum(num, first_stop), spec.max_new_tokens - out_len), 0)
    at_max = out_len + num >= spec.max_new_tokens
    reason = jnp.where(num == first_stop, STOP_EOS, jnp.where(at_max, STOP_MAX_NEW, STOP_RUNNING))
    return num, reason.astype(jnp.int32)


def capacity_rule(spec: Spec, reason: jax.Array, lens: jax.Array) -> jax.Array:  # [B] int32, [B] -> [B]
    """STOP_CAPACITY for running rows whose next round would not fit: it needs ``draft_span`` rows past
    ``lens``."""
    return jnp.where((reason == STOP_RUNNING) & (lens + spec.draft_span > spec.cache_len), STOP_CAPACITY, reason)


def decode_round(spec: Spec, tparams, dparams, temperature, state: DecodeState) -> DecodeState:
    """One round: draft -> build -> verify -> accept -> commit."""
    rnd = draft(spec, tparams, dparams, state)
    tree = build_tree(spec, tparams, dparams, rnd, state)
    logits, feats, cache = verify(spec, tparams, tree, state)
    return accept_commit(spec, dparams, tree, logits, feats, cache, state, temperature)


# ----------------------------------------------------------------------------------------------------------
# Prefill and the whole generation
# ----------------------------------------------------------------------------------------------------------


def prefill(
    spec: Spec,
    tparams,
    dparams,
    prompts: jax.Array,  # [B, P] int32, right-padded
    prompt_lens: jax.Array,  # [B] int32
    key: jax.Array,  # [B] one key per request (``request_keys``)
    temperature: jax.Array,  # [] fp32 (0 = greedy)
) -> DecodeState:
    """The target reads the prompts, the root is sampled from their last logits, the drafter's context gets
    the prompts' feature taps."""
    b, p = prompts.shape
    tg = spec.target
    cache = sharding.constrain(tg.init_cache(spec.target_cfg, b, spec.cache_len), spec.mesh, spec.target_cfg)
    zeros = jnp.zeros((b,), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
    logits, feats, cache = tg.prefill(tparams, spec.target_cfg, prompts, cache, prompt_lens, spec.taps)
    key, sub = split_keys(key)
    last_logits = jnp.take_along_axis(logits, (prompt_lens - 1)[:, None, None], axis=1)[:, 0]
    root = sample_tokens(sub, last_logits, temperature, spec.top_k, spec.top_p)
    dcache = None
    if spec.drafter_cfg is not None:
        dcache = spec.drafter.init_drafter_cache(spec.drafter_cfg, b, spec.cache_len)
        dcache = sharding.constrain(dcache, spec.mesh, spec.drafter_cfg)
        dcache = spec.drafter.append_context(dparams, spec.drafter_cfg, dcache, zeros, feats, positions)
    out = jnp.full((b, spec.max_new_tokens + spec.num_nodes), -1, jnp.int32).at[:, 0].set(root)
    ones = jnp.ones((b,), jnp.int32)
    _, reason = stop_rule(spec, root[:, None], ones, zeros, ones > 0)
    stream_tokens(spec, root[:, None], ones)
    reason = capacity_rule(spec, reason, prompt_lens)
    return constrain_state(spec, DecodeState(
        cache=cache,
        dcache=dcache,
        lens=prompt_lens,
        root=root,
        out=out,
        out_len=ones,
        done=reason != STOP_RUNNING,
        stop_reason=reason,
        rounds=jnp.zeros((b,), jnp.int32),
        step=jnp.int32(0),
        key=key,
    ))


def generate_loop(spec: Spec, tparams, dparams, prompts, prompt_lens, key, temperature) -> DecodeState:
    """Prefill, then rounds until every row stopped (``prefill``'s arguments)."""
    state = prefill(spec, tparams, dparams, prompts, prompt_lens, key, temperature)
    return jax.lax.while_loop(
        lambda s: jnp.any(~s.done) & (s.step < spec.max_new_tokens),
        lambda s: decode_round(spec, tparams, dparams, temperature, s),
        state,
    )


generate_on_device = jax.jit(generate_loop, static_argnums=0)
prefill_on_device = jax.jit(prefill, static_argnums=0)

