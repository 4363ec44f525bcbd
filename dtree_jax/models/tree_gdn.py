"""Tree-aware Gated DeltaNet verification: conv windows and recurrent states along parent pointers.

A draft tree of N nodes per request (node 0 = the last committed token, ``parents[0] = -1``, parents before
children) is verified in one pass without touching the committed conv/recurrent state.  Every node behaves as
if the chain root -> ... -> node had been appended to the committed sequence:

* ``tree_conv``: node t's conv window is itself, its parent, grandparent, ... continuing into the committed
  conv state above the root; ``windows[t]`` (the last ``Kc-1`` raw inputs after node t) is the conv state to
  commit.
* ``tree_gdn_wy`` (XLA) / ``tree_gdn_pallas`` (the Pallas kernel ``pallas_kernels.tree_gdn.tree_gdn``, whose
  oracle ``reference_tree_gdn`` runs the nodes one by one): the parallel tree-WY form.
  With ``M`` the ancestor-or-self mask and ``G = M g`` the path cumsum of log-decays (per v-head)::

      D[i, j] = exp(G_i - G_j) if j <= i (ancestor-or-self) else 0   (-inf masked before exp; factors <= 1)
      A[i, j] = beta_i (k_i . k_j) D[i, j] for proper ancestors j
      U = (I + A)^-1 [beta (v - exp(G) (K S0))]                          (unit lower-triangular)
      O = exp(G) (Q S0) + ((Q K^T) * D) U

  and returns a small per-node stash ``(k, u, G, M)`` instead of N states.
* ``tree_gdn_commit``: the accepted node l's state ``exp(G_l) S0 + sum_{j <= l} exp(G_l - G_j) k_j u_j^T``.
  ``commit_conv`` / ``take_node``: the accepted node's conv window (or state-table row).
* ``tree_gdn_mixer`` / ``commit_tree_gdn``: the whole token-mixer core between the projections (the tree
  counterpart of ``dtree_jax.models.gdn.gdn_mixer``) and the commit of both states.

Each node reads only its ancestors, so nodes off the accepted path (dead leaves, padding attached anywhere in
the tree) never change another node's output or the commit, as long as their inputs are finite.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jax.sharding import PartitionSpec

from dtree_jax.models import sharding
from dtree_jax.models.gdn import conv_taps, gated_rms_norm, gdn_gates, split_qkv, unit_lower_solve
from dtree_jax.models.sharding import axes
from dtree_jax.tree import ancestor_mask, check_parents
from pallas_kernels.delta_rule import fp32_einsum, normalize_qk
from pallas_kernels.tree_gdn import tree_gdn


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TreeGDNStash:
    """What the commit needs from a tree-WY verify, per node (O(N * Hv * (dk + dv)) instead of N states)."""

    k: jax.Array = axes("batch", None, "v_heads", None)  # [B, N, Hv, dk] fp32 l2-normalised keys (on the v-heads)
    # [B, N, Hv, dv] fp32 solved deltas, U = (I + A)^-1 [beta (v - exp(G) K S0)]
    u: jax.Array = axes("batch", None, "v_heads", None)
    g_path: jax.Array = axes("batch", None, "v_heads")  # [B, N, Hv] fp32 path cumsum of log-decays, G = M g
    mask: jax.Array = axes("batch", None, None)  # [B, N, N] bool ancestor-or-self


# ----------------------------------------------------------------------------------------------------------
# Validation and gathers
# ----------------------------------------------------------------------------------------------------------


def _check_tree_inputs(q, k, v, g, beta, state0, parents):
    check_parents(parents)
    bsz, n, hk, dk = q.shape
    hv, dv = v.shape[-2:]
    if parents.shape != (bsz, n):
        raise ValueError(f"parents must be {(bsz, n)} to match q {q.shape}, got {parents.shape}")
    if k.shape != q.shape or v.shape[:2] != (bsz, n):
        raise ValueError(
            f"q, k must be [B, N, Hk, dk] and v [B, N, Hv, dv]; got {q.shape}, {k.shape}, {v.shape}")
    if g.shape != (bsz, n, hv) or beta.shape != (bsz, n, hv):
        raise ValueError(f"g and beta must be {(bsz, n, hv)}, got {g.shape} and {beta.shape}")
    if state0.shape != (bsz, hv, dk, dv):
        raise ValueError(f"state0 must be {(bsz, hv, dk, dv)}, got {state0.shape}")
    if hv % hk:
        raise ValueError(f"Hv ({hv}) must be a multiple of Hk ({hk})")


def take_node(x: jax.Array, last: jax.Array) -> jax.Array:  # [B, N, ...], [B] -> [B, ...]
    """``x[b, last[b]]``: the accepted node's row (a conv window, a state-table entry, ...)."""
    last = jnp.asarray(last, jnp.int32)
    if last.shape != x.shape[:1]:
        raise ValueError(f"last must be [B={x.shape[0]}], got {last.shape}")
    concrete = not isinstance(last, jax.core.Tracer)
    if concrete and not np.all((np.asarray(last) >= 0) & (np.asarray(last) < x.shape[1])):
        raise ValueError(f"last must index a node in [0, {x.shape[1]}), got {np.asarray(last)}")
    idx = last.reshape((-1,) + (1,) * (x.ndim - 1))
    return jnp.take_along_axis(x, idx, axis=1)[:, 0]


