"""The method registry (``REGISTRY``: name -> frozen ``Method``) and ``build_tree``, which builds any drafting
method's tree from its scorer.  Adding a method is one ``Method`` (its scorer factory and static settings), in
``REGISTRY`` or through ``register_method``.

=============  ==========================================  =========================
method         scorer                                      builder
=============  ==========================================  =========================
``dflash``     marginal (argmax of base per depth), k = 1  greedy chain (K + 1 nodes)
``domino``     Domino conditional (§2.4), k = 1            greedy chain (K + 1 nodes)
``ddtree``     marginal top-k (DDTree)                     best-first, ``budget`` nodes
``dominotree`` Domino conditional, top-M restricted        best-first, ``budget`` nodes
``condstatic`` Domino correction along the greedy chain,   best-first, ``budget`` nodes
               shared per depth (§4.8 ablation)
=============  ==========================================  =========================
"""

from __future__ import annotations

import dataclasses
import functools
import numbers
from typing import Any, Callable

import jax
import jax.numpy as jnp

from dtree_jax.builders.frontier import frontier_tree
from dtree_jax.builders.heap import heap_tree
from dtree_jax.builders.scorers import (
    DominoScorer,
    DraftRound,
    MenuScorer,
    chain_menus,
    condstatic_scorer,
    domino_scorer,
    marginal_scorer,
)
from dtree_jax.models.domino_head import DominoHead
from dtree_jax.tree import Tree, chain_tree

ScorerFactory = Callable[..., Any]  # (rnd, head, embed, *, k, M, pure_depths) -> a scorer (``scorers``' protocol)


def _marginal(rnd: DraftRound, head, embed, *, k: int, M: int, pure_depths: int) -> MenuScorer:
    """``marginal_scorer`` as a ``ScorerFactory`` (it reads only the base logits)."""
    return marginal_scorer(rnd, k=k)


@dataclasses.dataclass(frozen=True)
class Method:
    """One decoding method: the scorer that rates its drafts, and whether it verifies a tree or a chain.

    ``scorer``: the factory of this round's scorer, ``(rnd, head, embed, *, k, M, pure_depths) -> scorer`` (None: ``ar``,
    no drafter); ``needs_head``: whether that scorer reads the Domino GRU head (and the embedding table).
    ``tree``: a best-first tree of ``budget`` non-root nodes, else the greedy chain of ``min(max_depth, K)``
    drafts.  ``corr_topm``: the default candidate width M, the reference's (specforge's Domino chain corrects
    over the full vocabulary, 0; Domino-Tree's builder over the top 64).
    """

    name: str
    scorer: ScorerFactory | None
    needs_head: bool = False
    tree: bool = False
    corr_topm: int = 0

    @property
    def drafts(self) -> bool:
        return self.scorer is not None

    def draft_nodes(self, budget: int, depth: int) -> int:
        """Non-root nodes of a round's draft: ``budget`` for trees, ``depth`` for chains, 0 for ``ar``."""
        return 0 if not self.drafts else budget if self.tree else depth


REGISTRY = {
    m.name: m
    for m in (
        Method("ar", None),
        Method("dflash", _marginal),
        Method("domino", domino_scorer, needs_head=True),
        Method("ddtree", _marginal, tree=True),
        Method("dominotree", domino_scorer, needs_head=True, tree=True, corr_topm=64),
        Method("condstatic", condstatic_scorer, needs_head=True, tree=True, corr_topm=64),  # section 4.8 ablation
    )
}
BUILDERS = ("frontier", "heap")


def register_method(method: Method) -> Method:
    """Adds ``method`` to the registry (every entry point then runs it by name); ValueError if its name is taken
    or its scorer is not callable.  Returns it."""
    if not isinstance(method, Method) or not isinstance(method.name, str) or not method.name:
        raise ValueError(f"expected a Method with a name, got {method!r}")
    if method.name in REGISTRY:
        raise ValueError(f"a method called {method.name!r} is registered already")
    if method.scorer is not None and not callable(method.scorer):
        raise ValueError(f"method {method.name!r}: scorer must be a ScorerFactory (callable), got {method.scorer!r}")
    if method.tree and not method.drafts:
        raise ValueError(f"method {method.name!r}: a tree method needs a scorer")
    REGISTRY[method.name] = method
    return method


