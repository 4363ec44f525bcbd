"""Children scorers: the one piece every builder (heap, frontier, chain) shares.

A scorer answers "which k children does a node at ledger depth ``d`` get, with which log-probs, and what are
their path states?", batched over requests ``B`` and lanes ``W`` (nodes scored in lockstep).  Ledger depth
``d`` = tree depth - 1: ``ph[:, d]`` and ``base[:, d]`` predict the node at tree depth ``d + 1``.

Protocol (duck-typed; every scorer is a registered dataclass pytree, static knobs as meta fields):
  * ``k`` (children per node), ``num_depths`` (K), ``initial_state`` ``[B, S]`` (the root's path state);
  * ``scores(d, state [B, W, S]) -> (tokens [B, W, k] int32, logprobs [B, W, k] f32)``, ``d`` a Python int
    or, from ``first_dynamic_depth`` on, a traced int32 scalar (the frontier's ``lax.scan`` over depths),
    children sorted by descending log-prob (stable top-k: equal values keep the lower token/candidate index);
  * ``advance(state [..., S], tokens [...]) -> [..., S]``: the path state after appending ``tokens``;
  * ``request(b)``: the same scorer restricted to request ``b`` (batch 1), for the host heap.

Two kinds: ``MenuScorer`` (path-independent per-depth menus, state width 0: the DDTree marginal scorer and
the "condstatic" ablation) and ``DominoScorer`` (Domino's GRU correction along each node's own path).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from dtree_jax.models.domino_head import DominoHead, correction_hidden, corrected_logits, gru_step
from dtree_jax.models import sharding


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DraftRound:
    """One round of drafter output (after the shift_label slice)."""

    ph: jax.Array  # [B, K, H] draft hidden rows; row d predicts tree depth d + 1
    base: jax.Array  # [B, K, V] base logits = target lm_head(ph); [B, K, V'] over a draft vocabulary
    root_state: jax.Array  # [B, G] fp32 GRU state after the root token: gru_step(head, 0, embed[root])
    root: jax.Array  # [B] int32 root (last committed) token ids
    # [V'] int32 sorted token ids of base's columns when the drafter proposes only a draft vocabulary (every
    # other token's logit is -inf, never widened: the scorers take top-k over the V' columns); None: all V
    vocab_ids: jax.Array | None = None

    @property
    def batch(self) -> int:
        return self.ph.shape[0]

    @property
    def num_depths(self) -> int:
        return self.ph.shape[1]


def _top_k(
    x: jax.Array, k: int, ids: jax.Array | None = None  # [..., V], [V] int32 token id of each column or None
) -> tuple[jax.Array, jax.Array]:  # ([..., k], [..., k] int32 token ids)
    """Stable ``lax.top_k`` behind an optimisation barrier: when only slices of a top-k over a large
    vocabulary are used later, XLA:CPU otherwise rewrites it into a full sort (~100x slower at V = 151936).
    Under a mesh the rows are gathered first (``sharding.whole_last_axis``).  With ``ids`` (sorted, so equal
    values still keep the lower token id) the indices are mapped to token ids."""
    if jax.sharding.get_abstract_mesh().empty:
        vals, idx = jax.lax.optimization_barrier(jax.lax.top_k(x, k))
    else:
        vals, idx = jax.lax.top_k(sharding.whole_last_axis(x), k)
    idx = idx.astype(jnp.int32)
    return vals, idx if ids is None else jnp.take(ids, idx)


def _top_k_logprobs(logits: jax.Array, k: int, ids: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Stable top-k of ``log_softmax(logits [..., V])`` in fp32: (token ids [..., k] int32, log-probs); ``ids``
    as for ``_top_k``."""
    lp, idx = _top_k(jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1), k, ids)
    return idx, lp


