"""Training of the small shipped pair: a byte-level Qwen3 target and a Domino drafter for it.

* Tokenizer: bytes 0..255 plus ``<|bos|> <|eos|> <|pad|> <|mask|>`` (ids 256..259), written as a HF
  ``tokenizer.json`` (byte-level BPE with no merges) so ``tokenizers`` and transformers can load it.
* Corpus: the Python standard library's own ``.py`` files, split by file into train and held-out sets.
* Target: next-token cross-entropy through the target's ``prefill`` (the same code that serves decoding).
* Drafter: the DFlash block-diffusion objective (block ``[anchor, MASK, ...]`` attends non-causally to the
  frozen target's features of every position before the anchor and to its own block; row d predicts the
  token at depth d + 1), then the Domino GRU head with the lambda_base curriculum:
  ``loss = (1 - lam) * CE(base + correction) + lam * CE(base)``, lam decaying from 1.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import pathlib
import sys
import time
from typing import Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
import optax

from dtree_jax.models import drafter
from dtree_jax.models.config import DrafterConfig

BOS, EOS, PAD, MASK = 256, 257, 258, 259
SPECIALS = ("<|bos|>", "<|eos|>", "<|pad|>", "<|mask|>")
VOCAB_SIZE = 264  # 260 used, padded to a multiple of 8


# ----------------------------------------------------------------------------------------------------------
# Tokenizer and corpus
# ----------------------------------------------------------------------------------------------------------


def _byte_chars() -> list[str]:
    """The GPT-2 byte-to-unicode table used by HF ByteLevel (printable bytes map to themselves)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def tokenizer_json() -> str:
    """A HF ``tokenizer.json`` mapping byte b to id b and the four specials to 256..259; encoding prepends
    ``<|bos|>``."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    vocab = {c: i for i, c in enumerate(_byte_chars())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    # Documents start with <|bos|> in training, so encoding a prompt does too.
    tok.post_processor = processors.TemplateProcessing(single=f"{SPECIALS[0]} $A", special_tokens=[(SPECIALS[0], BOS)])
    return tok.to_str()


def encode(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def stdlib_root() -> pathlib.Path:
    """Where this Python's standard library sources live."""
    return pathlib.Path(json.__file__).resolve().parent.parent


def stdlib_files(split: str, held_out_fraction: float = 0.1) -> list[pathlib.Path]:
    """The standard library's top-level and package ``.py`` files (no tests), split by a hash of the name."""
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    root = stdlib_root()
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and "test" not in p.parts
                   and "tests" not in p.parts and "idle_test" not in p.parts)
    if not files:
        raise RuntimeError(f"no standard library sources found under {root}")

    def held(p):
        h = int(hashlib.sha256(str(p.relative_to(root)).encode()).hexdigest()[:8], 16)
        return h / 0xFFFFFFFF < held_out_fraction

    return [p for p in files if held(p) == (split == "heldout")]


def corpus(split: str, max_bytes: int | None = None) -> np.ndarray:
    """Token stream ``<|bos|> file <|eos|> <|bos|> file <|eos|> ...`` as int32."""
    out, total = [], 0
    for p in stdlib_files(split):
        data = p.read_bytes()
        out.append(np.concatenate([[BOS], np.frombuffer(data, np.uint8), [EOS]]).astype(np.int32))
        total += len(data) + 2
        if max_bytes is not None and total >= max_bytes:
            break
    return np.concatenate(out)


def windows(stream: np.ndarray, batch: int, length: int, seed: int) -> Iterator[np.ndarray]:
    """Endless random windows ``[batch, length]`` of the stream."""
    rng = np.random.default_rng(seed)
    if len(stream) <= length:
        raise ValueError(f"corpus of {len(stream)} tokens is shorter than one window of {length}")
    while True:
        starts = rng.integers(0, len(stream) - length, size=batch)
        yield np.stack([stream[s : s + length] for s in starts])


# ----------------------------------------------------------------------------------------------------------
# Losses
# ----------------------------------------------------------------------------------------------------------


def _ce(logits: jax.Array, labels: jax.Array) -> jax.Array:
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits, -1), labels[..., None], -1))