def get_method(name: str) -> Method:
    """The registered method called ``name``; ValueError naming the known ones otherwise."""
    if name not in REGISTRY:
        raise ValueError(f"unknown method {name!r}; expected one of {tuple(REGISTRY)}")
    return REGISTRY[name]


def chain_draft(scorer, root: jax.Array, *, max_depth: int) -> Tree:  # root [B]
    """The scorer's greedy chain as a ``Tree`` of ``min(max_depth, K) + 1`` nodes, scores cumulative."""
    menus = chain_menus(scorer, max_depth)
    lp = menus.logprobs[:, :, 0]
    zero = jnp.zeros((lp.shape[0], 1), jnp.float32)
    tokens = jnp.concatenate([jnp.asarray(root, jnp.int32)[:, None], menus.tokens[:, :, 0]], axis=-1)
    return chain_tree(tokens, jnp.concatenate([zero, jnp.cumsum(lp, axis=-1)], axis=-1))


@functools.partial(jax.jit, static_argnames=("method", "budget", "k", "M", "pure_depths", "max_depth", "mask_token_id"))
def jitted_build(method, rnd, head, embed, *, budget, k, M, pure_depths, max_depth, mask_token_id):
    """The jitted frontier / chain builder behind ``build_tree`` (validated knobs; one compilation per static
    knobs and shapes)."""
    record = get_method(method)
    if not record.tree:
        scorer = record.scorer(rnd, head, embed, k=1, M=M, pure_depths=pure_depths)
        return chain_draft(scorer, rnd.root, max_depth=max_depth)
    scorer = record.scorer(rnd, head, embed, k=k, M=M, pure_depths=pure_depths)
    return frontier_tree(scorer, rnd.root, budget=budget, max_depth=max_depth, mask_token_id=mask_token_id)


@functools.partial(jax.jit, static_argnames=("method", "k", "M", "pure_depths"))
def _round_tables(method, rnd, head, embed, *, k, M, pure_depths):
    """The scorer's per-round arrays; the weights are left out so that jit does not copy them."""
    scorer = get_method(method).scorer(rnd, head, embed, k=k, M=M, pure_depths=pure_depths)
    return dataclasses.replace(scorer, head=None, embed=None) if isinstance(scorer, DominoScorer) else scorer


def _host_scorer(method, rnd, head, embed, *, k, M, pure_depths):
    """The method's scorer computed in one jitted call, for the host heap."""
    scorer = _round_tables(method, rnd, head, embed, k=k, M=M, pure_depths=pure_depths)
    return dataclasses.replace(scorer, head=head, embed=embed) if isinstance(scorer, DominoScorer) else scorer


