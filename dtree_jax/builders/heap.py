"""Reference sequential best-first heap builder (§4.3), host side: Python ``heapq`` + one jitted scorer call
(one lane of one request) per popped node.  Slow by design (a host sync per node); the oracle for
``frontier.frontier_tree``.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from dtree_jax.builders.scorers import children
from dtree_jax.tree import Tree, ancestor_mask

_children = jax.jit(children, static_argnames="d")


def best_first(
    expand: Callable[[int, np.ndarray], tuple[np.ndarray, np.ndarray, np.ndarray]],
    state: np.ndarray,
    *,
    budget: int,
    depths: int,
) -> list[tuple[int, int, int, float]]:
    """Pops up to ``budget`` nodes best-first; returns ``(token, ledger depth, parent pop index or -1,
    score)`` in pop order (parents always before children).

    ``expand(d, state [S])`` gives the k children of a node at ledger depth ``d``: tokens ``[k]``, log-probs
    ``[k]`` and child states ``[k, S]``.  Score = fp32 sum of log-probs along the path; equal scores pop in
    insertion order.  Children exist for ledger depths ``< depths``.
    """
    tie = itertools.count()
    heap: list = []

    def push_children(d, st, parent, score):
        if d >= depths:
            return
        toks, lps, states = expand(d, st)
        for tok, lp, cst in zip(toks, lps, states):
            cum = np.float32(score) + np.float32(lp)
            heapq.heappush(heap, (-cum, next(tie), int(tok), d, parent, cst))

    push_children(0, state, -1, np.float32(0.0))
    nodes = []
    while heap and len(nodes) < budget:
        neg, _, tok, d, parent, st = heapq.heappop(heap)
        nodes.append((tok, d, parent, float(-neg)))
        push_children(d + 1, st, len(nodes) - 1, -neg)
    return nodes


def heap_tree(scorer, root: jax.Array, *, budget: int, max_depth: int, mask_token_id: int) -> Tree:
    """The best-first tree of every request, built one request and one node at a time.

    Same inputs and output layout as ``frontier.frontier_tree``: root first, nodes in pop order, flat parent
    = 1 + parent's pop index (0 for the root's children), depth = ledger depth + 1, dead-leaf padding to
    ``N = budget + 1`` nodes.
    """
    root = np.asarray(root, np.int32)
    n = budget + 1
    tokens = np.full((len(root), n), mask_token_id, np.int32)
    parents = np.zeros((len(root), n), np.int32)
    depths = np.ones((len(root), n), np.int32)
    scores = np.full((len(root), n), -np.inf, np.float32)
    tokens[:, 0], parents[:, 0], depths[:, 0], scores[:, 0] = root, -1, 0, 0.0
    init = np.asarray(scorer.initial_state)
    for b in range(len(root)):
        one = scorer.request(b)

        def expand(d, st, one=one):
            toks, lps, states = _children(one, d, jnp.asarray(st)[None, None])
            return np.asarray(toks)[0, 0], np.asarray(lps)[0, 0], np.asarray(states)[0, 0]

        nodes = best_first(expand, init[b], budget=budget, depths=min(max_depth, scorer.num_depths))
        for i, (tok, d, parent, score) in enumerate(nodes, start=1):
            tokens[b, i], parents[b, i], depths[b, i], scores[b, i] = tok, parent + 1, d + 1, score
    parents = jnp.asarray(parents)
    tokens, depths, scores = jnp.asarray(tokens), jnp.asarray(depths), jnp.asarray(scores)
    return Tree(tokens, parents, depths, scores, ancestor_mask(parents))