# ----------------------------------------------------------------------------------------------------------
# Conv along ancestors
# ----------------------------------------------------------------------------------------------------------


def tree_conv_sources(parents: jax.Array, kc: int) -> jax.Array:  # [B, N] -> [B, N, Kc] int32
    """Rows feeding each node's conv window, oldest first, the node itself last.

    ``>= 0``: a tree node; ``< 0``: committed conv state row ``Kc-1 + src`` (-1 = the newest committed input).
    The walk is ``a_0 = t``, ``a_{j+1} = parents[a_j]`` inside the tree and steps further back above the root.
    """
    parents = jnp.asarray(parents, jnp.int32)
    cur = jnp.broadcast_to(jnp.arange(parents.shape[-1], dtype=jnp.int32), parents.shape)
    srcs = [cur]
    for _ in range(kc - 1):
        up = jnp.take_along_axis(parents, jnp.maximum(cur, 0), axis=-1)
        cur = jnp.where(cur > 0, up, jnp.minimum(cur, 0) - 1)  # node 0 -> -1 -> -2 -> ...
        srcs.append(cur)
    return jnp.stack(srcs[::-1], axis=-1)


def tree_conv(
    x: jax.Array,  # [B, N, C] raw packed q|k|v projections of the tree nodes
    w: jax.Array,  # [C, Kc] depthwise weights
    conv_state: jax.Array,  # [B, Kc-1, C] committed raw inputs, oldest first (read only)
    parents: jax.Array,  # [B, N] int32, parents[:, 0] = -1
) -> tuple[jax.Array, jax.Array]:  # (y [B, N, C], windows [B, N, Kc-1, C]) in x.dtype
    """Causal conv1d + SiLU where each node's window runs along its ancestors into the committed conv state.

    ``windows[:, t]`` is the conv state after consuming node t (its ``Kc-1`` most recent inputs along the
    path, oldest first); ``commit_conv(windows, last)`` commits it.
    """
    check_parents(parents)
    bsz, n, c = x.shape
    if w.ndim != 2 or w.shape[0] != c:
        raise ValueError(f"conv weight must be [C={c}, Kc], got {w.shape}")
    kc = w.shape[1]
    if conv_state.shape != (bsz, kc - 1, c) or parents.shape != (bsz, n):
        raise ValueError(f"need conv_state {(bsz, kc - 1, c)} and parents {(bsz, n)}, "
                         f"got {conv_state.shape} and {parents.shape}")
    src = tree_conv_sources(parents, kc)  # [B, N, Kc]
    table = jnp.concatenate([conv_state.astype(x.dtype), x], axis=1)  # [B, Kc-1+N, C]: row Kc-1+src
    vals = jnp.take_along_axis(table, (src + kc - 1).reshape(bsz, n * kc, 1), axis=1).reshape(bsz, n, kc, c)
    return conv_taps(vals, w, x.dtype), vals[:, :, 1:]


def commit_conv(windows: jax.Array, last: jax.Array) -> jax.Array:  # [B, N, Kc-1, C], [B] -> [B, Kc-1, C]
    """The new committed conv state: the window after the last accepted node."""
    return take_node(windows, last)


# ----------------------------------------------------------------------------------------------------------
# Recurrent state along the tree
# ----------------------------------------------------------------------------------------------------------


