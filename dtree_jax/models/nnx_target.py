"""Bring your own target: a Flax NNX module as a ``TargetModel``.

The module supplies the model; the adapter supplies the speculative-decoding plumbing.  The module needs:

  * ``embed(tokens [...]) -> [..., H]`` and ``embedding_table() -> [V, H]`` (the drafter and the Domino GRU
    read the target's embeddings);
  * ``lm_head(x [..., H]) -> [..., V]`` fp32 logits of final-normed hidden states;
  * ``init_cache(batch, max_len)`` -> a pytree of arrays whose leaves are ``[B, L, ...]`` (row = position);
  * ``__call__(tokens [B, T], positions [B, T], cache, lens [B], local_mask [B, T, T], taps)`` ->
    ``(logits [B, T, V] fp32, feats [B, T, len(taps) * H], cache)``: each request attends to its committed
    rows ``[0, lens)`` and to the new tokens as ``local_mask`` says, writes the new K/V at rows
    ``lens .. lens + T``, and ``feats`` concatenates the hidden states after the layers in ``taps`` (after the
    final norm for the last layer, as HF's ``hidden_states``).

``prefill`` is one causal call from row 0 and ``commit`` compacts the accepted path's rows
(``models.cache.compact_kv``), so any KV-cache model works unchanged.  ``split(module)`` gives the adapter and
the params (the module's ``nnx.State``); ``api.Model(kind, None, params, impl=adapter)`` decodes with every
method.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from dtree_jax.models.cache import causal_prefill, compact_kv


@dataclasses.dataclass(frozen=True)
class NNXTarget:
    """The protocol's functions over ``nnx.merge(graphdef, params)``; hashable (static under ``jit``)."""

    graphdef: Any  # nnx.GraphDef
    abstract_params: Any = dataclasses.field(default=None, compare=False, hash=False)  # shapes, for init_cache

    def module(self, params):
        from flax import nnx

        return nnx.merge(self.graphdef, params)

    def embed(self, params, tokens: jax.Array) -> jax.Array:
        return self.module(params).embed(tokens)

    def embed_table(self, params) -> jax.Array:  # [V, H]
        return self.module(params).embedding_table()

    def lm_head(self, params, cfg, x: jax.Array) -> jax.Array:
        return self.module(params).lm_head(x)

    def init_cache(self, cfg, batch: int, max_len: int):
        return self.module(self.abstract_params).init_cache(batch, max_len)

    def forward(self, params, cfg, tokens, positions, cache, lens, local_mask, taps=()):
        return self.module(params)(tokens, positions, cache, lens, local_mask, taps)

    def prefill(self, params, cfg, tokens, cache, prompt_lens, taps=()):
        del prompt_lens  # rows past a prompt are never committed: the next round overwrites them
        return causal_prefill(self.forward, params, cfg, tokens, cache, taps)

    def commit(self, cfg, cache, lens, path, num_emitted):
        return compact_kv(cache, lens, path, num_emitted)


def split(module) -> tuple[NNXTarget, Any]:
    """``(adapter, params)`` for an NNX module satisfying the contract above; params are its ``nnx.State``."""
    from flax import nnx

    graphdef, state = nnx.split(module)
    for name in ("embed", "embedding_table", "lm_head", "init_cache", "__call__"):
        if not callable(getattr(module, name, None)):
            raise TypeError(f"{type(module).__name__} has no {name}(); see dtree_jax.models.nnx_target")
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)), state)
    return NNXTarget(graphdef, abstract), state
