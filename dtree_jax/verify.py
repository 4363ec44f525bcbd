"""Acceptance rules for a verified draft tree (the KV compaction of the accepted path is
``dtree_jax.models.cache.compact_kv``).

All functions are jit-able with fixed shapes and take a single tree (``[N]``) or a batch (``[B, N]``).
Node 0 is the root (the last committed token, whose KV is written by the verify pass); ``parents`` are
topologically ordered (see ``dtree_jax.tree``).

The result of every rule is an ``Acceptance``: ``emitted[:num_emitted]`` are the accepted draft tokens
followed by the target's correction/bonus token, and ``path[:num_emitted]`` the visited nodes starting
with the root, whose KV entries the target's ``commit`` keeps (the bonus token becomes the next round's root).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from dtree_jax.models.kernels import cpu_ops_wanted
from dtree_jax.tree import (
    _is_concrete,
    ancestor_mask,
    check_parents,
    check_same_shape,
    depths_from_mask,
    dfs_intervals,
)


class Acceptance(NamedTuple):
    emitted: jax.Array  # [..., N] int32, padding -1
    num_emitted: jax.Array  # [...] int32, accepted drafts + 1
    path: jax.Array  # [..., N] int32 node indices from the root, padding -1


# ----------------------------------------------------------------------------------------------------------
# Sampling the target
# ----------------------------------------------------------------------------------------------------------


def filter_logits(logits: jax.Array, temperature, top_k: int = 0, top_p: float = 1.0) -> jax.Array:
    """Temperature-scaled fp32 logits with tokens outside top-k / the top-p nucleus set to -inf.

    ``logits [..., V]``; ``temperature`` > 0 (scalar, may be traced); ``top_k`` 0 disables it.
    """
    x = logits.astype(jnp.float32) / jnp.maximum(jnp.asarray(temperature, jnp.float32), 1e-6)
    v = x.shape[-1]
    if top_k and top_k < v:
        kth = jax.lax.top_k(x, top_k)[0][..., -1:]
        x = jnp.where(x < kth, -jnp.inf, x)
    if top_p < 1.0:
        sorted_x = -jnp.sort(-x, axis=-1)
        probs = jax.nn.softmax(sorted_x, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly above each token
        keep_sorted = before < top_p  # always keeps the top token
        cutoff = jnp.min(jnp.where(keep_sorted, sorted_x, jnp.inf), axis=-1, keepdims=True)
        keep = x >= cutoff  # tokens tied with the cutoff are kept too
        x = jnp.where(keep, x, -jnp.inf)
    return x


def first_argmax(x: jax.Array) -> jax.Array:  # [..., V] -> [...] int32
    """``jnp.argmax(x, -1)``: the first index of the largest value (of the first NaN where there is one).  On the
    CPU as a max, then a min over the indices that reach it: two vectorised reductions, where XLA:CPU's argmax (one
    reduction over value-index pairs) took 1.1-1.8 ms against 0.5-0.7 for SmolLM2's 9-node verify logits [9,
    49152] on our 2-core Intel host; other platforms keep ``jnp.argmax``.  Programs that run ``cpu_dot``'s small ops
    (``models.kernels.cpu_ops``) take fp32 rows through ``cpu_dot.first_argmax``: one pass, about 0.1 ms there."""
    if x.dtype == jnp.float32 and x.ndim and x.shape[-1] and cpu_ops_wanted():
        from dtree_jax import cpu_dot

        return cpu_dot.first_argmax(x)

    def two_passes(x):
        hit = (x == jnp.max(x, -1, keepdims=True)) | jnp.isnan(x)
        index = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
        return jnp.min(jnp.where(hit, index, x.shape[-1]), -1)

    return jax.lax.platform_dependent(x, cpu=two_passes, default=lambda x: jnp.argmax(x, -1).astype(jnp.int32))


INVERSION_BLOCK = 128  # tokens per block of sample_categorical's two-level inversion


def sample_categorical(key: jax.Array, logits: jax.Array) -> jax.Array:  # [..., V] -> [...] int32
    """One draw per row from ``softmax(logits)`` (``-inf`` never drawn): ``jax.random.categorical``'s distribution,
    by inverting each row's cumulative distribution at one uniform number (``invert_cdf``), where the Gumbel-max
    trick draws V random numbers a row (7 ms of a budget-8 round at SmolLM2's 49,152 tokens on our CPU host)."""
    return invert_cdf(logits, jax.random.uniform(key, logits.shape[:-1], jnp.float32))


def invert_cdf(logits: jax.Array, u: jax.Array) -> jax.Array:  # [..., V], [...] in [0, 1) -> [...] int32
    """The token at which each row's cumulative ``softmax(logits)`` first exceeds ``u`` times its total: the
    probabilities' masses per block of ``INVERSION_BLOCK`` tokens, the block where the running mass first exceeds
    the target, then the token within it.  Always a token of positive probability (rounding cannot land on a
    zero-mass block or token: each step takes the first of those that exceed the target and have mass, else the
    last with mass)."""
    *lead, v = logits.shape
    width = min(INVERSION_BLOCK, v)
    blocks = -(-v // width)
    x = logits.astype(jnp.float32)
    x = jnp.pad(x, [(0, 0)] * len(lead) + [(0, blocks * width - v)], constant_values=-jnp.inf)
    p = jnp.exp(x - jnp.max(x, axis=-1, keepdims=True)).reshape(*lead, blocks, width)  # the top token: 1

    def first_over(mass, target):  # [..., n], [...] -> [...]: first index past target with mass, else last with mass
        upto = jax.lax.associative_scan(jnp.add, mass, axis=-1)
        over = (upto > target[..., None]) & (mass > 0)
        index = jax.lax.broadcasted_iota(jnp.int32, mass.shape, mass.ndim - 1)
        last = jnp.max(jnp.where(mass > 0, index, 0), axis=-1)
        first = jnp.min(jnp.where(over, index, mass.shape[-1]), axis=-1)
        chosen = jnp.where(first < mass.shape[-1], first, last)
        before = jnp.take_along_axis(upto - mass, chosen[..., None], axis=-1)[..., 0]  # mass ahead of it
        return chosen, target - before

    block_mass = p.sum(axis=-1)  # [..., blocks]
    total = jnp.sum(block_mass, axis=-1)
    block, rest = first_over(block_mass, u * total)
    in_block = jnp.take_along_axis(p, block[..., None, None], axis=-2)[..., 0, :]  # [..., width]
    token, _ = first_over(in_block, rest)
    return (block * width + token).astype(jnp.int32)


def sample_tokens(key: jax.Array, logits: jax.Array, temperature, top_k: int = 0, top_p: float = 1.0):
    """One token per row of ``logits [..., V]``: argmax when ``temperature`` <= 0, else a sample from the
    filtered softmax.  ``temperature`` may be a traced scalar: ``lax.cond`` then runs only the branch it
    selects, so greedy decoding draws no random numbers over the vocabulary.  ``key`` is one key, or one per
    request (``[B]`` for ``logits [B, ..., V]``: each request draws from its own stream)."""

    def greedy(logits):
        return first_argmax(logits)

    def sampled(logits):
        filtered = filter_logits(logits, temperature, top_k, top_p)
        if key.shape:
            return jax.vmap(sample_categorical)(key, filtered)
        return sample_categorical(key, filtered)

    if _is_concrete(temperature):
        return greedy(logits) if float(np.asarray(temperature)) <= 0 else sampled(logits)
    return jax.lax.cond(jnp.asarray(temperature) > 0, sampled, greedy, logits)


# ----------------------------------------------------------------------------------------------------------
# Acceptance rules
# ----------------------------------------------------------------------------------------------------------


def _path_from_leaf(mask: jax.Array, depths: jax.Array, leaf: jax.Array) -> jax.Array:
    """Nodes on the root-to-``leaf`` path ordered by depth; ``[..., N]`` padded with -1."""
    n = mask.shape[-1]
    row = jnp.take_along_axis(mask, leaf[..., None, None], axis=-2)[..., 0, :]  # [..., N] ancestors-or-self
    at_depth = row[..., None, :] & (depths[..., None, :] == jnp.arange(n)[:, None])  # [..., N(d), N(node)]
    return jnp.where(jnp.any(at_depth, -1), jnp.argmax(at_depth, -1), -1).astype(jnp.int32)


def accept_greedy(parents: jax.Array, tokens: jax.Array, target_next: jax.Array) -> Acceptance:
    """The longest root-to-node path on which every node's token equals the target's next token at its parent.

    ``parents, tokens, target_next: [..., N]`` (``target_next[i]`` = the target's token after node i).  With
    distinct sibling tokens (what every builder here emits) this is the plain walk from the root.  When
    siblings share a token, the branch that goes deeper wins, and among equally deep ones the first that a
    depth-first search over children in index order reaches, as Domino-Tree's ``longest_accepted_path`` does.
    """
    check_same_shape(parents=parents, tokens=tokens, target_next=target_next)
    check_parents(parents)
    parents = jnp.asarray(parents, jnp.int32)
    tokens = jnp.asarray(tokens, jnp.int32)
    target_next = jnp.asarray(target_next, jnp.int32)
    n = parents.shape[-1]
    mask = ancestor_mask(parents)
    depths = depths_from_mask(mask)
    idx = jnp.arange(n)
    parent_next = jnp.take_along_axis(target_next, jnp.clip(parents, 0), axis=-1)
    ok = (tokens == parent_next) | (idx == 0)
    accepted = ~jnp.any(mask & ~ok[..., None, :], axis=-1)  # every node on the path ok
    pre, _ = dfs_intervals(parents)
    rank = depths * n + (n - 1 - pre)  # deeper first, then earlier in DFS pre-order
    leaf = jnp.argmax(jnp.where(accepted, rank, -1), axis=-1).astype(jnp.int32)
    path = _path_from_leaf(mask, depths, leaf)
    num = jnp.take_along_axis(depths, leaf[..., None], -1)[..., 0] + 1
    drafts = jnp.take_along_axis(tokens, jnp.roll(jnp.clip(path, 0), -1, axis=-1), axis=-1)
    bonus = jnp.take_along_axis(target_next, leaf[..., None], -1)
    pos = jnp.broadcast_to(idx, path.shape)
    emitted = jnp.where(pos < num[..., None] - 1, drafts, jnp.where(pos == num[..., None] - 1, bonus, -1))
    return Acceptance(emitted.astype(jnp.int32), num.astype(jnp.int32), path)


def accept_sampled(
    parents: jax.Array,  # [..., N]
    tokens: jax.Array,  # [..., N]
    target_logits: jax.Array,  # [..., N, V]
    key: jax.Array,
    temperature,
    top_k: int = 0,
    top_p: float = 1.0,
) -> Acceptance:
    """Samples the target at every node and walks the tree: a deterministic draft is accepted iff it
    equals the target's sample at its parent.  The emitted tokens are the target's own samples, so the
    output distribution is exactly the target's (temperature <= 0 reduces to ``accept_greedy``)."""
    if target_logits.shape[:-1] != np.shape(parents):
        raise ValueError(f"target_logits {target_logits.shape} does not match parents {np.shape(parents)}")
    target_next = sample_tokens(key, target_logits, temperature, top_k, top_p)
    return accept_greedy(parents, tokens, target_next)


def accept_rejection(
    parents: jax.Array,  # [N] or [B, N]
    tokens: jax.Array,  # [N] or [B, N]
    draft_probs: jax.Array,  # [N, V] or [B, N, V]: row i = distribution node i's children were drawn from
    target_logits: jax.Array,  # [N, V] or [B, N, V]
    key: jax.Array,
    temperature,
) -> Acceptance:
    """Recursive rejection sampling over siblings (SpecInfer), for drafts that were themselves sampled.

    At the current node with target distribution p and draft distribution q (the one the children were
    drawn from, i.i.d.), children are tried in index order: child x is accepted with probability
    ``min(1, p[x] / q[x])``; after a rejection ``p <- normalise(max(p - q, 0))``.  When no child is accepted
    the bonus token is drawn from the final residual.  The output distribution is exactly the target's.
    """
    check_same_shape(parents=parents, tokens=tokens)
    if draft_probs.shape != target_logits.shape or draft_probs.shape[:-1] != np.shape(parents):
        raise ValueError(
            f"draft_probs {draft_probs.shape} and target_logits {target_logits.shape} must both be "
            f"{np.shape(parents)} + (V,)"
        )
    if _is_concrete(draft_probs):
        d = np.asarray(draft_probs)
        if np.any(~np.isfinite(d)) or np.any(d < 0) or np.any(d > 1):
            raise ValueError("draft_probs must be probabilities in [0, 1]")
    check_parents(parents)
    target_logits = jnp.asarray(target_logits, jnp.float32)
    target = jax.nn.softmax(target_logits / jnp.maximum(temperature, 1e-6), axis=-1)
    greedy = jnp.asarray(temperature, jnp.float32) <= 0
    target = jnp.where(greedy, jax.nn.one_hot(jnp.argmax(target_logits, -1), target.shape[-1]), target)
    walk = lambda p, t, d, q, k: _rejection_walk(  # noqa: E731
        jnp.asarray(p, jnp.int32), jnp.asarray(t, jnp.int32), jnp.asarray(d, jnp.float32), q, k)
    if np.ndim(parents) == 2:
        keys = jax.random.split(key, np.shape(parents)[0])
        return jax.vmap(walk)(parents, tokens, draft_probs, target, keys)
    return walk(parents, tokens, draft_probs, target, key)


def _rejection_walk(
    parents: jax.Array,  # [N]
    tokens: jax.Array,  # [N]
    draft: jax.Array,  # [N, V] the distribution each node's children were drawn from
    target: jax.Array,  # [N, V] the target's distribution at each node (one-hot when greedy)
    key: jax.Array,
) -> Acceptance:
    """``accept_rejection`` for one request: from the root, the siblings are tried in index order (a scan over
    the children), the accepted one becomes the current node, until none is accepted and the bonus is drawn."""
    n = parents.shape[-1]
    coins = jax.random.uniform(jax.random.fold_in(key, 0), (n, n))  # [step, child]
    bonus_keys = jax.random.split(jax.random.fold_in(key, 1), n)

    def try_child(carry, c):
        cur, p, chosen = carry
        q = draft[cur]
        x = tokens[c]
        is_child = (parents[c] == cur) & (chosen < 0)
        ratio = jnp.where(q[x] > 0, p[x] / jnp.maximum(q[x], 1e-30), jnp.where(p[x] > 0, 1.0, 0.0))
        accept = is_child & (coins[cur, c] < jnp.minimum(ratio, 1.0))
        residual = jnp.maximum(p - q, 0.0)
        total = residual.sum()
        residual = jnp.where(total > 0, residual / jnp.maximum(total, 1e-30), p)
        p = jnp.where(is_child & ~accept, residual, p)
        chosen = jnp.where(accept, c, chosen)
        return (cur, p, chosen), None

    def step(carry, _):
        cur, done, path, emitted, num = carry
        (_, p, chosen), _ = jax.lax.scan(try_child, (cur, target[cur], jnp.int32(-1)), jnp.arange(n))
        advance = (~done) & (chosen >= 0)
        stop = (~done) & (chosen < 0)
        bonus = sample_categorical(bonus_keys[cur], jnp.log(jnp.maximum(p, 0.0)))
        token = jnp.where(advance, tokens[jnp.maximum(chosen, 0)], bonus)
        emitted = jnp.where(~done, emitted.at[num].set(token), emitted)
        path = jnp.where(advance, path.at[num + 1].set(chosen), path)
        num = num + jnp.where(~done, 1, 0)
        cur = jnp.where(advance, chosen, cur)
        return (cur, done | stop, path, emitted, num), None

    init = (
        jnp.int32(0),
        jnp.bool_(False),
        jnp.full((n,), -1, jnp.int32).at[0].set(0),
        jnp.full((n,), -1, jnp.int32),
        jnp.int32(0),
    )
    (_, _, path, emitted, num), _ = jax.lax.scan(step, init, None, length=n)
    return Acceptance(emitted, num, path)


# ----------------------------------------------------------------------------------------------------------
# Commit
# ----------------------------------------------------------------------------------------------------------
