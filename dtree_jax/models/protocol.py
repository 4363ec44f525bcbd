"""What the decode loop needs from its models: the ``TargetModel`` and ``DrafterModel`` protocols.

Our targets are modules of functions (``dtree_jax.models.decoder`` for Qwen3 / Llama / Qwen2,
``dtree_jax.models.qwen3_5`` for the hybrid Gated-DeltaNet models); any object with these attributes decodes
with every method (a Flax NNX module through a thin adapter, for instance).  Our drafter is
``dtree_jax.models.drafter`` (DFlash, with or without the Domino GRU head); another drafter kind that
implements ``DrafterModel`` runs in the same loop.  ``params`` and ``cache`` are pytrees the loop passes
through untouched; ``cfg`` is static (hashable).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import jax


@runtime_checkable
class TargetModel(Protocol):
    def embed(self, params: Any, tokens: jax.Array) -> jax.Array:
        """``tokens [...]`` -> embeddings ``[..., H]`` (the drafter embeds its block with them)."""

    def embed_table(self, params: Any) -> jax.Array:
        """The embedding table ``[V, H]`` (the Domino GRU reads rows of it for every candidate token)."""

    def lm_head(self, params: Any, cfg: Any, x: jax.Array) -> jax.Array:
        """Final-normed hidden ``x [..., H]`` -> fp32 logits ``[..., V]`` (the drafter's base logits)."""

    def init_cache(self, cfg: Any, batch: int, max_len: int) -> Any:
        """A fresh cache holding ``max_len`` rows per request."""

    def prefill(self, params: Any, cfg: Any, tokens: jax.Array, cache: Any, prompt_lens: jax.Array,
                taps: tuple[int, ...] = ()) -> tuple[jax.Array, jax.Array, Any]:
        """Right-padded prompts ``tokens [B, P]`` -> ``(logits [B, P, V], feats [B, P, F], cache)`` with every
        request's state committed after its ``prompt_lens[b]`` real tokens."""

    def forward(
        self, params: Any, cfg: Any, tokens: jax.Array, positions: jax.Array, cache: Any, lens: jax.Array,
        local_mask: jax.Array, taps: tuple[int, ...] = (),
    ) -> tuple[jax.Array, jax.Array, Any]:
        """Tree verify: ``tokens, positions [B, N]`` after ``lens [B]`` committed tokens, node ``i`` seeing node
        ``j`` iff ``local_mask [B, N, N]``; ``(logits [B, N, V] fp32, feats [B, N, F], cache)``.  ``feats``
        concatenates HF's ``hidden_states[id + 1]`` for ``id`` in ``taps``."""

    def commit(self, cfg: Any, cache: Any, lens: jax.Array, path: jax.Array, num_emitted: jax.Array) -> Any:
        """Keeps the accepted ``path[:, :num_emitted]`` of the cache ``forward`` returned, as if those tokens had
        been appended after ``lens``; the caller then advances ``lens`` by ``num_emitted``."""


@runtime_checkable
class DrafterModel(Protocol):
    """A drafter conditioned on the target's features.  Its ``cfg`` states ``target_layer_ids`` (the taps it
    reads: HF's ``hidden_states[id + 1]``), ``block_size`` (cache rows a round's draft needs past the context),
    ``num_draft_rows`` (the deepest draft) and ``has_head`` (whether the Domino-corrected methods can use it)."""

    def init_drafter_cache(self, cfg: Any, batch: int, max_len: int) -> Any:
        """A fresh context cache holding ``max_len`` rows per request."""

    def append_context(self, params: Any, cfg: Any, cache: Any, ctx_lens: jax.Array, feats: jax.Array,
                       positions: jax.Array) -> Any:
        """Writes context rows from the target's ``feats [B, T, F]`` at ``[ctx_lens, ctx_lens + T)``."""

    def draft_round(self, params: Any, cfg: Any, target: TargetModel, target_params: Any, target_cfg: Any,
                    cache: Any, ctx_lens: jax.Array, root: jax.Array, rows: int | None = None
                    ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array | None]:
        """One round's draft after the committed ``root [B]``: ``(ph [B, K, H], base logits [B, K, V] fp32,
        root_state [B, G], vocab_ids)``, the scorers' inputs (``builders.DraftRound``); with a draft vocabulary
        ``vocab_ids [V']`` are its token ids and the base logits only their columns ``[B, K, V']``, else None."""

    def tree_inputs(self, params: Any, cfg: Any, target: TargetModel, target_params: Any) -> dict:
        """The rest of ``builders.build_tree``'s inputs: ``head``, ``embed``, ``pure_draft_prefix_len``,
        ``mask_token_id``."""

    def with_own_head(self, params: Any, cfg: Any, target: TargetModel, target_params: Any, target_cfg: Any,
                      vocab: Any = None) -> Any:
        """``params`` with their own copy of the target's output head (for programs that bake the weights in);
        with a draft ``vocab`` (``drafter.DraftVocab``), only its columns, every other token's draft logit -inf."""
