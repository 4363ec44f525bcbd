"""Depth-synchronous frontier builder (§4.5): the best-first heap's tree with fixed shapes and no host syncs.

Lanes (nodes) are advanced in lockstep one depth at a time; every scored child is recorded in a depth-major
ledger (cumulative score, token, ledger id of its parent); the tree is the ledger's global top-``budget``,
selected once at the end by a stable descending sort.  Because a child never scores above its parent, that set
is ancestor-closed, and the stable sort over the depth-major ledger puts parents before children (on equal
scores the shallower entry wins).  On tie-free inputs it equals ``heap.heap_tree`` node for node.

Lane widths: §4.5 advances ``W = budget`` lanes at every depth.  Fewer suffice for exactness.  A lane is
only useful if its node gets a selected child; a node at ledger depth ``d`` of rank ``r`` (by score among its
depth) with a selected child implies ``r - 1`` better selected nodes at that depth, itself, the child and its
``d`` other ancestors, so ``r <= budget - d - 1``; it is also within the ``k ** (d + 1)`` nodes of its depth,
and no node sits deeper than ``budget - 1``.  So the lanes scored at step ``d`` are the best
``lane_widths(...)[d]`` entries of the previous depth: the same tree with fewer GRU steps (at budget 16,
D 16: 113 instead of 240).

Deep trees run the depths after the widest one as one ``lax.scan`` at that width (``scan_start``): more lanes
than needed there, the same tree, and one compiled step instead of one per depth (the Qwen3-8B dominotree
generation at budget 32 compiles for a TPU v5e-4 in 78 s instead of 113 s; on this CPU the build time did not
change measurably).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from dtree_jax.tree import Tree, ancestor_mask


def lane_widths(budget: int, k: int, depths: int) -> tuple[int, ...]:
    """Lanes scored at each step ``d``: 1 (the root) at d = 0, then ``min(budget - d, k ** d)``; steps at
    ``d >= budget`` are dropped (no node at ledger depth >= budget fits in the tree)."""
    return tuple(1 if d == 0 else min(budget - d, k**d) for d in range(min(depths, budget)))


SCAN_MIN_STEPS = 8  # depths at one lane width from which the frontier runs them as one lax.scan


def scan_start(widths: tuple[int, ...], first_dynamic_depth: int) -> int:
    """The first ledger depth of the frontier's ``lax.scan`` (``len(widths)`` for none): from the widest depth
    on (and from the scorer's ``first_dynamic_depth``), every step can run at that width, one compiled body
    for all of them, when at least ``SCAN_MIN_STEPS`` steps remain.  Unrolled, each depth is its own code:
    with Domino's scorer about 2 s of TPU compile time per depth (budget 32: 15 depths).  The scan scores
    the top ``widths[start]`` lanes at every later depth instead of ``widths[d]`` (more lanes than needed: the
    same tree, the lane bound being an upper bound), so shallow trees (budget <= 8 on the CPU) stay unrolled."""
    n = len(widths)
    start = max(widths.index(max(widths)), first_dynamic_depth) if widths else 0
    return start if n - 1 - start >= SCAN_MIN_STEPS else n


def frontier_tree(scorer, root: jax.Array, *, budget: int, max_depth: int, mask_token_id: int) -> Tree:
    """Best-first draft tree of ``budget`` non-root nodes for every request (``root`` ``[B]`` int32).

    ``scorer`` follows the protocol in ``scorers``; ledger depths run over ``min(max_depth, K)``.  Returns a
    ``Tree`` with ``N = budget + 1`` nodes: root first, then nodes in descending cumulative score (the heap's
    pop order).  Requests with fewer than ``budget`` candidates are padded with dead leaves
    (``mask_token_id``, parent 0, depth 1, score -inf).
    """
    widths = list(lane_widths(budget, scorer.k, min(max_depth, scorer.num_depths)))
    start = scan_start(tuple(widths), scorer.first_dynamic_depth)
    widths[start:] = [widths[start]] * (len(widths) - start) if start < len(widths) else []
    ledger, depth_of = _fill_ledger(scorer, widths, start, budget)
    return _best_nodes(*ledger, depth_of, root, budget=budget, mask_token_id=mask_token_id)


def _fill_ledger(scorer, widths: list[int], start: int, budget: int):
    """The fixed-shape ledger: every lane's ``k`` children at every depth, depth-major, as (cumulative score,
    token, parent ledger id), each ``[B, L]`` with ``L >= budget`` (padded with dead entries), and ``depth_of``
    ``[L]`` (numpy: each entry's depth).  Depths before ``start`` are unrolled (their widths differ); depths
    ``[start, last)`` run as one scan at width ``widths[start]``; the last depth has no next lanes."""
    k = scorer.k
    state = scorer.initial_state[:, None]  # [B, 1, S]
    b = state.shape[0]
    rows = jnp.arange(b)[:, None]
    lane_score = jnp.zeros((b, 1), jnp.float32)  # [B, W_d] cumulative score of each lane's node
    lane_node = jnp.full((b, 1), -1, jnp.int32)  # [B, W_d] ledger id of each lane's node (root: -1)
    ledger = []  # depth-major blocks of (cumulative score, token, parent ledger id), each [B, entries]
    offset = 0

    def step(d, state, lane_score, lane_node, offset, next_width):
        """Scores depth ``d``'s lanes: its ledger block and the next depth's lanes (the best ``next_width``)."""
        tok, lp = scorer.scores(d, state)  # [B, W_d, k]
        width = tok.shape[1]
        cum = (lane_score[..., None] + lp).reshape(b, width * k)
        tok = tok.reshape(b, width * k)
        block = (cum, tok, jnp.repeat(lane_node, k, axis=-1))
        if not next_width:
            return block, None
        lane_score, keep = jax.lax.top_k(cum, next_width)  # [B, W_{d+1}], stable
        state = scorer.advance(state[rows, keep // k], jnp.take_along_axis(tok, keep, axis=-1))
        return block, (state, lane_score, (offset + keep).astype(jnp.int32))

    last = len(widths) - 1
    for d in range(min(start, last + 1)):
        block, lanes = step(d, state, lane_score, lane_node, offset, widths[d + 1] if d < last else 0)
        ledger.append(block)
        offset += widths[d] * k
        if lanes is not None:
            state, lane_score, lane_node = lanes
    if start < last:  # depths [start, last) as one scan at width widths[start], then the last depth
        width = widths[start]

        def body(carry, d):
            block, lanes = step(d, *carry, offset + (d - start) * width * k, width)
            return lanes, block

        (state, lane_score, lane_node), blocks = jax.lax.scan(
            body, (state, lane_score, lane_node), jnp.arange(start, last, dtype=jnp.int32))
        ledger.append(tuple(jnp.moveaxis(x, 0, 1).reshape(b, -1) for x in blocks))  # [steps, B, W*k] -> [B, ...]
        offset += (last - start) * width * k
    if start <= last:
        ledger.append(step(last, state, lane_score, lane_node, offset, 0)[0])
        offset += widths[last] * k
    depth_of = np.repeat(np.arange(1, len(widths) + 1, dtype=np.int32), [w * k for w in widths])
    if offset < budget:  # fewer candidates than nodes: pad the ledger with dead entries
        pad = budget - offset
        ledger.append((jnp.full((b, pad), -jnp.inf, jnp.float32), jnp.zeros((b, pad), jnp.int32),
                       jnp.full((b, pad), -1, jnp.int32)))
        depth_of = np.concatenate([depth_of, np.ones(pad, np.int32)])
    return tuple(jnp.concatenate(part, axis=-1) for part in zip(*ledger)), depth_of


def _best_nodes(score: jax.Array, token: jax.Array, parent: jax.Array, depth_of: np.ndarray, root: jax.Array, *,
                budget: int, mask_token_id: int) -> Tree:
    """The tree of the ledger's ``budget`` best entries (``score`` / ``token`` / ``parent`` ``[B, L]``, stable
    descending order, so a parent comes before its children), parents re-indexed to tree positions."""
    b = score.shape[0]
    rows = jnp.arange(b)[:, None]
    sel = jnp.argsort(-score, axis=-1, stable=True)[:, :budget]  # [B, budget] top-budget, parents first
    sel_score = jnp.take_along_axis(score, sel, axis=-1)
    sel_parent = jnp.take_along_axis(parent, sel, axis=-1)
    pos = jnp.zeros(score.shape, jnp.int32).at[rows, sel].set(jnp.arange(budget, dtype=jnp.int32))
    parent_pos = jnp.take_along_axis(pos, jnp.maximum(sel_parent, 0), axis=-1)
    valid = jnp.isfinite(sel_score)
    node_tok = jnp.where(valid, jnp.take_along_axis(token, sel, axis=-1), mask_token_id)
    node_parent = jnp.where(valid & (sel_parent >= 0), parent_pos + 1, 0)
    node_depth = jnp.where(valid, jnp.asarray(depth_of)[sel], 1)

    root = jnp.asarray(root, jnp.int32)[:, None]
    tree_parents = jnp.concatenate([jnp.full((b, 1), -1, jnp.int32), node_parent], axis=-1)
    return Tree(
        tokens=jnp.concatenate([root, node_tok.astype(jnp.int32)], axis=-1),
        parents=tree_parents,
        depths=jnp.concatenate([jnp.zeros((b, 1), jnp.int32), node_depth.astype(jnp.int32)], axis=-1),
        scores=jnp.concatenate([jnp.zeros((b, 1), jnp.float32), sel_score], axis=-1),
        mask=ancestor_mask(tree_parents),
    )