# ----------------------------------------------------------------------------------------------------------
# Path-independent menus: marginal (DDTree) and condstatic
# ----------------------------------------------------------------------------------------------------------


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MenuScorer:
    """Every node at ledger depth ``d`` gets the same children ``tokens[:, d]`` with ``logprobs[:, d]``."""

    tokens: jax.Array  # [B, K, k] int32
    logprobs: jax.Array  # [B, K, k] f32, descending along k

    @property
    def k(self) -> int:
        return self.tokens.shape[-1]

    @property
    def num_depths(self) -> int:
        return self.tokens.shape[1]

    first_dynamic_depth = 0  # any depth may be traced

    @property
    def initial_state(self) -> jax.Array:  # [B, 0]: no path state
        return jnp.zeros((self.tokens.shape[0], 0), jnp.float32)

    def scores(self, d: int, state: jax.Array) -> tuple[jax.Array, jax.Array]:  # [B, W, 0] -> 2x [B, W, k]
        shape = state.shape[:2] + (self.k,)
        return (
            jnp.broadcast_to(self.tokens[:, d, None], shape),
            jnp.broadcast_to(self.logprobs[:, d, None], shape),
        )

    def advance(self, state: jax.Array, tokens: jax.Array) -> jax.Array:  # [..., 0], [...] -> [..., 0]
        return jnp.zeros(tokens.shape + (0,), jnp.float32)

    def request(self, b: int) -> "MenuScorer":
        return MenuScorer(self.tokens[b : b + 1], self.logprobs[b : b + 1])


def marginal_scorer(rnd: DraftRound, *, k: int) -> MenuScorer:
    """DDTree's factorised scorer: per depth, the top-k of the full-vocabulary ``log_softmax(base[:, d])`` (over
    a draft vocabulary's columns where the round has one)."""
    return MenuScorer(*_top_k_logprobs(rnd.base, k, rnd.vocab_ids))


# ----------------------------------------------------------------------------------------------------------
# Domino's conditional scorer
# ----------------------------------------------------------------------------------------------------------


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DominoScorer:
    """Children scored by ``base[d] + W2 . SiLU(W1 . [ph[d] ; s])`` with ``s`` the node's own path state.

    Depths ``d < pure_depths`` use the uncorrected full-vocabulary menus ``prefix``.  With ``cand`` set (M > 0) the
    correction is evaluated on the round's top-M candidates of the uncorrected ``base[d]`` and the log-softmax
    is renormalised over those M; with ``cand is None`` (M = 0) it spans the full vocabulary.
    """

    head: DominoHead  # with M = 0 over a draft vocabulary its w2 holds that vocabulary's rows only: [V', E]
    embed: jax.Array  # [V, H] target embedding table (the GRU's inputs)
    ph: jax.Array  # [B, K, H]
    root_state: jax.Array  # [B, G]
    prefix: MenuScorer  # menus for d < min(pure_depths, K): tokens/logprobs [B, min(pure_depths, K), k]
    logits: jax.Array  # [B, K, M] base at the candidates (fp32), or [B, K, V] base when cand is None
    cand: jax.Array | None  # [B, K, M] int32 candidate token ids, None for full vocabulary
    w2c: jax.Array | None  # [B, K, M, E] fp32 W2 rows of the candidates, None for full vocabulary
    k: int = dataclasses.field(metadata=dict(static=True))
    pure_depths: int = dataclasses.field(metadata=dict(static=True))
    vocab_ids: jax.Array | None = None  # [V'] int32 (``DraftRound.vocab_ids``): logits' columns when cand is None

    @property
    def num_depths(self) -> int:
        return self.ph.shape[1]

    @property
    def initial_state(self) -> jax.Array:  # [B, G]
        return self.root_state.astype(jnp.float32)

    @property
    def first_dynamic_depth(self) -> int:  # the uncorrected prefix depths are chosen by a Python branch
        return self.pure_depths

    def scores(self, d, state: jax.Array) -> tuple[jax.Array, jax.Array]:  # [B, W, G] -> 2x [B, W, k]
        if isinstance(d, int) and d < self.pure_depths:
            return self.prefix.scores(d, state)
        ph = self.ph[:, d, None]  # [B, 1, H], broadcast over lanes
        if self.cand is None:
            corr = corrected_logits(self.head, self.logits[:, d, None], ph, state)
            return _top_k_logprobs(corr, self.k, self.vocab_ids)
        hid = correction_hidden(self.head, ph, state)  # [B, W, E]
        corr = self.logits[:, d, None] + jnp.einsum("bwe,bme->bwm", hid, self.w2c[:, d])  # [B, W, M]
        j, lp = _top_k_logprobs(corr, self.k)
        cand = jnp.broadcast_to(self.cand[:, d, None], corr.shape)
        return jnp.take_along_axis(cand, j, axis=-1), lp

    def advance(self, state: jax.Array, tokens: jax.Array) -> jax.Array:  # [..., G], [...] -> [..., G]
        return gru_step(self.head, state, jnp.take(self.embed, tokens, axis=0))

    def request(self, b: int) -> "DominoScorer":
        def one(x):
            return None if x is None else x[b : b + 1]

        return dataclasses.replace(
            self,
            ph=one(self.ph),
            root_state=one(self.root_state),
            prefix=self.prefix.request(b),
            logits=one(self.logits),
            cand=one(self.cand),
            w2c=one(self.w2c),
        )