def tree_gdn_wy(
    q: jax.Array,  # [B, N, Hk, dk] raw (post-conv) queries of the tree nodes
    k: jax.Array,  # [B, N, Hk, dk]
    v: jax.Array,  # [B, N, Hv, dv]
    g: jax.Array,  # [B, N, Hv] log-decay
    beta: jax.Array,  # [B, N, Hv]
    state0: jax.Array,  # [B, Hv, dk, dv] committed state (read only)
    parents: jax.Array,  # [B, N] int32, parents[:, 0] = -1
) -> tuple[jax.Array, TreeGDNStash]:  # (o [B, N, Hv, dv] in q.dtype, stash for tree_gdn_commit)
    """Parallel tree-WY verify (pure jnp, the XLA path): Gram matrices, one unit-lower-triangular solve."""
    _check_tree_inputs(q, k, v, g, beta, state0, parents)
    mask = ancestor_mask(parents)  # [B, N, N]
    qn, kn = normalize_qk(q, k, v.shape[-2])
    s0 = state0.astype(jnp.float32)
    g, beta, v = (x.astype(jnp.float32) for x in (g, beta, v))
    g_path = jnp.sum(jnp.where(mask[..., None], g[:, None], 0.0), axis=2)  # [B, N, Hv] exact path sums
    gh = jnp.moveaxis(g_path, 2, 1)  # [B, Hv, N]
    m = mask[:, None]  # [B, 1, N, N]
    decay = jnp.exp(jnp.where(m, gh[..., :, None] - gh[..., None, :], -jnp.inf))  # [B, Hv, N, N]
    proper = m & ~jnp.eye(mask.shape[-1], dtype=bool)
    bh = jnp.moveaxis(beta, 2, 1)[..., None]  # [B, Hv, N, 1]
    a = jnp.where(proper, bh * fp32_einsum("bihk,bjhk->bhij", kn, kn) * decay, 0.0)
    eg = jnp.exp(gh)[..., None]  # [B, Hv, N, 1]
    rhs = bh * (jnp.moveaxis(v, 2, 1) - eg * fp32_einsum("bnhk,bhkv->bhnv", kn, s0))
    u = unit_lower_solve(a, rhs)  # [B, Hv, N, dv]
    qk = fp32_einsum("bihk,bjhk->bhij", qn, kn) * decay
    o = eg * fp32_einsum("bnhk,bhkv->bhnv", qn, s0) + fp32_einsum("bhij,bhjv->bhiv", qk, u)
    stash = TreeGDNStash(k=kn, u=jnp.moveaxis(u, 1, 2), g_path=g_path, mask=mask)
    return jnp.moveaxis(o, 1, 2).astype(q.dtype), stash


def tree_gdn_pallas(
    q: jax.Array,  # [B, N, Hk, dk] raw (post-conv) queries of the tree nodes
    k: jax.Array,  # [B, N, Hk, dk]
    v: jax.Array,  # [B, N, Hv, dv]
    g: jax.Array,  # [B, N, Hv] log-decay
    beta: jax.Array,  # [B, N, Hv]
    state0: jax.Array,  # [B, Hv, dk, dv] committed state (read only)
    parents: jax.Array,  # [B, N] int32, parents[:, 0] = -1
    *,
    interpret=False,  # bool, or a pltpu.InterpretParams
) -> tuple[jax.Array, TreeGDNStash]:  # same as tree_gdn_wy
    """``tree_gdn_wy`` through the Pallas kernel (``pallas_kernels.tree_gdn.tree_gdn``; its dtype contract)."""
    _check_tree_inputs(q, k, v, g, beta, state0, parents)
    mask = ancestor_mask(parents)
    kernel = functools.partial(tree_gdn, interpret=interpret)
    mesh = sharding.context_mesh()
    if mesh is None:
        o, u, g_path = kernel(q, k, v, g, beta, state0, mask)
    else:  # per shard: its requests and value heads, their q/k heads (as attention's kv heads)
        data, vh, kh, select = sharding.head_plan(mesh, q.shape[0], v.shape[2], q.shape[2])

        def local(q, k, *rest):
            if select:
                q, k = (sharding.select_kv_head(x, q.shape[2], axis=2) for x in (q, k))
            return kernel(q, k, *rest)

        nodes = lambda h: PartitionSpec(data, None, h, None)  # noqa: E731  [B, N, heads, d]
        gates = PartitionSpec(data, None, vh)  # [B, N, Hv]
        o, u, g_path = sharding.per_shard(
            local, (nodes(kh), nodes(kh), nodes(vh), gates, gates, PartitionSpec(data, vh), PartitionSpec(data)),
            (nodes(vh), nodes(vh), gates))(q, k, v, g, beta, state0, mask)
    _, kn = normalize_qk(q, k, v.shape[-2])
    return o, TreeGDNStash(k=kn, u=u, g_path=g_path, mask=mask)


