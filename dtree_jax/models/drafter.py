"""DFlash block drafter with the optional Domino GRU head, functional JAX.

Per round (the drafter's context length always equals the target's committed length ``lens``):
  1. ``append_context`` projects the target features of the rows committed last round (root + accepted path,
     or the whole prompt after prefill) with ``hidden_norm(fc(.))`` and writes their K/V (k_proj, k_norm,
     RoPE at their absolute positions; no per-layer input norm) at ``[ctx_lens, ctx_lens + T)``; the caller
     then advances ``ctx_lens`` by the number of valid rows;
  2. ``draft_block`` runs the block ``[root, MASK, ...]`` (embedded with the target's table) at positions
     ``ctx_lens + arange(block_size)``; block queries attend non-causally to the context and the whole block.
     The block's K/V are written only into a throw-away copy of the cache (the "crop").  Per draft layer
     the config may make the block causal and/or give it a sliding window (``causal_layers``,
     ``layer_windows``), and ``input_embedding_scale`` scales the block's embeddings, as in ``dflash``;
  3. ``draft_rows`` picks the rows ``ph [B, K, H]`` with ``ph[d]`` predicting the token at depth ``d + 1``;
     ``path_logits`` gives base (+ Domino-corrected) logits along a given path.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dtree_jax import cpu_dot
from dtree_jax.models.cache import KVCache, init_kv_cache
from dtree_jax.models.config import DrafterConfig
from dtree_jax.models.domino_head import DominoHead, corrected_logits, gru_run, gru_step
from dtree_jax.models.layers import (
    LayerParams,
    Leaf,
    abstract_leaf,
    decoder_layer,
    hf_leaf,
    kv_project,
    layer_hf_shapes,
    load_layer,
    rms_norm,
    rope_tables,
    write_rows,
)
from dtree_jax.models.sharding import axes


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DrafterParams:
    fc: jax.Array = axes("taps", None)  # [n_feat * H, H]
    hidden_norm: jax.Array = axes(None)  # [H]
    layers: tuple[LayerParams, ...]
    norm: jax.Array = axes(None)  # [H]
    head: DominoHead | None  # None for a plain DFlash checkpoint
    # [H, V + OWN_HEAD_PAD] fp32: own copy of the target's head; [H, V'] over a draft vocabulary (with_own_head)
    lm_head: jax.Array | None = axes(None, "vocab", default=None)
    # [V'] int32 with a draft vocabulary: the (sorted) token id of each lm_head column
    vocab_ids: jax.Array | None = axes("vocab", default=None)


def config_from_hf(d: Mapping[str, Any], **overrides) -> DrafterConfig:
    """``DrafterConfig.from_hf``; ``overrides`` (``dtype``, ``attention_impl``) go to the backbone."""
    return DrafterConfig.from_hf(d, **overrides)


def hf_shapes(cfg: DrafterConfig) -> dict[str, tuple[int, ...]]:
    """Every checkpoint key (bare, no ``model.`` prefix) -> HF shape; head keys only when ``has_head``."""
    m = cfg.model
    h = m.hidden_size
    shapes = {"fc.weight": (h, cfg.num_features * h), "hidden_norm.weight": (h,), "norm.weight": (h,)}
    for i in range(m.num_layers):
        shapes.update({f"layers.{i}.{k}": s for k, s in layer_hf_shapes(m).items()})
    if cfg.has_head:
        g, e = cfg.gru_hidden_dim, cfg.emb_dim
        shapes.update(
            {
                "prefix_gru.weight_ih_l0": (3 * g, h),
                "prefix_gru.weight_hh_l0": (3 * g, g),
                "embed_proj.0.weight": (e, h + g),
                "embed_proj.2.weight": (m.vocab_size, e),
            }
        )
    return shapes


def build_params(cfg: DrafterConfig, leaf: Leaf) -> DrafterParams:
    """The params pytree with each leaf made by ``leaf(hf_key, transpose)``: real tensors, abstract shapes, or
    the HF key itself (``dtree_jax.train.hf_tensors`` uses that to export)."""
    head = None
    if cfg.has_head:
        head = DominoHead(
            w_ih=leaf("prefix_gru.weight_ih_l0", True),
            w_hh=leaf("prefix_gru.weight_hh_l0", True),
            w1=leaf("embed_proj.0.weight", True),
            w2=leaf("embed_proj.2.weight", False),
        )
    return DrafterParams(
        fc=leaf("fc.weight", True),
        hidden_norm=leaf("hidden_norm.weight", False),
        layers=tuple(load_layer(leaf, f"layers.{i}.") for i in range(cfg.model.num_layers)),
        norm=leaf("norm.weight", False),
        head=head,
    )


def params_from_hf(cfg: DrafterConfig, get: Callable[[str], Any], dtype) -> DrafterParams:
    """Params from HF tensors: ``get(key)`` is called once per key of ``hf_shapes(cfg)``."""
    return build_params(cfg, hf_leaf(hf_shapes(cfg), get, dtype))


def abstract_params(cfg: DrafterConfig, dtype) -> DrafterParams:
    """``DrafterParams`` of ``jax.ShapeDtypeStruct``."""
    return build_params(cfg, abstract_leaf(hf_shapes(cfg), dtype))


def init_drafter_cache(cfg: DrafterConfig, batch: int, max_len: int) -> KVCache:
    """Zero context cache for the draft layers; ``max_len`` must cover the context plus one block."""
    return init_kv_cache(cfg.model, batch, max_len)


def project_context(params: DrafterParams, cfg: DrafterConfig, feats: jax.Array) -> jax.Array:
    """``hidden_norm(fc(feats))``: ``feats [B, T, n_feat * H]`` (target taps in ``target_layer_ids`` order) ->
    ``[B, T, H]``."""
    if feats.shape[-1] != params.fc.shape[0]:
        raise ValueError(f"feats last dim {feats.shape[-1]} != n_feat * H = {params.fc.shape[0]}")
    c = feats.astype(cfg.model.dtype) @ params.fc
    return rms_norm(c, params.hidden_norm, cfg.model.rms_norm_eps)


def append_context(
    params: DrafterParams,
    cfg: DrafterConfig,
    cache: KVCache,
    ctx_lens: jax.Array,  # [B] int32 context rows already in the cache
    feats: jax.Array,  # [B, T, n_feat * H] target features of the new context rows
    positions: jax.Array,  # [B, T] int32 absolute positions of those rows
) -> KVCache:
    """Writes the new context rows' K/V in every draft layer at ``[ctx_lens, ctx_lens + T)``."""
    m = cfg.model
    c = project_context(params, cfg, feats)
    cos, sin = rope_tables(positions, m.head_dim, m.rope_theta, m.rope_scaling)
    ks, vs = [], []
    for i, p in enumerate(params.layers):
        k, v = kv_project(p, m, c, cos, sin)
        ks.append(write_rows(cache.k[i], k, ctx_lens))
        vs.append(write_rows(cache.v[i], v, ctx_lens))
    return KVCache(k=tuple(ks), v=tuple(vs))


