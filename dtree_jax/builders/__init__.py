"""Draft-tree builders: the method registry, scorers (marginal, Domino conditional, condstatic), the host heap
reference and the jitted frontier builder, and ``build_tree`` which composes them per method."""

from dtree_jax.builders.frontier import frontier_tree, lane_widths
from dtree_jax.builders.heap import best_first, heap_tree
from dtree_jax.builders.methods import (
    BUILDERS,
    REGISTRY,
    Method,
    ScorerFactory,
    build_tree,
    chain_draft,
    get_method,
    register_method,
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
    "REGISTRY",
    "Method",
    "ScorerFactory",
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
    "register_method",
    "heap_tree",
    "lane_widths",
    "marginal_scorer",
]