def domino_scorer(
    rnd: DraftRound, head: DominoHead, embed: jax.Array, *, k: int, M: int, pure_depths: int
) -> DominoScorer:
    """Per-round setup of Domino's conditional scorer (§4.2): prefix menus, top-M candidates, W2 rows.

    ``k`` must already satisfy ``k <= M`` when ``M > 0`` (``build_tree`` clamps it).
    """
    base = rnd.base.astype(jnp.float32)
    prefix = MenuScorer(*_top_k_logprobs(base[:, : min(pure_depths, rnd.num_depths)], k, rnd.vocab_ids))
    if M > 0:
        logits, cand = _top_k(base, M, rnd.vocab_ids)  # [B, K, M] of the uncorrected base, stable
        w2c = jnp.take(head.w2, cand, axis=0).astype(jnp.float32)  # [B, K, M, E]
    else:
        logits, cand, w2c = base, None, None
        if rnd.vocab_ids is not None:  # W2's rows for the draft vocabulary's columns, gathered once a round
            head = dataclasses.replace(head, w2=jnp.take(head.w2, rnd.vocab_ids, axis=0))
    return DominoScorer(head, embed, rnd.ph, rnd.root_state, prefix, logits, cand, w2c, k=k, pure_depths=pure_depths,
                        vocab_ids=rnd.vocab_ids)


# ----------------------------------------------------------------------------------------------------------
# Composites: eager children, greedy chain menus, condstatic
# ----------------------------------------------------------------------------------------------------------


def children(scorer, d: int, state: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The k children of each lane at ledger depth ``d``: tokens, log-probs ``[B, W, k]`` and child states
    ``[B, W, k, S]`` (one batched GRU step for the Domino scorer).  ``state``: ``[B, W, S]``."""
    tokens, lp = scorer.scores(d, state)
    return tokens, lp, scorer.advance(state[..., None, :], tokens)


def chain_menus(scorer, depths: int | None = None) -> MenuScorer:
    """The scorer's menus along its own greedy chain, for the first ``depths`` (default all K) ledger depths:
    at every depth the chain node (the previous depth's top-1 child, starting from the root) is scored and its
    path state advanced with its top-1 child.

    ``tokens[:, d, 0]`` is the greedy chain; ``tokens[:, d]`` the k children of the chain node at depth d.
    """
    depths = scorer.num_depths if depths is None else min(depths, scorer.num_depths)
    state = scorer.initial_state[:, None]  # [B, 1, S]
    toks, lps = [], []
    for d in range(depths):
        tok, lp = scorer.scores(d, state)  # [B, 1, k]
        toks.append(tok[:, 0])
        lps.append(lp[:, 0])
        if d + 1 < depths:
            state = scorer.advance(state, tok[:, :, 0])
    return MenuScorer(jnp.stack(toks, axis=1), jnp.stack(lps, axis=1))


def condstatic_scorer(
    rnd: DraftRound, head: DominoHead, embed: jax.Array, *, k: int, M: int, pure_depths: int
) -> MenuScorer:
    """§4.8 ablation: Domino's correction evaluated once per depth along the greedy Domino chain and shared
    by every node at that depth (same top-M restriction), isolating the effect of path dependence."""
    return chain_menus(domino_scorer(rnd, head, embed, k=k, M=M, pure_depths=pure_depths))
