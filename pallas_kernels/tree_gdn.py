"""Tree-aware Gated DeltaNet verify: the Pallas tree-WY kernel and its sequential oracle (jax only).

A draft tree of N nodes per request (node 0 = the last committed token, parents before children) is verified
without touching the committed state: every node behaves as if the chain root -> ... -> node had been
appended to the committed sequence.

* ``reference_tree_gdn``: sequential oracle, a ``lax.scan`` over nodes with a per-node state table (node t
  starts from its parent's state, node 0 from the committed state).
* ``tree_gdn``: the parallel tree-WY form, one (request, v-head) per grid point.  With ``M`` the
  ancestor-or-self mask and ``G = M g`` the path cumsum of log-decays (per v-head)::

      D[i, j] = exp(G_i - G_j) if j <= i (ancestor-or-self) else 0   (-inf masked before exp; factors <= 1)
      A[i, j] = beta_i (k_i . k_j) D[i, j] for proper ancestors j
      U = (I + A)^-1 [beta (v - exp(G) (K S0))]                          (unit lower-triangular)
      O = exp(G) (Q S0) + ((Q K^T) * D) U

  It returns ``O`` with ``U`` and ``G``, from which the accepted node's state folds (``exp(G_l) S0 +
  sum_{j <= l} exp(G_l - G_j) k_j u_j^T``).  The model-level verify (tree conv, the XLA form ``tree_gdn_wy``,
  the stash and the commit) lives with the models (``models/tree_gdn.py``).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.delta_rule import HIGHEST, gdn_step, l2norm, normalize_qk

GDN_KERNEL_DTYPES = ("float32", "bfloat16")


def reference_tree_gdn(
    q: jax.Array,  # [B, N, Hk, dk] raw (post-conv) queries of the tree nodes
    k: jax.Array,  # [B, N, Hk, dk]
    v: jax.Array,  # [B, N, Hv, dv]
    g: jax.Array,  # [B, N, Hv] log-decay
    beta: jax.Array,  # [B, N, Hv]
    state0: jax.Array,  # [B, Hv, dk, dv] committed state (read only)
    parents: jax.Array,  # [B, N] int32, parents[:, 0] = -1
) -> tuple[jax.Array, jax.Array]:  # (o [B, N, Hv, dv] in q.dtype, node_states [B, N, Hv, dk, dv] fp32)
    """Sequential oracle: node t's state = its parent's state advanced by node t's token (node 0: ``state0``).

    ``node_states[:, t]`` is the state after node t.  Shapes are the caller's to check.
    """
    bsz, n = parents.shape
    qn, kn = normalize_qk(q, k, v.shape[-2])
    state0 = state0.astype(jnp.float32)
    parents = jnp.asarray(parents, jnp.int32)
    rows = jnp.arange(bsz)

    def step(table, xs):  # table [B, N, Hv, dk, dv]
        t, par, *tok = xs
        s_in = jnp.where((par >= 0)[:, None, None, None], table[rows, jnp.maximum(par, 0)], state0)
        s, o = gdn_step(s_in, *tok)
        return table.at[:, t].set(s), o

    tokens = tuple(jnp.moveaxis(x.astype(jnp.float32), 1, 0) for x in (qn, kn, v, g, beta))
    xs = (jnp.arange(n), parents.T) + tokens
    table = jnp.zeros((bsz, n) + state0.shape[1:], jnp.float32)
    table, o = jax.lax.scan(step, table, xs)
    return jnp.moveaxis(o, 0, 1).astype(q.dtype), table


def _dot(a, b, contract=((1,), (0,))):
    dims = (contract, ((), ()))
    return jax.lax.dot_general(a, b, dims, precision=HIGHEST, preferred_element_type=jnp.float32)


def _tree_gdn_kernel(
    q_ref,  # [N, dk] one (request, value head)'s queries (its q/k head: value head // rep)
    k_ref,  # [N, dk] keys
    v_ref,  # [N, dv] values
    gc_ref,  # [N, 1] log-decay per node (column form)
    gr_ref,  # [1, N] the same, row form
    b_ref,  # [N, 1] beta (write strength) per node
    s_ref,  # [dk, dv] the committed recurrent state
    m_ref,  # [N, N] f32 0/1 ancestor-or-self mask of the request's tree
    o_ref,  # [N, dv] out: the mixer output per node
    u_ref,  # [N, dv] out, fp32: the WY pseudo-values (the commit rebuilds an accepted node's state from them)
    gp_ref,  # [N, 1] out, fp32: path-cumulative log-decay per node
):
    n, dk = q_ref.shape
    q = l2norm(q_ref[...]) * dk**-0.5  # [N, dk]
    k = l2norm(k_ref[...])
    mask = m_ref[...]  # [N, N] f32 0/1 ancestor-or-self
    g_col = _dot(mask, gc_ref[...].astype(jnp.float32))  # [N, 1] path cumsum
    g_row = _dot(gr_ref[...].astype(jnp.float32), mask, ((1,), (1,)))  # [1, N]
    rows = jax.lax.broadcasted_iota(jnp.int32, (n, n), 0)
    cols = jax.lax.broadcasted_iota(jnp.int32, (n, n), 1)
    on = mask > 0
    decay = jnp.exp(jnp.where(on, g_col - g_row, -jnp.inf))
    beta = b_ref[...].astype(jnp.float32)  # [N, 1]
    neg_a = jnp.where(on & (rows != cols), -beta * _dot(k, k, ((1,), (1,))) * decay, 0.0)  # nilpotent
    s0 = s_ref[...].astype(jnp.float32)  # [dk, dv]
    eg = jnp.exp(g_col)
    u = beta * (v_ref[...].astype(jnp.float32) - eg * _dot(k, s0))
    # (I + A)^-1 = (I - A)(I + A^2)(I + A^4)...: exact once 2^m >= N (A^N = 0); the factors commute.
    power = neg_a
    for i in range(math.ceil(math.log2(n)) if n > 1 else 0):
        if i:
            power = _dot(power, power)
        u = u + _dot(power, u)
    o_ref[...] = (eg * _dot(q, s0) + _dot(_dot(q, k, ((1,), (1,))) * decay, u)).astype(o_ref.dtype)
    u_ref[...] = u
    gp_ref[...] = g_col


@functools.partial(jax.jit, static_argnames=("interpret", "vmem_limit_bytes"))
def _tree_gdn_call(q, k, v, g, beta, state0, mask, interpret, vmem_limit_bytes=None):
    bsz, n, hk, dk = q.shape
    hv, dv = v.shape[-2:]
    rep = hv // hk
    heads_first = lambda x: jnp.moveaxis(x, 2, 1)  # [B, N, H, ...] -> [B, H, N, ...]
    gh, bh = heads_first(g)[..., None], heads_first(beta)[..., None]  # [B, Hv, N, 1]
    # GVA head map; lax.div (not //) lowers without sign ops, which Mosaic cross-lowering cannot handle
    per_qk = pl.BlockSpec((None, None, n, dk), lambda b, h: (b, jax.lax.div(h, rep), 0, 0))
    per_v = pl.BlockSpec((None, None, n, dv), lambda b, h: (b, h, 0, 0))
    col = pl.BlockSpec((None, None, n, 1), lambda b, h: (b, h, 0, 0))
    row = pl.BlockSpec((None, None, 1, n), lambda b, h: (b, h, 0, 0))
    o, u, gp = pl.pallas_call(
        _tree_gdn_kernel,
        grid=(bsz, hv),
        in_specs=[
            per_qk, per_qk, per_v, col, row, col,
            pl.BlockSpec((None, None, dk, dv), lambda b, h: (b, h, 0, 0)),
            pl.BlockSpec((None, n, n), lambda b, h: (b, 0, 0)),
        ],
        out_specs=[per_v, per_v, col],
        out_shape=[
            jax.ShapeDtypeStruct((bsz, hv, n, dv), q.dtype),
            jax.ShapeDtypeStruct((bsz, hv, n, dv), jnp.float32),
            jax.ShapeDtypeStruct((bsz, hv, n, 1), jnp.float32),
        ],
        compiler_params=None if vmem_limit_bytes is None else pltpu.CompilerParams(vmem_limit_bytes=vmem_limit_bytes),
        interpret=interpret,
    )(heads_first(q), heads_first(k), heads_first(v), gh, jnp.swapaxes(gh, -1, -2), bh,
      state0.astype(jnp.float32), mask.astype(jnp.float32))
    return heads_first(o), heads_first(u), heads_first(gp)[..., 0]


def tree_gdn(
    q: jax.Array,  # [B, N, Hk, dk] raw (post-conv) queries of the tree nodes
    k: jax.Array,  # [B, N, Hk, dk]
    v: jax.Array,  # [B, N, Hv, dv]
    g: jax.Array,  # [B, N, Hv] log-decay
    beta: jax.Array,  # [B, N, Hv]
    state0: jax.Array,  # [B, Hv, dk, dv] committed state (read only)
    mask: jax.Array,  # [B, N, N] bool ancestor-or-self mask of the tree
    *,
    interpret=False,  # bool, or a pltpu.InterpretParams for the TPU-semantics interpreter
    vmem_limit_bytes: int | None = None,  # the kernel's scoped VMEM limit (default: the compiler's)
) -> tuple[jax.Array, jax.Array, jax.Array]:  # (o [B, N, Hv, dv] in q.dtype, u [B, N, Hv, dv], G [B, N, Hv])
    """Pallas (TPU-style) tree-WY verify, grid (B, Hv); ``(I + A)^-1`` by nilpotent squaring (matmuls only).

    Returns ``O``, ``U`` and ``G`` (fp32) of the form above; ``reference_tree_gdn`` is its oracle.  Dtypes
    (``GDN_KERNEL_DTYPES``): q, k, v share one dtype, fp32 or bf16, which ``o`` has too; g, beta and
    ``state0`` are cast to fp32 here; all the math inside is fp32.  Anything else raises.
    """
    if not q.dtype == k.dtype == v.dtype or jnp.dtype(q.dtype).name not in GDN_KERNEL_DTYPES:
        raise ValueError(f"q, k, v must share one of {GDN_KERNEL_DTYPES}, got {q.dtype}, {k.dtype}, {v.dtype}")
    for name, x in (("g", g), ("beta", beta), ("state0", state0)):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise ValueError(f"{name} must be floating point, got {x.dtype}")
    if mask.shape != q.shape[:2] + q.shape[1:2]:
        raise ValueError(f"mask must be [B, N, N] = {q.shape[:2] + q.shape[1:2]}, got {mask.shape}")
    g, beta, state0 = g.astype(jnp.float32), beta.astype(jnp.float32), state0.astype(jnp.float32)
    return _tree_gdn_call(q, k, v, g, beta, state0, mask, interpret, vmem_limit_bytes)
