"""Draft-tree builders: the method registry, scorers (marginal, Domino conditional, condstatic), the host heap
reference and the jitted frontier builder, and ``build_tree`` which composes them per method."""

from dtree_jax.builders.frontier import frontier_tree, lane_widths
from dtree_jax.builders.heap import best_first, heap_tree
from dtree_jax.builders.methods import (
    BUILDERS,
    DRAFT_METHODS,
    REGISTRY,
    TREE_METHODS,
    Method,
    build_tree,
    chain_draft,
    get_method,
    make_scorer,
)
from dtree_jax.builders.scorers import (
    DominoScorer,
    DraftRound,
    MenuScorer,
    chain_menus,
    children,
    condstatic_scorer,
    domino_scorer,
    marginal_scorer,
)

__all__ = [
    "BUILDERS",
    "DRAFT_METHODS",
    "REGISTRY",
    "TREE_METHODS",
    "Method",
    "DominoScorer",
    "DraftRound",
    "MenuScorer",
    "best_first",
    "build_tree",
    "chain_draft",
    "chain_menus",
    "children",
    "condstatic_scorer",
    "domino_scorer",
    "frontier_tree",
    "get_method",
    "heap_tree",
    "lane_widths",
    "make_scorer",
    "marginal_scorer",
]
