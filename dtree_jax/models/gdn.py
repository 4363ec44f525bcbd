"""Gated DeltaNet (Qwen3-Next / Qwen3.5 / Qwen3.6 ``linear_attn``) token-mixer core, functional JAX.

The projections (``in_proj_*``, ``out_proj``) live in the hybrid model; this module owns what sits between
them:

  1. ``causal_conv``: depthwise causal conv1d + SiLU over the packed ``[q | k | v]`` channels
     (``w[:, Kc-1]`` multiplies the current token; the conv state holds the last ``Kc-1`` raw inputs);
  2. ``gdn_gates``: ``g = -exp(A_log) * softplus(a + dt_bias)`` (log-decay <= 0), ``beta = sigmoid(b)``;
  3. the gated delta rule per v-head with state ``S [dk, dv]`` (fp32), after ``l2norm`` of q/k and
     ``q *= dk**-0.5``, each v-head ``h`` reading q/k head ``h // (Hv // Hk)``::

         S <- exp(g_t) S                    # decay first
         u_t = beta_t (v_t - S^T k_t)       # prediction from the decayed state
         S <- S + k_t u_t^T
         o_t = S^T q_t                      # output from the updated state

     ``recurrent_gated_delta_rule`` (``lax.scan``; decode) and ``chunk_gated_delta_rule`` (WY/UT form over
     chunks of 64; prefill and multi-token chains) compute the same thing;
  4. ``gated_rms_norm``: ``w * rmsnorm(o) * silu(z)`` per head over ``dv`` (plain ``w``, not ``1 + w``).

One layer, with ``qkv = x @ Wqkv`` ``[B, T, 2*Hk*dk + Hv*dv]``, ``z [B, T, Hv, dv]``, ``a, b [B, T, Hv]``::

    y, conv_state = causal_conv(qkv, conv_w, conv_state)
    q, k, v = split_qkv(y, hk, dk, hv, dv)
    g, beta = gdn_gates(a, b, A_log, dt_bias)
    o, state = chunk_gated_delta_rule(q, k, v, g, beta, state)   # or recurrent_gated_delta_rule for T == 1
    out = gated_rms_norm(o, z, norm_w).reshape(B, T, Hv * dv) @ Wout

Tree verification (per-node conv windows and states along parent pointers) is in
``dtree_jax/models/tree_gdn.py`` (the Pallas kernel and its oracle: ``pallas_kernels/tree_gdn.py``); the
per-token math (``l2norm``, ``normalize_qk``, ``gdn_step``) is ``pallas_kernels/delta_rule.py``, shared with them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.delta_rule import fp32_einsum, gdn_step, normalize_qk

CHUNK_SIZE = 64


# ----------------------------------------------------------------------------------------------------------
# Gates, normalisation, conv
# ----------------------------------------------------------------------------------------------------------


def gdn_gates(
    a: jax.Array,  # [..., Hv] raw in_proj_a output
    b: jax.Array,  # [..., Hv] raw in_proj_b output
    A_log: jax.Array,  # [Hv]
    dt_bias: jax.Array,  # [Hv]
) -> tuple[jax.Array, jax.Array]:  # (g [..., Hv] log-decay <= 0, beta [..., Hv]), fp32
    """``g = -exp(A_log) * softplus(a + dt_bias)``, ``beta = sigmoid(b)`` (softplus: identity above 20)."""
    x = a.astype(jnp.float32) + dt_bias.astype(jnp.float32)
    softplus = jnp.where(x > 20.0, x, jnp.log1p(jnp.exp(jnp.minimum(x, 20.0))))
    g = -jnp.exp(A_log.astype(jnp.float32)) * softplus
    return g, jax.nn.sigmoid(b.astype(jnp.float32))


def split_qkv(
    y: jax.Array,  # [..., 2*Hk*dk + Hv*dv] conv output, channels [q | k | v], each head-major
    hk: int,
    dk: int,
    hv: int,
    dv: int,
) -> tuple[jax.Array, jax.Array, jax.Array]:  # ([..., Hk, dk], [..., Hk, dk], [..., Hv, dv])
    """Splits the packed conv channels into per-head q, k, v."""
    if y.shape[-1] != 2 * hk * dk + hv * dv:
        raise ValueError(f"expected {2 * hk * dk + hv * dv} channels (Hk={hk}, dk={dk}, Hv={hv}, dv={dv}), "
                         f"got {y.shape[-1]}")
    lead = y.shape[:-1]
    q = y[..., : hk * dk].reshape(lead + (hk, dk))
    k = y[..., hk * dk : 2 * hk * dk].reshape(lead + (hk, dk))
    v = y[..., 2 * hk * dk :].reshape(lead + (hv, dv))
    return q, k, v


def conv_taps(
    window: jax.Array,  # [..., Kc, C] raw inputs, oldest first, the current token last
    w: jax.Array,  # [C, Kc] depthwise weights (HF conv1d.weight[:, 0, :])
    dtype,
) -> jax.Array:  # [..., C] in dtype
    """``silu(sum_j w[:, j] * window[j])`` in fp32, cast to ``dtype``."""
    acc = jnp.sum(window.astype(jnp.float32) * jnp.swapaxes(w, 0, 1).astype(jnp.float32), axis=-2)
    return jax.nn.silu(acc).astype(dtype)


def causal_conv(
    x: jax.Array,  # [B, T, C] raw packed q|k|v projections
    w: jax.Array,  # [C, Kc]
    conv_state: jax.Array | None = None,  # [B, Kc-1, C] previous raw inputs, oldest first (None: zeros)
) -> tuple[jax.Array, jax.Array]:  # (y [B, T, C] in x.dtype, new conv_state [B, Kc-1, C] in x.dtype)
    """Depthwise causal conv1d + SiLU; prefill (any T) and decode (T = 1) alike.

    Token t sees ``[.., x[t-1], x[t]]`` continuing into ``conv_state`` before the first token; the new state
    is the last ``Kc-1`` raw inputs of ``[conv_state ; x]`` (part of the old state survives when T < Kc-1).
    """
    bsz, t, c = x.shape
    if w.ndim != 2 or w.shape[0] != c:
        raise ValueError(f"conv weight must be [C={c}, Kc], got {w.shape}")
    kc = w.shape[1]
    if conv_state is None:
        conv_state = jnp.zeros((bsz, kc - 1, c), x.dtype)
    if conv_state.shape != (bsz, kc - 1, c):
        raise ValueError(f"conv_state must be {(bsz, kc - 1, c)}, got {conv_state.shape}")
    xp = jnp.concatenate([conv_state.astype(x.dtype), x], axis=1)  # [B, Kc-1+T, C]
    windows = jnp.stack([xp[:, j : j + t] for j in range(kc)], axis=2)  # [B, T, Kc, C]
    return conv_taps(windows, w, x.dtype), xp[:, t:]


def gated_rms_norm(
    x: jax.Array,  # [..., dv] core output
    z: jax.Array,  # [..., dv] gate (in_proj_z output)
    w: jax.Array,  # [dv] plain weight (init ones)
    eps: float = 1e-6,
) -> jax.Array:  # [..., dv] in x.dtype
    """``Qwen3_5RMSNormGated``: ``(w * rmsnorm(x).astype(x.dtype)) * silu(z)``, math in fp32."""
    xf = x.astype(jnp.float32)
    y = (xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)).astype(x.dtype)
    y = (w.astype(x.dtype) * y).astype(jnp.float32)
    return (y * jax.nn.silu(z.astype(jnp.float32))).astype(x.dtype)


# ----------------------------------------------------------------------------------------------------------
# The gated delta rule
# ----------------------------------------------------------------------------------------------------------


def _check_gdn_inputs(q, k, v, g, beta, state):
    bsz, t, hk, dk = q.shape
    hv, dv = v.shape[-2:]
    if k.shape != q.shape or v.shape[:2] != (bsz, t):
        raise ValueError(
            f"q, k must be [B, T, Hk, dk] and v [B, T, Hv, dv]; got {q.shape}, {k.shape}, {v.shape}")
    if g.shape != (bsz, t, hv) or beta.shape != (bsz, t, hv):
        raise ValueError(f"g and beta must be {(bsz, t, hv)}, got {g.shape} and {beta.shape}")
    if state is None:
        return jnp.zeros((bsz, hv, dk, dv), jnp.float32)
    if state.shape != (bsz, hv, dk, dv):
        raise ValueError(f"state must be {(bsz, hv, dk, dv)}, got {state.shape}")
    return state.astype(jnp.float32)


def recurrent_gated_delta_rule(
    q: jax.Array,  # [B, T, Hk, dk] raw (post-conv) queries
    k: jax.Array,  # [B, T, Hk, dk]
    v: jax.Array,  # [B, T, Hv, dv]
    g: jax.Array,  # [B, T, Hv] log-decay (gdn_gates)
    beta: jax.Array,  # [B, T, Hv]
    state: jax.Array | None = None,  # [B, Hv, dk, dv] initial state (None: zeros)
) -> tuple[jax.Array, jax.Array]:  # (o [B, T, Hv, dv] in q.dtype, final state [B, Hv, dk, dv] fp32)
    """Token-by-token gated delta rule (``lax.scan`` over T); the decode path.  Normalises q/k itself."""
    state = _check_gdn_inputs(q, k, v, g, beta, state)
    qn, kn = normalize_qk(q, k, v.shape[-2])

    def step(s, xs):
        return gdn_step(s, *xs)

    xs = tuple(jnp.moveaxis(x.astype(jnp.float32), 1, 0) for x in (qn, kn, v, g, beta))
    state, o = jax.lax.scan(step, state, xs)
    return jnp.moveaxis(o, 0, 1).astype(q.dtype), state


def unit_lower_solve(a: jax.Array, rhs: jax.Array) -> jax.Array:  # [..., N, N], [..., N, M] -> [..., N, M]
    """Solves ``(I + strict_lower(a)) X = rhs`` (the diagonal and upper triangle of ``a`` are ignored)."""
    return jax.lax.linalg.triangular_solve(a, rhs, left_side=True, lower=True, unit_diagonal=True)


def chunk_gated_delta_rule(
    q: jax.Array,  # [B, T, Hk, dk] raw (post-conv) queries
    k: jax.Array,  # [B, T, Hk, dk]
    v: jax.Array,  # [B, T, Hv, dv]
    g: jax.Array,  # [B, T, Hv] log-decay
    beta: jax.Array,  # [B, T, Hv]
    state: jax.Array | None = None,  # [B, Hv, dk, dv] initial state (None: zeros)
    chunk_size: int = CHUNK_SIZE,
) -> tuple[jax.Array, jax.Array]:  # (o [B, T, Hv, dv] in q.dtype, final state [B, Hv, dk, dv] fp32)
    """Chunked (WY/UT) gated delta rule for prefill; equals ``recurrent_gated_delta_rule``.

    T is zero-padded to a multiple of ``chunk_size`` (padded tokens have g = beta = k = 0, so they leave the
    state unchanged).  Within a chunk with cumulative log-decay ``G``:
    ``A[i, j] = beta_i (k_i . k_j) exp(G_i - G_j)`` (j < i), ``U = (I + A)^-1 (beta v)``,
    ``W = (I + A)^-1 (beta k exp(G))``; per chunk ``v_new = U - W S``,
    ``o = (q exp(G)) S + ((q k^T) exp(G_i - G_j))_{j<=i} v_new``,
    ``S <- exp(G_last) S + (k exp(G_last - G))^T v_new``.
    """
    state = _check_gdn_inputs(q, k, v, g, beta, state)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    bsz, t, _, _ = q.shape
    hv = v.shape[-2]
    qn, kn = normalize_qk(q, k, hv)
    c = chunk_size
    pad = (-t) % c
    n = (t + pad) // c

    def chunks(x):  # [B, T, Hv, ...] -> [B, Hv, n, C, ...] fp32, zero-padded
        x = jnp.pad(x.astype(jnp.float32), [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        x = jnp.moveaxis(x, 1, 2)  # [B, Hv, T', ...]
        return x.reshape(x.shape[:2] + (n, c) + x.shape[3:])

    qc, kc, vc, gc, bc = (chunks(x) for x in (qn, kn, v, g, beta))
    gcum = jnp.cumsum(gc, axis=-1)  # [B, Hv, n, C]
    causal = jnp.tril(jnp.ones((c, c), bool))
    diff = jnp.where(causal, gcum[..., :, None] - gcum[..., None, :], -jnp.inf)
    decay = jnp.exp(diff)  # [B, Hv, n, C, C], exp(G_i - G_j) for j <= i, else 0
    kb = kc * bc[..., None]
    a = fp32_einsum("...ik,...jk->...ij", kb, kc) * decay
    u = unit_lower_solve(a, vc * bc[..., None])  # [B, Hv, n, C, dv]
    w = unit_lower_solve(a, kb * jnp.exp(gcum)[..., None])  # [B, Hv, n, C, dk]
    qk = fp32_einsum("...ik,...jk->...ij", qc, kc) * decay
    q_dec = qc * jnp.exp(gcum)[..., None]
    k_dec = kc * jnp.exp(gcum[..., -1:] - gcum)[..., None]
    chunk_decay = jnp.exp(gcum[..., -1])  # [B, Hv, n]

    def step(s, xs):  # s [B, Hv, dk, dv]
        u_i, w_i, qk_i, qd_i, kd_i, cd_i = xs
        v_new = u_i - fp32_einsum("bhck,bhkv->bhcv", w_i, s)
        o = fp32_einsum("bhck,bhkv->bhcv", qd_i, s) + fp32_einsum("bhij,bhjv->bhiv", qk_i, v_new)
        s = s * cd_i[..., None, None] + fp32_einsum("bhck,bhcv->bhkv", kd_i, v_new)
        return s, o

    xs = tuple(jnp.moveaxis(x, 2, 0) for x in (u, w, qk, q_dec, k_dec, chunk_decay))
    state, o = jax.lax.scan(step, state, xs)  # o [n, B, Hv, C, dv]
    o = jnp.moveaxis(o, 0, 2).reshape(bsz, hv, n * c, -1)[:, :, :t]
    return jnp.moveaxis(o, 1, 2).astype(q.dtype), state


# ----------------------------------------------------------------------------------------------------------
# The whole token-mixer core between the projections
# ----------------------------------------------------------------------------------------------------------


def gdn_mixer(
    qkv: jax.Array,  # [B, T, 2*Hk*dk + Hv*dv] in_proj_qkv output (raw, pre-conv)
    z: jax.Array,  # [B, T, Hv, dv] in_proj_z output
    a: jax.Array,  # [B, T, Hv] in_proj_a output
    b: jax.Array,  # [B, T, Hv] in_proj_b output
    conv_w: jax.Array,  # [C, Kc] conv1d.weight[:, 0, :]
    A_log: jax.Array,  # [Hv]
    dt_bias: jax.Array,  # [Hv]
    norm_w: jax.Array,  # [dv] gated-norm weight
    conv_state: jax.Array | None,  # [B, Kc-1, C] (None: zeros)
    state: jax.Array | None,  # [B, Hv, dk, dv] fp32 (None: zeros)
    *,
    num_k_heads: int,
    head_k_dim: int,
    eps: float = 1e-6,
) -> tuple[jax.Array, jax.Array, jax.Array]:  # (y [B, T, Hv, dv] in qkv.dtype, conv_state, state)
    """conv + SiLU -> split -> gates -> delta rule (recurrent for T == 1, chunked otherwise) -> gated norm.

    ``y.reshape(B, T, Hv * dv) @ out_proj`` is the layer output; the returned states continue the sequence.
    """
    hv, dv = z.shape[-2:]
    y, conv_state = causal_conv(qkv, conv_w, conv_state)
    q, k, v = split_qkv(y, num_k_heads, head_k_dim, hv, dv)
    g, beta = gdn_gates(a, b, A_log, dt_bias)
    rule = recurrent_gated_delta_rule if qkv.shape[1] == 1 else chunk_gated_delta_rule
    o, state = rule(q, k, v, g, beta, state)
    return gated_rms_norm(o, z, norm_w, eps), conv_state, state