def draft_block(
    params: DrafterParams,
    cfg: DrafterConfig,
    target,  # the target's module (``models.protocol.TargetModel``): its embed
    target_params,
    cache: KVCache,
    ctx_lens: jax.Array,  # [B] int32 context length (= the target's committed length)
    root: jax.Array,  # [B] int32 last committed token
) -> jax.Array:  # [B, block_size, H]
    """Block hidden states ``ph_full`` (after the final norm) for ``[root, MASK, ..., MASK]``.

    Requires ``ctx_lens + block_size <= cache capacity``; the cache is not modified.
    """
    m, bs = cfg.model, cfg.block_size
    b = root.shape[0]
    tokens = jnp.concatenate(
        [root[:, None].astype(jnp.int32), jnp.full((b, bs - 1), cfg.mask_token_id, jnp.int32)], axis=1
    )
    x = (target.embed(target_params, tokens) * cfg.input_embedding_scale).astype(m.dtype)
    positions = jnp.asarray(ctx_lens, jnp.int32)[:, None] + jnp.arange(bs, dtype=jnp.int32)
    cos, sin = rope_tables(positions, m.head_dim, m.rope_theta, m.rope_scaling)
    offset = jnp.arange(bs)[:, None] - jnp.arange(bs)[None, :]  # query row - key row
    for i, p in enumerate(params.layers):
        causal, window = cfg.causal_layers[i], cfg.layer_windows[i]
        visible = offset >= 0 if causal else jnp.ones((bs, bs), bool)
        if window is not None:
            visible = visible & (jnp.abs(offset) < window)
        local = jnp.broadcast_to(visible, (b, bs, bs))
        x, _, _ = decoder_layer(p, m, x, cos, sin, cache.k[i], cache.v[i], ctx_lens, local, window)
    return rms_norm(x, params.norm, m.rms_norm_eps)