def build_tree(
    method: str,
    rnd: DraftRound,
    head: DominoHead | None = None,
    embed: jax.Array | None = None,  # [V, H]
    *,
    budget: int = 16,
    node_topk: int = 8,
    corr_topm: int | None = None,
    pure_draft_prefix_len: int = 1,
    max_depth: int | None = None,
    mask_token_id: int | None = None,
    builder: str = "frontier",
) -> Tree:
    """Draft tree of one round for every request.

    ``budget``: non-root nodes (trees have ``budget + 1`` nodes; chains ``min(max_depth, K) + 1`` and ignore
    ``budget``, ``node_topk`` and ``builder``); ``node_topk`` (the paper's k): children per node (clamped to
    ``corr_topm`` when it is > 0); ``corr_topm`` (M): correction candidates (0 = full vocabulary; default: the
    method's); ``pure_draft_prefix_len`` (pure_depths): uncorrected leading depths;
    ``max_depth``: ledger depths used (default K); ``mask_token_id``: dead-leaf token (tree methods).
    ``builder``: ``"frontier"`` (one jit, batched, no host syncs) or ``"heap"`` (host reference, same tree on
    tie-free inputs).  ``head``/``embed`` are required by the Domino methods.  Raises ValueError on bad input.
    Callable inside ``jax.jit`` with the frontier builder (all checks are on shapes and Python values).
    """
    record = get_method(method)
    if not record.drafts:
        drafting = tuple(name for name, m in REGISTRY.items() if m.drafts)
        raise ValueError(f"method {method!r} drafts nothing; expected one of {drafting}")
    if builder not in BUILDERS:
        raise ValueError(f"unknown builder {builder!r}; expected one of {BUILDERS}")
    b, depth, width, vocab = _check_round(rnd, head, embed, needs_head=record.needs_head)
    max_depth = depth if max_depth is None else max_depth
    corr_topm = record.corr_topm if corr_topm is None else corr_topm
    knobs = {"budget": (budget, 1), "node_topk": (node_topk, 1), "max_depth": (max_depth, 1),
             "corr_topm": (corr_topm, 0), "pure_draft_prefix_len": (pure_draft_prefix_len, 0)}
    for name, (value, low) in knobs.items():
        if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < low:
            raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    budget, k, max_depth, M, pure_depths = (int(v) for v, _ in knobs.values())
    size = width if vocab is None else vocab  # V where known (a draft vocabulary's V' otherwise)
    if M > size:
        raise ValueError(f"corr_topm = {M} exceeds the vocabulary size {size}")
    k = min(k, M) if M > 0 else k
    if k > size:
        raise ValueError(f"node_topk = {k} exceeds the vocabulary size {size}")
    if rnd.vocab_ids is not None:  # every token outside a draft vocabulary scores -inf: never a candidate
        M, k = min(M, width), min(k, width)
    if record.tree:
        if (not isinstance(mask_token_id, numbers.Integral) or mask_token_id < 0
                or (vocab is not None and mask_token_id >= vocab)):  # V is unknown: a DDTree draft vocabulary
            raise ValueError(f"mask_token_id must be a token id in [0, {vocab or 'V'}), got {mask_token_id!r}")
        mask_token_id = int(mask_token_id)
    else:
        mask_token_id = None
    if builder == "heap" and record.tree:
        scorer = _host_scorer(method, rnd, head, embed, k=k, M=M, pure_depths=pure_depths)
        return heap_tree(scorer, rnd.root, budget=budget, max_depth=max_depth, mask_token_id=mask_token_id)
    return jitted_build(
        method, rnd, head, embed,
        budget=budget, k=k, M=M, pure_depths=pure_depths, max_depth=max_depth, mask_token_id=mask_token_id,
    )


def _check_round(rnd: DraftRound, head, embed, *, needs_head: bool) -> tuple[int, int, int, int | None]:
    """Validates shapes; returns (B, K, the columns of ``base`` (V, or V' over a draft vocabulary), V or None
    where unknown: a draft vocabulary without the embedding table)."""
    ph, base = jnp.shape(rnd.ph), jnp.shape(rnd.base)
    if len(ph) != 3 or len(base) != 3 or ph[:2] != base[:2]:
        raise ValueError(f"need ph [B, K, H] and base [B, K, V] with matching B, K; got ph {ph}, base {base}")
    b, depth, hidden = ph
    width = base[2]
    if depth < 1 or width < 1:
        raise ValueError(f"need K >= 1 draft rows and a non-empty vocabulary; got ph {ph}, base {base}")
    if jnp.shape(rnd.root) != (b,):
        raise ValueError(f"root must be [B] = [{b}], got {jnp.shape(rnd.root)}")
    if rnd.vocab_ids is not None and jnp.shape(rnd.vocab_ids) != (width,):
        raise ValueError(f"vocab_ids must be [V'] = [{width}] (base's columns), got {jnp.shape(rnd.vocab_ids)}")
    vocab = width if rnd.vocab_ids is None else None
    if not needs_head:
        return b, depth, width, vocab
    if head is None or embed is None:
        raise ValueError("the Domino methods need the DominoHead and the target embedding table")
    g = head.gru_dim
    vocab = jnp.shape(embed)[0] if vocab is None else vocab
    if jnp.shape(embed) != (vocab, hidden):
        raise ValueError(f"embed must be [V, H] = [{vocab}, {hidden}], got {jnp.shape(embed)}")
    if head.hidden_dim != hidden or head.w2.shape[0] != vocab or head.w1.shape[0] != hidden + g:
        raise ValueError(
            f"DominoHead does not fit H = {hidden}, V = {vocab}: w_ih {head.w_ih.shape}, "
            f"w1 {head.w1.shape}, w2 {head.w2.shape}"
        )
    if jnp.shape(rnd.root_state) != (b, g):
        raise ValueError(f"root_state must be [B, G] = [{b}, {g}], got {jnp.shape(rnd.root_state)}")
    return b, depth, width, vocab
