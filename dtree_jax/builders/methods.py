"""The method registry (``REGISTRY``: name -> frozen ``Method``) and ``build_tree``, which builds any drafting
method's tree from its scorer.  Adding a method is one registry entry.

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

import jax
import jax.numpy as jnp

from dtree_jax.builders.frontier import frontier_tree
from dtree_jax.builders.heap import heap_tree
from dtree_jax.builders.scorers import (
    DominoScorer,
    DraftRound,
    chain_menus,
    condstatic_scorer,
    domino_scorer,
    marginal_scorer,
)
from dtree_jax.models.domino_head import DominoHead
from dtree_jax.tree import Tree, chain_tree

@dataclasses.dataclass(frozen=True)
class Method:
    """One decoding method: which scorer rates its drafts, and whether it verifies a tree or a chain.

    ``scorer``: "marginal" (per-depth top-k of the base logits), "domino" (the GRU correction along each
    node's own path), "condstatic" (the correction once per depth along the greedy chain), or None (``ar``:
    no drafter).  ``tree``: a best-first tree of ``budget`` non-root nodes, else the greedy chain of
    ``min(max_depth, K)`` drafts.  ``corr_topm``: the default candidate width M, the reference's (specforge's
    Domino chain corrects over the full vocabulary, 0; Domino-Tree's builder over the top 64).
    """

    name: str
    scorer: str | None
    tree: bool = False
    corr_topm: int = 0

    @property
    def drafts(self) -> bool:
        return self.scorer is not None

    @property
    def needs_head(self) -> bool:
        """Whether it needs a Domino drafter (the GRU correction head)."""
        return self.scorer in ("domino", "condstatic")

    def draft_nodes(self, budget: int, depth: int) -> int:
        """Non-root nodes of a round's draft: ``budget`` for trees, ``depth`` for chains, 0 for ``ar``."""
        return 0 if not self.drafts else budget if self.tree else depth


REGISTRY = {
    m.name: m
    for m in (
        Method("ar", None),
        Method("dflash", "marginal"),
        Method("domino", "domino"),
        Method("ddtree", "marginal", tree=True),
        Method("dominotree", "domino", tree=True, corr_topm=64),
        Method("condstatic", "condstatic", tree=True, corr_topm=64),  # the section 4.8 ablation
    )
}
DRAFT_METHODS = tuple(name for name, m in REGISTRY.items() if m.drafts)  # what build_tree builds
TREE_METHODS = tuple(name for name, m in REGISTRY.items() if m.tree)
BUILDERS = ("frontier", "heap")


def get_method(name: str) -> Method:
    """The registered method called ``name``; ValueError naming the known ones otherwise."""
    if name not in REGISTRY:
        raise ValueError(f"unknown method {name!r}; expected one of {tuple(REGISTRY)}")
    return REGISTRY[name]


def make_scorer(
    method: str, rnd: DraftRound, head: DominoHead | None, embed: jax.Array | None, *, k: int, M: int, P: int
):
    """The method's scorer for this round (no validation; see ``build_tree``)."""
    scorer = get_method(method).scorer
    if scorer == "marginal":
        return marginal_scorer(rnd, k=k)
    if scorer == "domino":
        return domino_scorer(rnd, head, embed, k=k, M=M, P=P)
    return condstatic_scorer(rnd, head, embed, k=k, M=M, P=P)


def chain_draft(scorer, root: jax.Array, *, max_depth: int) -> Tree:  # root [B]
    """The scorer's greedy chain as a ``Tree`` of ``min(max_depth, K) + 1`` nodes, scores cumulative."""
    menus = chain_menus(scorer, max_depth)
    lp = menus.logprobs[:, :, 0]
    zero = jnp.zeros((lp.shape[0], 1), jnp.float32)
    tokens = jnp.concatenate([jnp.asarray(root, jnp.int32)[:, None], menus.tokens[:, :, 0]], axis=-1)
    return chain_tree(tokens, jnp.concatenate([zero, jnp.cumsum(lp, axis=-1)], axis=-1))


@functools.partial(jax.jit, static_argnames=("method", "budget", "k", "M", "P", "max_depth", "mask_token_id"))
def jitted_build(method, rnd, head, embed, *, budget, k, M, P, max_depth, mask_token_id):
    """The jitted frontier / chain builder behind ``build_tree`` (validated knobs; one compilation per static
    knobs and shapes)."""
    if not get_method(method).tree:
        scorer = make_scorer(method, rnd, head, embed, k=1, M=M, P=P)
        return chain_draft(scorer, rnd.root, max_depth=max_depth)
    scorer = make_scorer(method, rnd, head, embed, k=k, M=M, P=P)
    return frontier_tree(scorer, rnd.root, budget=budget, max_depth=max_depth, mask_token_id=mask_token_id)