def draft_round(
    params: DrafterParams,
    cfg: DrafterConfig,
    target,  # the target's module (``models.protocol.TargetModel``): its embed and lm_head
    target_params,
    target_cfg,
    cache: KVCache,
    ctx_lens: jax.Array,  # [B] int32 context length (= the target's committed length)
    root: jax.Array,  # [B] int32 last committed token
    rows: int | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array | None]:
    """Everything a round's tree builder needs from the drafter: the draft rows ``ph [B, K', H]``, their base
    logits ``[B, K', V]`` fp32 (``scale_logits`` of the target's lm_head), the Domino GRU state ``[B, G]`` fp32
    after the root's embedding (``[B, 1]`` zeros for a plain DFlash drafter) and, with a draft vocabulary, its
    token ids ``[V']`` (the base logits then hold only their columns, ``[B, K', V']``; else None).  ``rows``:
    keep only the first ``K' = min(rows, K)`` draft rows (the depths the round's tree can reach), so the
    vocabulary-wide head runs on no other row; None keeps all K."""
    ph = draft_rows(draft_block(params, cfg, target, target_params, cache, ctx_lens, root), cfg)[:, :rows]
    base = scale_logits(cfg, head_logits(params, cfg, target, target_params, target_cfg, ph))
    if params.head is None:
        return ph, base, jnp.zeros((root.shape[0], 1), jnp.float32), params.vocab_ids
    embed_root = target.embed(target_params, root)
    zeros = jnp.zeros(embed_root.shape[:-1] + (params.head.gru_dim,), jnp.float32)
    return ph, base, gru_step(params.head, zeros, embed_root), params.vocab_ids


def tree_inputs(params: DrafterParams, cfg: DrafterConfig, target, target_params) -> dict:
    """What the tree builders read besides the round (``builders.build_tree``'s keywords): the Domino GRU head
    (None for plain DFlash), the target's embedding table (the GRU's inputs), the uncorrected prefix depths P and
    the dead-leaf token."""
    return dict(
        head=params.head,
        embed=target.embed_table(target_params),
        pure_draft_prefix_len=cfg.pure_draft_prefix_len,
        mask_token_id=cfg.mask_token_id,
    )


OWN_HEAD_PAD = 128  # zero columns that make the drafter's copy of the head a different shape from the target's


@dataclasses.dataclass(frozen=True)
class DraftVocab:
    """The tokens a drafter may propose (sorted, unique ids; EAGLE-3's "draft vocabulary"): its own head holds
    only their columns, so drafting reads ``V'`` of the head's ``V`` columns; every other token gets logit -inf in
    the draft.  Only the drafts change (the target verifies every token as before), so the output does not.
    Compared and hashed by a digest, so a ``loop.Spec`` holding one stays cheap to hash and to print."""

    ids: tuple[int, ...] = dataclasses.field(compare=False, repr=False)
    digest: str = ""

    @classmethod
    def of(cls, ids: Sequence[int], vocab_size: int) -> "DraftVocab":
        """Validated: a non-empty sequence of distinct token ids in ``[0, vocab_size)`` (ValueError otherwise)."""
        try:
            arr = np.asarray(ids)
        except (TypeError, ValueError) as e:
            raise ValueError(f"draft vocabulary: expected a sequence of token ids: {e}") from None
        if arr.ndim != 1 or arr.size == 0 or arr.dtype.kind not in "iu":
            raise ValueError("draft vocabulary: expected a non-empty flat sequence of integer token ids")
        if arr.min() < 0 or arr.max() >= vocab_size:
            raise ValueError(f"draft vocabulary: token ids must lie in [0, {vocab_size}), got {arr.min()}..{arr.max()}")
        unique = np.unique(arr)
        if unique.size != arr.size:
            raise ValueError(f"draft vocabulary: {arr.size - unique.size} repeated token ids")
        ids = tuple(int(i) for i in unique)
        return cls(ids, hashlib.sha256(np.asarray(ids, np.int64).tobytes()).hexdigest()[:16])

    def __repr__(self) -> str:
        return f"DraftVocab({len(self.ids)} tokens, {self.digest})"


