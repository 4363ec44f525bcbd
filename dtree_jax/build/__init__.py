"""Draft-tree builders: scorers (marginal, Domino conditional, condstatic), the host heap reference and the
jitted frontier builder, and ``build_tree`` which composes them per method."""

from dtree_jax.build.frontier import frontier_tree, lane_widths
from dtree_jax.build.heap import best_first, heap_tree
from dtree_jax.build.methods import (
    BUILDERS,
    CHAIN_METHODS,
    METHODS,
    TREE_METHODS,
    build_tree,
    chain_draft,
    default_corr_topm,
    make_scorer,
)
from dtree_jax.build.scorers import (
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
    "CHAIN_METHODS",
    "METHODS",
    "TREE_METHODS",
    "DominoScorer",
    "DraftRound",
    "MenuScorer",
    "best_first",
    "build_tree",
    "chain_draft",
    "chain_menus",
    "default_corr_topm",
    "children",
    "condstatic_scorer",
    "domino_scorer",
    "frontier_tree",
    "heap_tree",
    "lane_widths",
    "make_scorer",
    "marginal_scorer",
]