@functools.partial(jax.jit, static_argnames=("method", "k", "M", "P"))
def _round_tables(method, rnd, head, embed, *, k, M, P):
    """The scorer's per-round arrays; the weights are left out so that jit does not copy them."""
    scorer = make_scorer(method, rnd, head, embed, k=k, M=M, P=P)
    return dataclasses.replace(scorer, head=None, embed=None) if isinstance(scorer, DominoScorer) else scorer


def _host_scorer(method, rnd, head, embed, *, k, M, P):
    """``make_scorer`` computed in one jitted call, for the host heap."""
    scorer = _round_tables(method, rnd, head, embed, k=k, M=M, P=P)
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
    method's); ``pure_draft_prefix_len`` (P): uncorrected leading depths;
    ``max_depth``: ledger depths used (default K); ``mask_token_id``: dead-leaf token (tree methods).
    ``builder``: ``"frontier"`` (one jit, batched, no host syncs) or ``"heap"`` (host reference, same tree on
    tie-free inputs).  ``head``/``embed`` are required by the Domino methods.  Raises ValueError on bad input.
    Callable inside ``jax.jit`` with the frontier builder (all checks are on shapes and Python values).
    """
    spec = get_method(method)
    if not spec.drafts:
        raise ValueError(f"method {method!r} drafts nothing; expected one of {DRAFT_METHODS}")
    if builder not in BUILDERS:
        raise ValueError(f"unknown builder {builder!r}; expected one of {BUILDERS}")
    b, depth, vocab = _check_round(rnd, head, embed, needs_head=spec.needs_head)
    max_depth = depth if max_depth is None else max_depth
    corr_topm = spec.corr_topm if corr_topm is None else corr_topm
    knobs = {"budget": (budget, 1), "node_topk": (node_topk, 1), "max_depth": (max_depth, 1),
             "corr_topm": (corr_topm, 0), "pure_draft_prefix_len": (pure_draft_prefix_len, 0)}
    for name, (value, low) in knobs.items():
        if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < low:
            raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    budget, k, max_depth, M, P = (int(v) for v, _ in knobs.values())
    if M > vocab:
        raise ValueError(f"corr_topm = {M} exceeds the vocabulary size {vocab}")
    k = min(k, M) if M > 0 else k
    if k > vocab:
        raise ValueError(f"node_topk = {k} exceeds the vocabulary size {vocab}")
    if spec.tree:
        if not isinstance(mask_token_id, numbers.Integral) or not 0 <= mask_token_id < vocab:
            raise ValueError(f"mask_token_id must be a token id in [0, {vocab}), got {mask_token_id!r}")
        mask_token_id = int(mask_token_id)
    else:
        mask_token_id = None
    if builder == "heap" and spec.tree:
        scorer = _host_scorer(method, rnd, head, embed, k=k, M=M, P=P)
        return heap_tree(scorer, rnd.root, budget=budget, max_depth=max_depth, mask_token_id=mask_token_id)
    return jitted_build(
        method, rnd, head, embed,
        budget=budget, k=k, M=M, P=P, max_depth=max_depth, mask_token_id=mask_token_id,
    )


def _check_round(rnd: DraftRound, head, embed, *, needs_head: bool) -> tuple[int, int, int]:
    """Validates shapes; returns (B, K, V)."""
    ph, base = jnp.shape(rnd.ph), jnp.shape(rnd.base)
    if len(ph) != 3 or len(base) != 3 or ph[:2] != base[:2]:
        raise ValueError(f"need ph [B, K, H] and base [B, K, V] with matching B, K; got ph {ph}, base {base}")
    b, depth, hidden = ph
    vocab = base[2]
    if depth < 1 or vocab < 1:
        raise ValueError(f"need K >= 1 draft rows and a non-empty vocabulary; got ph {ph}, base {base}")
    if jnp.shape(rnd.root) != (b,):
        raise ValueError(f"root must be [B] = [{b}], got {jnp.shape(rnd.root)}")
    if not needs_head:
        return b, depth, vocab
    if head is None or embed is None:
        raise ValueError("the Domino methods need the DominoHead and the target embedding table")
    g = head.gru_dim
    if jnp.shape(embed) != (vocab, hidden):
        raise ValueError(f"embed must be [V, H] = [{vocab}, {hidden}], got {jnp.shape(embed)}")
    if head.hidden_dim != hidden or jnp.shape(head.w2)[0] != vocab or jnp.shape(head.w1)[0] != hidden + g:
        raise ValueError(
            f"DominoHead does not fit H = {hidden}, V = {vocab}: w_ih {jnp.shape(head.w_ih)}, "
            f"w1 {jnp.shape(head.w1)}, w2 {jnp.shape(head.w2)}"
        )
    if jnp.shape(rnd.root_state) != (b, g):
        raise ValueError(f"root_state must be [B, G] = [{b}, {g}], got {jnp.shape(rnd.root_state)}")
    return b, depth, vocab