def causal_forward(target, params, cfg, tokens: jax.Array, taps=()):  # tokens [B, T]
    """``target``'s (``models.protocol.TargetModel``) prefill of whole sequences: ``(logits [B, T, V] fp32,
    feats [B, T, len(taps) * H])``."""
    b, t = tokens.shape
    full = jnp.full((b,), t, jnp.int32)
    logits, feats, _ = target.prefill(params, cfg, tokens, target.init_cache(cfg, b, t), full, taps)
    return logits, feats


def target_loss(target, params, cfg, tokens: jax.Array) -> jax.Array:  # tokens [B, T]
    """Mean next-token cross-entropy of ``target`` (a ``TargetModel``; nats per token)."""
    logits, _ = causal_forward(target, params, cfg, tokens[:, :-1])
    return _ce(logits, tokens[:, 1:])


def block_gather(x: jax.Array, anchors: jax.Array, offsets: jax.Array) -> jax.Array:
    """``x [B, T, ...]`` at positions ``anchor + offset`` (clipped to the sequence) of every block anchored at
    ``anchors [B, J]``: ``[B*J, len(offsets), ...]``, blocks in row-major ``(b, j)`` order."""
    b, t = x.shape[:2]
    rows = jnp.repeat(jnp.arange(b), anchors.shape[1])
    pos = jnp.clip(anchors.reshape(-1)[:, None] + offsets, 0, t - 1)
    return x[rows[:, None], pos]


def draft_hidden(dparams, dcfg: DrafterConfig, target, tparams, feats, tokens, anchors) -> jax.Array:
    """Draft rows ``ph [B*J, K, H]`` for blocks anchored at ``anchors [B, J]`` of ``tokens [B, T]``, the
    target's taps of every position being ``feats [B, T, F]``.  Exactly the inference computation: context =
    the features of positions before the anchor, block = ``[token at anchor, MASK, ...]``; row d predicts the
    token at ``anchor + d + 1``."""
    b, t = tokens.shape
    j = anchors.shape[1]
    cache = drafter.init_drafter_cache(dcfg, b, t + dcfg.block_size)
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    cache = drafter.append_context(dparams, dcfg, cache, jnp.zeros((b,), jnp.int32), feats, pos)
    cache = jax.tree_util.tree_map(lambda x: jnp.repeat(x, j, axis=0), cache)  # one copy per block
    root = block_gather(tokens, anchors, jnp.zeros((1,), jnp.int32))[:, 0]
    ph_full = drafter.draft_block(dparams, dcfg, target, tparams, cache, anchors.reshape(-1), root)
    return drafter.draft_rows(ph_full, dcfg)


def drafter_logits(dparams, dcfg: DrafterConfig, target, tparams, tcfg, tokens, anchors):
    """Base and corrected draft logits for blocks anchored at ``anchors [B, J]`` of ``tokens [B, T]``.

    Returns ``(base [B*J, K, V], final [B*J, K, V], labels [B*J, K])``; row d predicts the token at
    ``anchor + d + 1``.  The context is the frozen ``target``'s features of ``tokens`` (``draft_hidden``).
    """
    k_rows = jnp.arange(dcfg.num_draft_rows)
    _, feats = causal_forward(target, tparams, tcfg, tokens, tuple(dcfg.target_layer_ids))
    ph = draft_hidden(dparams, dcfg, target, tparams, jax.lax.stop_gradient(feats), tokens, anchors)
    labels = block_gather(tokens, anchors, 1 + k_rows)
    path = block_gather(tokens, anchors, k_rows)
    base = drafter.scale_logits(dcfg, target.lm_head(tparams, tcfg, ph))
    final = drafter.path_logits(dparams, dcfg, target, tparams, tcfg, ph, path) if dparams.head is not None else base
    return base, final, labels


def drafter_loss(dparams, dcfg, target, tparams, tcfg, tokens, anchors, lam) -> jax.Array:
    """``(1 - lam) * CE(final) + lam * CE(base)`` over every block row."""
    base, final, labels = drafter_logits(dparams, dcfg, target, tparams, tcfg, tokens, anchors)
    return (1.0 - lam) * _ce(final, labels) + lam * _ce(base, labels)


def sample_anchors(rng: np.random.Generator, batch: int, length: int, per_seq: int, block: int) -> np.ndarray:
    """Anchors in ``[1, length - block - 1]`` so every block has context and in-window labels."""
    return rng.integers(1, length - block - 1, size=(batch, per_seq)).astype(np.int32)