def tree_gdn_commit(
    stash: TreeGDNStash,
    state0: jax.Array,  # [B, Hv, dk, dv] committed state the verify started from
    last: jax.Array,  # [B] int32 index of the last accepted node
) -> jax.Array:  # [B, Hv, dk, dv] fp32
    """State after accepting root -> ... -> last: ``exp(G_l) S0 + sum_{j <= l} exp(G_l - G_j) k_j u_j^T``."""
    on_path = take_node(stash.mask, last)  # [B, N]
    g_last = take_node(stash.g_path, last)  # [B, Hv]
    coef = jnp.exp(jnp.where(on_path[..., None], g_last[:, None] - stash.g_path, -jnp.inf))  # [B, N, Hv]
    fold = fp32_einsum("bnh,bnhk,bnhv->bhkv", coef, stash.k, stash.u)
    return jnp.exp(g_last)[..., None, None] * state0.astype(jnp.float32) + fold


# ----------------------------------------------------------------------------------------------------------
# The whole token-mixer core on a tree (the hybrid model's verify path)
# ----------------------------------------------------------------------------------------------------------


def tree_gdn_mixer(
    qkv: jax.Array,  # [B, N, 2*Hk*dk + Hv*dv] in_proj_qkv output of the tree nodes (raw, pre-conv)
    z: jax.Array,  # [B, N, Hv, dv]
    a: jax.Array,  # [B, N, Hv]
    b: jax.Array,  # [B, N, Hv]
    conv_w: jax.Array,  # [C, Kc]
    A_log: jax.Array,  # [Hv]
    dt_bias: jax.Array,  # [Hv]
    norm_w: jax.Array,  # [dv]
    conv_state: jax.Array,  # [B, Kc-1, C] committed (read only)
    state0: jax.Array,  # [B, Hv, dk, dv] committed (read only)
    parents: jax.Array,  # [B, N] int32, parents[:, 0] = -1
    *,
    num_k_heads: int,
    head_k_dim: int,
    eps: float = 1e-6,
    impl: str = "xla",
) -> tuple[jax.Array, jax.Array, TreeGDNStash]:  # (y [B, N, Hv, dv], windows [B, N, Kc-1, C], stash)
    """``gdn_mixer`` for a draft tree: every node as if its root->node path were appended to the sequence.

    ``impl``: a kernel choice of ``models.kernels``: ``"xla"`` (``tree_gdn_wy``), ``"mosaic"`` (the Pallas kernel,
    ``tree_gdn_pallas``) or ``"interpret"`` (that kernel in interpret mode).  After acceptance
    ``commit_tree_gdn(windows, stash, state0, last)`` gives the new states.
    """
    fns = {"xla": tree_gdn_wy, "mosaic": tree_gdn_pallas,
           "interpret": functools.partial(tree_gdn_pallas, interpret=True)}
    if impl not in fns:
        raise ValueError(f"impl must be one of {sorted(fns)}, got {impl!r}")
    hv, dv = z.shape[-2:]
    y, windows = tree_conv(qkv, conv_w, conv_state, parents)
    q, k, v = split_qkv(y, num_k_heads, head_k_dim, hv, dv)
    g, beta = gdn_gates(a, b, A_log, dt_bias)
    o, stash = fns[impl](q, k, v, g, beta, state0, parents)
    return gated_rms_norm(o, z, norm_w, eps), windows, stash


def commit_tree_gdn(
    windows: jax.Array,  # [B, N, Kc-1, C] from tree_gdn_mixer / tree_conv
    stash: TreeGDNStash,
    state0: jax.Array,  # [B, Hv, dk, dv] the committed state the verify started from
    last: jax.Array,  # [B] int32 last accepted node
) -> tuple[jax.Array, jax.Array]:  # (conv_state [B, Kc-1, C], state [B, Hv, dk, dv] fp32)
    """New committed (conv, recurrent) state after accepting root -> ... -> last."""
    return commit_conv(windows, last), tree_gdn_commit(stash, state0, last)