def with_own_head(params: DrafterParams, cfg: DrafterConfig, target, target_params, target_cfg,
                  vocab: DraftVocab | None = None) -> DrafterParams:
    """``params`` with their own copy of the target's output head, ``[H, V + OWN_HEAD_PAD]`` fp32 (zero columns
    past ``V``), read back through ``target.lm_head`` (a linear map, so ``lm_head(I)`` is its matrix); with a
    draft ``vocab``, only its columns ``[H, V']`` and their token ids ``vocab_ids``.

    For programs that bake the weights in (``cpu_options``): XLA:CPU packs a constant weight for a dot once, at
    compile time, only when no other dot shares it, and merges identical constants; the draft and the verify both
    use the target's head, so neither was packed (SmolLM2's head at 4 + 5 rows: 17 ms shared, 9 ms with this copy).
    """
    eye = jnp.eye(cfg.model.hidden_size, dtype=jnp.float32)  # the draft rows are as wide as the target's
    head = target.lm_head(target_params, target_cfg, eye).astype(jnp.float32)  # [H, V]
    if vocab is None:
        return dataclasses.replace(params, lm_head=jnp.pad(head, ((0, 0), (0, OWN_HEAD_PAD))))
    ids = np.asarray(vocab.ids, np.int32)
    return dataclasses.replace(params, lm_head=head[:, ids], vocab_ids=jnp.asarray(ids))


def head_logits(
    params: DrafterParams, cfg: DrafterConfig, target, target_params, target_cfg, ph: jax.Array  # [..., H]
) -> jax.Array:  # [..., V] fp32, or [..., V'] with a draft vocabulary
    """The target's output head on the draft rows: the drafter's own copy when it holds one, else the target's;
    with a draft vocabulary only its ``V'`` columns (``params.vocab_ids``' tokens; never widened to ``V``: the
    scorers take their top-k over these columns)."""
    if params.lm_head is None:
        return target.lm_head(target_params, target_cfg, ph)
    logits = cpu_dot.matmul_fp32(ph, params.lm_head)
    return logits if params.vocab_ids is not None else logits[..., : cfg.model.vocab_size]


def scale_logits(cfg: DrafterConfig, logits: jax.Array) -> jax.Array:  # [..., V] fp32 -> [..., V] fp32
    """The ``dflash`` package's ``compute_logits`` on top of the target's lm_head: ``* output_multiplier``,
    then ``softcap * tanh(logits / softcap)`` when ``final_logit_softcapping`` is set."""
    if cfg.output_multiplier != 1.0:
        logits = logits * cfg.output_multiplier
    if cfg.final_logit_softcapping is not None:
        cap = cfg.final_logit_softcapping
        logits = jnp.tanh(logits / cap) * cap
    return logits


def draft_rows(ph_full: jax.Array, cfg: DrafterConfig) -> jax.Array:
    """``ph [B, K, H]`` with ``ph[d]`` predicting depth ``d + 1``: ``ph_full`` itself with ``shift_label``
    (K = block_size), else ``ph_full[:, 1:]`` (K = block_size - 1)."""
    return ph_full if cfg.shift_label else ph_full[:, 1:]


def path_logits(
    params: DrafterParams,
    cfg: DrafterConfig,
    target,  # the target's module (``models.protocol.TargetModel``): its embed and lm_head
    target_params,
    target_cfg,
    ph: jax.Array,  # [B, K, H] from draft_rows (any K' <= K leading rows)
    path: jax.Array,  # [B, K] int32 tokens [root, t_1, ..., t_{K-1}] along one path
) -> jax.Array:  # [B, K, V] fp32
    """Draft logits for depths ``1..K`` along ``path``: row ``d`` is ``lm_head(ph[d])``, plus for
    ``d >= pure_draft_prefix_len`` (Domino only) ``W2 . SiLU(W1 . [ph[d] ; s_d])`` with ``s_d`` the GRU state
    after the target embeddings of ``path[:d + 1]``."""
    base = scale_logits(cfg, target.lm_head(target_params, target_cfg, ph))
    if params.head is None:
        return base
    states = gru_run(params.head, target.embed(target_params, path))  # [B, K, G]
    corrected = corrected_logits(params.head, base, ph, states)
    use_head = jnp.arange(ph.shape[1]) >= cfg.pure_draft_prefix_len
    return jnp.where(use_head[None, :, None], corrected, base)