# ----------------------------------------------------------------------------------------------------------
# A small optax loop with a progress bar
# ----------------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class TrainLog:
    steps: list[int] = dataclasses.field(default_factory=list)
    losses: list[float] = dataclasses.field(default_factory=list)
    seconds: float = 0.0


def adamw(steps: int, lr: float, warmup: int = 50, weight_decay: float = 0.01):
    """Gradient clipping (global norm 1) + AdamW with linear warmup and cosine decay to ``lr / 10``."""
    warmup = min(warmup, max(1, steps // 10))
    schedule = optax.warmup_cosine_decay_schedule(0.0, lr, warmup, max(steps, 2), lr * 0.1)
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=weight_decay))


def fit(
    params,
    loss_fn: Callable,  # (params, batch, step) -> scalar
    batches: Iterator,
    *,
    steps: int,
    lr: float,
    warmup: int = 50,
    weight_decay: float = 0.01,
    log_every: int = 25,
    desc: str = "train",
) -> tuple[object, TrainLog]:
    """AdamW with warmup + cosine decay and gradient clipping; returns the trained params and the loss log."""
    from tqdm.auto import tqdm

    opt = adamw(steps, lr, warmup, weight_decay)
    state = opt.init(params)

    @jax.jit
    def step_fn(params, state, batch, step):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch, step)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    log, t0 = TrainLog(), time.perf_counter()
    bar = tqdm(range(steps), desc=desc, disable=not sys.stderr.isatty() and steps < 10, mininterval=5)
    running = None
    for step in bar:
        params, state, loss = step_fn(params, state, next(batches), jnp.int32(step))
        if step % log_every == 0 or step == steps - 1:
            loss = float(loss)
            if not math.isfinite(loss):
                raise FloatingPointError(f"{desc}: loss became {loss} at step {step}")
            running = loss if running is None else 0.7 * running + 0.3 * loss
            log.steps.append(step)
            log.losses.append(loss)
            bar.set_postfix(loss=f"{running:.3f}")
    log.seconds = time.perf_counter() - t0
    return params, log


def init_params(module, cfg, key: jax.Array, dtype=jnp.float32, std: float = 0.02):
    """Random params for ``module.abstract_params(cfg)``: norms (1-D) ones, everything else N(0, std)."""
    abstract = module.abstract_params(cfg, dtype)
    leaves, treedef = jax.tree_util.tree_flatten(abstract)
    keys = jax.random.split(key, len(leaves))
    out = [
        jnp.ones(a.shape, a.dtype) if len(a.shape) == 1 else (std * jax.random.normal(k, a.shape)).astype(a.dtype)
        for a, k in zip(leaves, keys)
    ]
    return jax.tree_util.tree_unflatten(treedef, out)


class _Key:
    """A pytree leaf recording which HF tensor a param comes from."""

    def __init__(self, key: str, transpose: bool):
        self.key, self.transpose = key, transpose


def hf_tensors(module, cfg, params) -> dict[str, np.ndarray]:
    """Inverse of ``module.params_from_hf``: HF key -> HF-layout numpy array (``[out, in]`` Linear weights)."""
    keys = jax.tree_util.tree_leaves(module.build_params(cfg, _Key))  # _Key is not a pytree: one leaf each
    params = jax.tree_util.tree_leaves(params)  # same structure, same order
    if len(keys) != len(params):
        raise ValueError(f"params have {len(params)} leaves but {module.__name__} describes {len(keys)}")
    out = {}
    for k, p in zip(keys, params):
        a = np.asarray(p, np.float32)
        out[k.key] = np.ascontiguousarray(a.T if k.transpose else a)
    return out


def save_hf(
    directory: str | pathlib.Path, config: dict, tensors: dict[str, np.ndarray], tokenizer: str | None = None,
    dtype=np.float32,
):
    """Writes ``config.json``, ``model.safetensors`` (tensors cast to ``dtype``, fp32 by default; e.g.
    ``ml_dtypes.bfloat16``) and optionally ``tokenizer.json``."""
    from safetensors.numpy import save_file

    d = pathlib.Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    tensors = {k: v.astype(dtype) for k, v in tensors.items()}
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    if tokenizer is not None:
        (d / "tokenizer.json").write_text(tokenizer)
