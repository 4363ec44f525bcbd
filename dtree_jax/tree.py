"""Trees as data: static rank trees, run-time ancestor masks, positions and compact mask forms.

Conventions used everywhere in dtree_jax:
  * node 0 is the root (the last committed token); every other node's parent has a smaller index;
  * ``parents[0] == -1``; ``depths[0] == 0``;
  * the ancestor mask is *ancestor-or-self*: ``mask[i, j]`` iff j is i or an ancestor of i;
  * a node sits at position ``prefix_len + depth`` (siblings share a position).

Run-time helpers take a single tree ``[N]`` or a batch ``[B, N]`` (any leading dims) and are jit-able with
fixed shapes.  Host-side validation (``check_parents``) runs only on concrete inputs.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.tree_attention import ancestor_bits, mask_from_bits  # noqa: F401  (the kernels' mask form)


# ----------------------------------------------------------------------------------------------------------
# Static rank trees (built once on the host, e.g. for a fixed EAGLE/Medusa-style tree or the card's example)
# ----------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class StaticTree:
    """A tree given by candidate-rank paths: ``(0,)`` is the drafter's top guess for the next token,
    ``(1,)`` its second guess, ``(0, 1)`` the second guess after the top guess."""

    paths: tuple[tuple[int, ...], ...]  # sorted by (length, path); the root () excluded
    parents: np.ndarray  # [N] int32, root = -1
    depths: np.ndarray  # [N] int32
    mask: np.ndarray  # [N, N] bool, ancestor-or-self

    @property
    def num_nodes(self) -> int:
        return len(self.parents)


def tree_from_paths(paths: Iterable[Sequence[int]] = ()) -> StaticTree:
    """Builds a ``StaticTree`` from rank paths; duplicates collapse, order is (length, path).

    Raises ValueError for a path whose parent path is missing, or for a rank that is not a
    non-negative integer.  No paths gives the 1-node tree (plain decoding).
    """
    clean = set()
    for p in paths:
        p = tuple(p)
        for r in p:
            if not isinstance(r, (int, np.integer)) or isinstance(r, bool) or r < 0:
                raise ValueError(f"path {p}: ranks must be non-negative integers, got {r!r}")
        if len(p) == 0:
            continue  # the root is implicit
        clean.add(tuple(int(r) for r in p))
    ordered = sorted(clean, key=lambda p: (len(p), p))
    index = {(): 0}
    parents, depths = [-1], [0]
    for p in ordered:
        if p[:-1] not in index:
            raise ValueError(f"path {p} has no parent: {p[:-1]} is not in the tree")
        index[p] = len(parents)
        parents.append(index[p[:-1]])
        depths.append(len(p))
    parents = np.asarray(parents, np.int32)
    return StaticTree(
        paths=tuple(ordered),
        parents=parents,
        depths=np.asarray(depths, np.int32),
        mask=np.asarray(ancestor_mask(parents)),
    )


# ----------------------------------------------------------------------------------------------------------
# Validation of concrete inputs
# ----------------------------------------------------------------------------------------------------------


def _is_concrete(x) -> bool:
    return not isinstance(x, jax.core.Tracer)


def check_parents(parents) -> None:
    """Raises ValueError unless ``parents`` (``[N]`` or ``[..., N]``) is a valid topologically ordered tree.

    Skipped silently for traced values (inside ``jit`` the caller owns the invariant).
    """
    if not _is_concrete(parents):
        return
    p = np.asarray(parents)
    if p.ndim == 0 or p.shape[-1] == 0:
        raise ValueError(f"parents must have at least one node (the root), got shape {p.shape}")
    if not np.issubdtype(p.dtype, np.integer):
        raise ValueError(f"parents must be integers, got dtype {p.dtype}")
    flat = p.reshape(-1, p.shape[-1])
    n = flat.shape[-1]
    for b, row in enumerate(flat):
        where = f" (tree {b})" if flat.shape[0] > 1 else ""
        if row[0] != -1:
            raise ValueError(f"parents[0] must be -1 (the root){where}, got {row[0]}")
        for i in range(1, n):
            q = int(row[i])
            if q < 0 or q >= n:
                raise ValueError(f"node {i}{where}: parent {q} is out of range [0, {n})")
            if q >= i:
                # Distinguish a cycle from a mere ordering violation for a clearer message.
                seen, cur = {i}, q
                while cur > 0 and cur not in seen:
                    seen.add(cur)
                    cur = int(row[cur])
                if cur in seen and cur != 0:
                    raise ValueError(f"node {i}{where}: parent pointers form a cycle through node {cur}")
                raise ValueError(f"node {i}{where}: parent {q} does not precede its child (need parent < child)")


def check_same_shape(**arrays) -> None:
    """Raises ValueError naming the arrays whose shapes differ."""
    shapes = {k: tuple(np.shape(v)) for k, v in arrays.items()}
    if len(set(shapes.values())) > 1:
        desc = ", ".join(f"{k} {s}" for k, s in shapes.items())
        raise ValueError(f"arrays of mismatched shape: {desc}")


# ----------------------------------------------------------------------------------------------------------
# Run-time (jit-able) helpers
# ----------------------------------------------------------------------------------------------------------


def ancestor_mask(parents: jax.Array) -> jax.Array:  # [..., N] -> [..., N, N]
    """Ancestor-or-self mask from parent pointers by pointer doubling (ceil(log2 N) boolean matmuls)."""
    check_parents(parents)
    parents = jnp.asarray(parents, jnp.int32)
    n = parents.shape[-1]
    step = jax.nn.one_hot(parents, n, dtype=jnp.float32)  # edge i -> parent(i); -1 gives a zero row
    reach = jnp.maximum(step, jnp.eye(n, dtype=jnp.float32))  # within 1 hop (or self)
    for _ in range(max(1, int(np.ceil(np.log2(max(n, 2)))))):
        reach = jnp.minimum(reach + reach @ reach, 1.0)  # within 2^(k+1) hops
    return reach > 0


def depths_from_mask(mask: jax.Array) -> jax.Array:  # [..., N, N] -> [..., N]
    """Depth = number of proper ancestors."""
    return jnp.sum(mask, axis=-1, dtype=jnp.int32) - 1


def position_ids(depths: jax.Array, prefix_len: jax.Array) -> jax.Array:  # [..., N], [...] -> [..., N]
    """RoPE position of each node: committed prefix length + depth (siblings share a position)."""
    return jnp.asarray(prefix_len, jnp.int32)[..., None] + jnp.asarray(depths, jnp.int32)


def verify_mask(tree_mask: jax.Array, prefix_len: jax.Array, cache_len: int) -> jax.Array:
    """Step mask ``[..., N, cache_len + N]`` for [committed cache | tree]: cache slots below ``prefix_len``
    visible, cache padding invisible, the tree part ancestor-only."""
    n = tree_mask.shape[-1]
    if tree_mask.shape[-2] != n:
        raise ValueError(f"tree_mask must be square, got {tree_mask.shape}")
    cols = jnp.arange(cache_len, dtype=jnp.int32)
    prefix = cols < jnp.asarray(prefix_len, jnp.int32)[..., None]  # [..., cache_len]
    prefix = jnp.broadcast_to(prefix[..., None, :], tree_mask.shape[:-1] + (cache_len,))
    return jnp.concatenate([prefix, tree_mask.astype(bool)], axis=-1)


def dfs_intervals(parents: jax.Array) -> tuple[jax.Array, jax.Array]:  # [..., N] -> ([..., N], [..., N])
    """DFS pre-order numbers and subtree ends (children visited in index order), fixed-shape.

    ``j`` is an ancestor-or-self of ``i`` iff ``pre[j] <= pre[i] < end[j]`` (see ``mask_from_intervals``).
    """
    parents = jnp.asarray(parents, jnp.int32)
    n = parents.shape[-1]
    mask = ancestor_mask(parents).astype(jnp.int32)  # [..., N, N]
    size = jnp.sum(mask, axis=-2)  # subtree sizes [..., N]
    idx = jnp.arange(n)
    same_parent = parents[..., :, None] == parents[..., None, :]  # [..., N(c), N(s)]
    earlier = idx[None, :] < idx[:, None]
    left = jnp.sum(jnp.where(same_parent & earlier, size[..., None, :], 0), axis=-1)  # [..., N]
    left = jnp.where(idx == 0, 0, left)
    depth = depths_from_mask(mask)
    pre = depth + jnp.einsum("...ij,...j->...i", mask, left)
    return pre.astype(jnp.int32), (pre + size).astype(jnp.int32)


def mask_from_intervals(pre: jax.Array, end: jax.Array) -> jax.Array:  # [..., N] x2 -> [..., N, N]
    """Ancestor-or-self mask from DFS intervals."""
    return (pre[..., None, :] <= pre[..., :, None]) & (pre[..., :, None] < end[..., None, :])


# ----------------------------------------------------------------------------------------------------------
# Run-time trees (the builders' output)
# ----------------------------------------------------------------------------------------------------------


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Tree:
    """A batch of draft trees with fixed shapes; node 0 of each row is the root."""

    tokens: jax.Array  # [B, N] int32
    parents: jax.Array  # [B, N] int32, root -1
    depths: jax.Array  # [B, N] int32
    scores: jax.Array  # [B, N] float32 cumulative draft log-prob (root 0, dead leaves -inf)
    mask: jax.Array  # [B, N, N] bool ancestor-or-self

    @property
    def num_nodes(self) -> int:
        return self.tokens.shape[-1]

    def positions(self, prefix_len: jax.Array) -> jax.Array:  # [B] -> [B, N]
        return position_ids(self.depths, prefix_len)


def chain_tree(tokens: jax.Array, scores: jax.Array | None = None) -> Tree:  # [B, N] -> Tree
    """The one-path tree ``tokens[:, 0] -> tokens[:, 1] -> ...`` (plain DFlash / Domino chain)."""
    tokens = jnp.asarray(tokens, jnp.int32)
    b, n = tokens.shape
    idx = jnp.arange(n, dtype=jnp.int32)
    parents = jnp.broadcast_to(idx - 1, (b, n))
    depths = jnp.broadcast_to(idx, (b, n))
    mask = jnp.broadcast_to(idx[:, None] >= idx[None, :], (b, n, n))
    if scores is None:
        scores = jnp.zeros((b, n), jnp.float32)
    return Tree(tokens, parents, depths, scores, mask)


# ----------------------------------------------------------------------------------------------------------
# The card's acceptance model
# ----------------------------------------------------------------------------------------------------------


def expected_accept_length(tree: StaticTree, rank_probs: Sequence[float]) -> float:
    """Expected tokens per step under greedy verification: ``1 + sum_nodes prod_{ranks on path} r[rank]``.

    ``rank_probs[r]`` is the probability that the target's next token is the drafter's rank-``r`` candidate.
    Raises ValueError for probabilities outside [0, 1], probabilities summing past 1, or a rank in the tree
    that has no probability.
    """
    r = np.asarray(rank_probs, np.float64)
    if r.ndim != 1:
        raise ValueError(f"rank_probs must be a 1-D sequence, got shape {r.shape}")
    if np.any(~np.isfinite(r)) or np.any(r < 0) or np.any(r > 1):
        raise ValueError(f"rank probabilities must lie in [0, 1], got {list(rank_probs)}")
    if r.sum() > 1 + 1e-9:
        raise ValueError(f"rank probabilities sum to {r.sum():.6g} > 1")
    total = 1.0
    for p in tree.paths:
        if max(p) >= len(r):
            raise ValueError(f"path {p} uses rank {max(p)} but only {len(r)} rank probabilities were given")
        total += float(np.prod(r[list(p)]))
    return total
