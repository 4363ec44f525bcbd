"""Domino's GRU correction head: ``logits = base + W2 . SiLU(W1 . [ph ; s])`` with ``s`` a bias-free GRU
run over the target's embeddings of the tokens on the draft path (PyTorch gate order r, z, n).

Weights are stored ``[in, out]`` except ``w2`` which is ``[V, E]`` (a row per token, so the top-M candidate
rows can be gathered).  HF keys: ``prefix_gru.weight_ih_l0 [3G, H]`` -> ``w_ih.T``,
``prefix_gru.weight_hh_l0 [3G, G]`` -> ``w_hh.T``, ``embed_proj.0.weight [E, H+G]`` -> ``w1.T``,
``embed_proj.2.weight [V, E]`` -> ``w2``.  Programs that bake their weights in on a CPU hold ``w_ih``, ``w_hh``
and ``w1`` as ``cpu_dot.PackedWeight`` (``cpu_options.pack_dense``): the GRU's dots then run the few-row kernel.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from dtree_jax import cpu_dot
from dtree_jax.models.sharding import axes


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DominoHead:
    w_ih: jax.Array = axes(None, None)  # [H, 3G]
    w_hh: jax.Array = axes(None, None)  # [G, 3G]
    w1: jax.Array = axes(None, None)  # [H + G, E]
    w2: jax.Array = axes("vocab", None)  # [V, E]

    @property
    def gru_dim(self) -> int:
        return self.w_hh.shape[0]

    @property
    def hidden_dim(self) -> int:
        return self.w_ih.shape[0]


def gru_step(head: DominoHead, state: jax.Array, emb: jax.Array) -> jax.Array:
    """One GRU step: ``state [..., G]``, ``emb [..., H]`` (target embeddings) -> new state ``[..., G]`` (fp32)."""
    g = head.gru_dim
    gi = cpu_dot.matmul_fp32(emb.astype(jnp.float32), head.w_ih)
    gh = cpu_dot.matmul_fp32(state.astype(jnp.float32), head.w_hh)
    r = jax.nn.sigmoid(gi[..., :g] + gh[..., :g])
    z = jax.nn.sigmoid(gi[..., g : 2 * g] + gh[..., g : 2 * g])
    n = jnp.tanh(gi[..., 2 * g :] + r * gh[..., 2 * g :])
    return (1.0 - z) * n + z * state.astype(jnp.float32)


def gru_run(head: DominoHead, embs: jax.Array, state: jax.Array | None = None) -> jax.Array:
    """Runs the GRU over ``embs [..., T, H]`` from zeros (or ``state``); returns all states ``[..., T, G]``."""
    if state is None:
        state = jnp.zeros(embs.shape[:-2] + (head.gru_dim,), jnp.float32)

    def step(s, e):
        s = gru_step(head, s, e)
        return s, s

    _, states = jax.lax.scan(step, state, jnp.moveaxis(embs, -2, 0))
    return jnp.moveaxis(states, 0, -2)


def correction_hidden(head: DominoHead, ph: jax.Array, state: jax.Array) -> jax.Array:
    """``SiLU(W1 . [ph ; s])``: ``ph [..., H]``, ``state [..., G]`` (leading axes broadcast) -> ``[..., E]``
    (fp32)."""
    lead = jnp.broadcast_shapes(ph.shape[:-1], state.shape[:-1])
    rows = jnp.concatenate([jnp.broadcast_to(ph.astype(jnp.float32), lead + ph.shape[-1:]),
                            jnp.broadcast_to(state.astype(jnp.float32), lead + state.shape[-1:])], axis=-1)
    return jax.nn.silu(cpu_dot.matmul_fp32(rows, head.w1))


def corrected_logits(head: DominoHead, base: jax.Array, ph: jax.Array, state: jax.Array) -> jax.Array:
    """Full-vocabulary corrected logits ``base [..., V] + W2 . SiLU(W1 . [ph ; s])`` (fp32)."""
    hid = correction_hidden(head, ph, state)
    return base.astype(jnp.float32) + jnp.einsum("...e,ve->...v", hid, head.w2.astype(jnp.float32))
