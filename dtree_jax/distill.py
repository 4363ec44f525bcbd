"""Self-distillation of a Domino drafter for a real target (SmolLM2-135M-Instruct): the target's own responses
to prompts made from local text, its features and top-K next-token candidates, and the drafter objective.

* Prompts (``stdlib_prompts``): chat instructions written from the Python standard library's docstrings and
  module names (rendered with the checkpoint's chat template) and plain continuations of its source, split by
  file with ``train.stdlib_files`` (so held-out prompts come from files no training prompt saw).
* Data (``generate_shards``): the target answers with our own ``generate(..., "ar")`` in fixed-shape batches;
  one causal forward (the target's ``prefill``) over prompt + response then records the drafter's taps
  (exactly what the decode loop serves it: HF ``hidden_states[id + 1]``, the last layer after the final norm)
  and the target's top-K candidates (ids + log-probs) at every position.  Each shard is an ``.npz`` written
  atomically, so an interrupted run resumes at the first missing shard.  ``record_text_shards`` writes the
  same shards from stored text (``stdlib_passages``: source passages of the train-split files) with the
  causal forward alone, several times cheaper than generating (no responses; the text is not the target's).
* Objective (``distill_loss``): the DFlash block objective of ``train.draft_hidden`` with the stored features
  as context, distilling the target's top-K distribution (renormalised) at every block row (row d optionally
  weighted by ``exp(-d / decay_gamma)``, so the early rows that decide acceptance count most).  The drafter's
  softmax can run over those K candidates plus shared uniformly drawn negatives (log-Q corrected: each
  negative's logit + ``log((V - K) / n_neg)``, so the sum estimates the rest of the vocabulary) instead of all
  V rows of the output head.  Base and Domino-corrected logits are mixed with the lambda_base curriculum.
* Training (``fit_resumable``): AdamW (``train.adamw``) with an orbax ``CheckpointManager`` holding params,
  optimizer state, the step and the loss log; batches are a function of the step, so ``resume`` continues
  exactly where a run stopped.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import hashlib
import json
import math
import os
import pathlib
import sys
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax

from dtree_jax import train
from dtree_jax.models import drafter
from dtree_jax.models.domino_head import correction_hidden, gru_run
from dtree_jax.tree import _is_concrete

# ----------------------------------------------------------------------------------------------------------
# Prompts from the standard library
# ----------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Prompt:
    kind: str  # "chat": a user message for the chat template; "continue": raw text to continue; "text": a passage
    text: str
    source: str  # the standard-library file it was made from (relative path)


def _summary(doc: str, limit: int = 240) -> str:
    """The first paragraph of a docstring on one line, cut at a sentence end within ``limit`` characters."""
    para = " ".join(doc.strip().split("\n\n")[0].split())
    if len(para) > limit:
        cut = para[:limit]
        para = cut[: cut.rfind(". ") + 1] if ". " in cut else cut.rsplit(" ", 1)[0] + " ..."
    return para


def _file_prompts(path: pathlib.Path, root: pathlib.Path, rng: np.random.Generator) -> list[Prompt]:
    """Candidate prompts of one source file: per documented public function / class an instruction, per
    module two questions, and source continuations starting at definitions."""
    rel = str(path.relative_to(root))
    module = rel[:-3].replace("/", ".").removesuffix(".__init__")
    try:
        source = path.read_text(encoding="utf-8")
        tree = ast.parse(source)
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return []
    out = []
    doc = ast.get_docstring(tree)
    if doc:
        out.append(
            Prompt(
                "chat",
                f'What is the Python module `{module}` for? Its documentation begins: "{_summary(doc)}"',
                rel,
            )
        )
    out.append(
        Prompt("chat", f"Write a short Python example that uses the `{module}` module, and explain it.", rel)
    )
    lines = source.splitlines()
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.ClassDef)) or node.name.startswith("_"):
            continue
        d = ast.get_docstring(node)
        if isinstance(node, ast.FunctionDef):
            args = ast.unparse(node.args)
            sig = f"{node.name}({args if len(args) <= 60 else '...'})"
            if d:
                templates = (
                    f"Write a Python function `{sig}` that does the following: {_summary(d)}",
                    f"Explain what `{module}.{node.name}` does, then show how to call it.",
                    f'Implement `{sig}` in Python. Docstring: "{_summary(d)}"',
                )
                out.append(Prompt("chat", templates[int(rng.integers(len(templates)))], rel))
        elif d:
            out.append(Prompt("chat", f"Write a small Python class `{node.name}`: {_summary(d)}", rel))
        start = node.lineno - 1
        snippet = "\n".join(lines[start : start + int(rng.integers(3, 12))])
        if len(snippet) > 40:
            out.append(Prompt("continue", snippet[:600], rel))
    return out


def stdlib_prompts(split: str, num: int, seed: int = 0, chat_fraction: float = 0.75) -> list[Prompt]:
    """``num`` prompts from the ``split`` ("train" / "heldout") files of the standard library, about
    ``chat_fraction`` of them chat instructions, the rest continuations; seeded and reproducible."""
    files = train.stdlib_files(split)
    root = train.stdlib_root()
    rng = np.random.default_rng(seed)
    pool = [p for f in files for p in _file_prompts(f, root, rng)]
    chat = [p for p in pool if p.kind == "chat"]
    cont = [p for p in pool if p.kind == "continue"]
    n_chat = min(len(chat), round(num * chat_fraction))
    n_cont = min(len(cont), num - n_chat)
    if n_chat + n_cont < num:
        raise ValueError(
            f"the {split} split offers only {len(chat)} chat and {len(cont)} continuation prompts; "
            f"ask for at most {len(chat) + len(cont)}"
        )
    pick = [chat[i] for i in rng.permutation(len(chat))[:n_chat]] + [
        cont[i] for i in rng.permutation(len(cont))[:n_cont]
    ]
    return [pick[i] for i in rng.permutation(len(pick))]


def stdlib_passages(split: str, num: int, seed: int = 0, lines: int = 120) -> list[Prompt]:
    """``num`` passages of the ``split`` files' source (kind ``"text"``): up to ``lines`` lines from a random line
    of a random file (files drawn by size, with replacement; a passage starts before the file's last
    ``lines // 2`` lines); seeded and reproducible."""
    files = train.stdlib_files(split)
    root = train.stdlib_root()
    sizes = np.asarray([f.stat().st_size for f in files], np.float64)
    rng = np.random.default_rng([seed, 17])
    out = []
    for i in rng.choice(len(files), size=num, p=sizes / sizes.sum()):
        text = files[i].read_text(encoding="utf-8", errors="replace").splitlines()
        start = int(rng.integers(0, max(len(text) - lines // 2, 1)))
        out.append(Prompt("text", "\n".join(text[start : start + lines]), str(files[i].relative_to(root))))
    return out


def encode_prompts(model_path: str | pathlib.Path, prompts: Sequence[Prompt], max_tokens: int):
    """``(kept, ids)``: the token ids of each prompt (chat: rendered with the checkpoint's template) that fits
    ``max_tokens``; a longer continuation keeps its first ``max_tokens`` tokens, a longer chat prompt is
    dropped."""
    from dtree_jax.text import load_tokenizer, render_chat

    tokenizer = load_tokenizer(model_path)
    if tokenizer is None:
        raise ValueError(f"{model_path}: no tokenizer.json; prompts cannot be encoded")
    kept, out = [], []
    for p in prompts:
        if p.kind == "chat":  # as dtree_jax.text.encode_prompts(chat=True): the template writes the specials
            ids = tokenizer.encode(
                render_chat(model_path, [{"role": "user", "content": p.text}]), add_special_tokens=False
            ).ids
        else:
            ids = tokenizer.encode(p.text).ids
        if len(ids) > max_tokens and p.kind == "chat":
            continue
        kept.append(p)
        out.append(ids[:max_tokens])
    return kept, out


# ----------------------------------------------------------------------------------------------------------
# Data: the target's responses, features and top-K candidates, in resumable shards
# ----------------------------------------------------------------------------------------------------------

MANIFEST = "manifest.json"


@functools.partial(jax.jit, static_argnames=("target", "cfg", "taps", "top_k"))
def record(target, params, cfg, tokens: jax.Array, taps: tuple[int, ...], top_k: int):  # tokens [B, T]
    """One causal forward: ``(feats [B, T, len(taps) * H] bf16, top_ids [B, T, K] int32, top_logp [B, T, K]
    fp16)``, position t's candidates being the target's top-K for the token at t + 1.  (bf16: SmolLM2's
    residual stream reaches ~2.5e4 in a few channels, too close to fp16's limit.)"""
    logits, feats = train.causal_forward(target, params, cfg, tokens, taps)
    logp, ids = jax.lax.top_k(jax.nn.log_softmax(logits, -1), top_k)
    return feats.astype(jnp.bfloat16), ids.astype(jnp.int32), logp.astype(jnp.float16)


def _shard_path(out: pathlib.Path, i: int) -> pathlib.Path:
    return out / f"shard-{i:05d}.npz"


def _atomic_savez(path: pathlib.Path, **arrays) -> None:
    tmp = path.with_name(path.name + ".tmp.npz")
    np.savez(tmp, **arrays)
    os.replace(tmp, path)


def generate_shards(
    target,  # api.Model
    prompts: Sequence[Sequence[int]],
    out: str | pathlib.Path,
    *,
    taps: Sequence[int],
    max_new_tokens: int,
    prompt_tokens: int,
    shard_size: int = 16,
    top_k: int = 32,
    temperature: float = 0.0,
    seed: int = 0,
    record_batch: int = 16,
    progress: bool = True,
) -> dict:
    """Writes ``out/shard-NNNNN.npz`` for every ``shard_size`` prompts (missing shards only) and returns the
    manifest.  A shard holds ``tokens [n, T]`` (prompt + response, zero padded to the shard's longest sequence
    rounded up to 32, at most ``prompt_tokens + max_new_tokens``), ``lens [n]``, ``prompt_lens [n]``,
    ``feats [n, T, F]`` (bf16 stored as ``uint16``), ``top_ids`` / ``top_logp`` ``[n, T, K]``.  Responses come
    from ``generate(..., "ar")`` at ``temperature`` (0: greedy), one batch of ``shard_size`` per shard (the
    last one padded with repeats, so one compilation serves all); the features are recorded ``record_batch``
    sequences at a time."""
    from tqdm.auto import tqdm

    from dtree_jax.api import generate

    out = pathlib.Path(out)
    taps = tuple(int(t) for t in taps)
    if any(len(p) == 0 or len(p) > prompt_tokens for p in prompts):
        raise ValueError(f"every prompt needs 1..{prompt_tokens} tokens (prompt_tokens)")
    digest = hashlib.sha256(json.dumps([list(map(int, p)) for p in prompts]).encode()).hexdigest()
    settings = dict(
        taps=list(taps),
        max_new_tokens=max_new_tokens,
        prompt_tokens=prompt_tokens,
        shard_size=shard_size,
        top_k=top_k,
        temperature=temperature,
        seed=seed,
        num_prompts=len(prompts),
        prompts_sha256=digest,
        stop_ids=list(target.eos_token_ids),
    )
    _claim_data_dir(out, settings)
    n_shards = -(-len(prompts) // shard_size)
    todo = [i for i in range(n_shards) if not _shard_path(out, i).is_file()]
    bar = tqdm(todo, desc="distill data", disable=not progress, mininterval=5)
    for i in bar:
        chunk = [list(map(int, p)) for p in prompts[i * shard_size : (i + 1) * shard_size]]
        n = len(chunk)
        chunk += [chunk[-1]] * (shard_size - n)
        g = generate(target, chunk, "ar", max_new_tokens=max_new_tokens, temperature=temperature, seed=seed + i,
                     prompt_bucket=prompt_tokens)
        sequences = [p + t for p, t in zip(chunk, g.tokens)]
        shard = _record_shard(target, sequences, taps=taps, top_k=top_k, record_batch=record_batch,
                              max_len=prompt_tokens + max_new_tokens)
        _atomic_savez(
            _shard_path(out, i),
            **{name: x[:n] for name, x in shard.items() if name != "record_seconds"},
            prompt_lens=np.asarray([len(p) for p in chunk[:n]], np.int32),
            generate_seconds=np.float64(g.seconds),
            record_seconds=shard["record_seconds"],
        )
        bar.set_postfix(gen_tok_s=f"{sum(len(t) for t in g.tokens) / g.seconds:.0f}")
    return dict(settings=settings, shards=n_shards)


def record_text_shards(
    target,  # api.Model
    passages: Sequence[Sequence[int]],
    out: str | pathlib.Path,
    *,
    taps: Sequence[int],
    length: int,
    context_tokens: int,
    shard_size: int = 32,
    top_k: int = 32,
    record_batch: int = 16,
    progress: bool = True,
) -> dict:
    """Shards as ``generate_shards`` writes them, from stored text instead of the target's responses: each
    passage (its first ``length`` tokens) is recorded by one causal forward, nothing is generated.  Its first
    ``context_tokens`` count as the prompt (training anchors fall after them).  Manifest settings: ``source``
    ``"text"``, ``prompt_tokens`` = ``context_tokens``, ``max_new_tokens`` = ``length - context_tokens``."""
    from tqdm.auto import tqdm

    out = pathlib.Path(out)
    if not 1 <= context_tokens <= length - 2:
        raise ValueError(f"context_tokens must be in [1, length - 2 = {length - 2}], got {context_tokens}")
    passages = [list(map(int, p[:length])) for p in passages if len(p) >= context_tokens + 2]
    if not passages:
        raise ValueError(f"no passage has the {context_tokens + 2} tokens a training block needs")
    digest = hashlib.sha256(json.dumps(passages).encode()).hexdigest()
    settings = dict(source="text", taps=[int(t) for t in taps], prompt_tokens=context_tokens,
                    max_new_tokens=length - context_tokens, shard_size=shard_size, top_k=top_k,
                    num_prompts=len(passages), prompts_sha256=digest)
    _claim_data_dir(out, settings)
    n_shards = -(-len(passages) // shard_size)
    todo = [i for i in range(n_shards) if not _shard_path(out, i).is_file()]
    for i in tqdm(todo, desc="distill text", disable=not progress, mininterval=5):
        chunk = passages[i * shard_size : (i + 1) * shard_size]
        shard = _record_shard(target, chunk, taps=tuple(settings["taps"]), top_k=top_k, record_batch=record_batch,
                              max_len=length)
        _atomic_savez(_shard_path(out, i), **shard, prompt_lens=np.full(len(chunk), context_tokens, np.int32),
                      generate_seconds=np.float64(0.0))
    return dict(settings=settings, shards=n_shards)


def _claim_data_dir(out: pathlib.Path, settings: dict) -> None:
    """Creates ``out`` and writes its manifest; ValueError naming the settings that differ when ``out`` already
    holds data made with others (so a resumed run never mixes two recipes)."""
    out.mkdir(parents=True, exist_ok=True)
    manifest_file = out / MANIFEST
    if manifest_file.is_file():
        old = json.loads(manifest_file.read_text())
        changed = sorted(k for k in settings if old.get("settings", {}).get(k) != settings[k])
        if changed:
            raise ValueError(
                f"{out} holds data made with other settings ({', '.join(changed)}); "
                "pass another data directory or delete this one"
            )
    manifest_file.write_text(json.dumps(dict(settings=settings), indent=1) + "\n")


def _record_shard(target, sequences: list[list[int]], *, taps, top_k: int, record_batch: int, max_len: int) -> dict:
    """One shard's arrays for ``sequences`` (prompt + response token lists): ``tokens`` zero padded to the
    longest rounded up to 32 (at most ``max_len``), ``lens``, and the target's ``feats`` (bf16 as ``uint16``),
    ``top_ids`` / ``top_logp``, recorded ``record_batch`` sequences at a time; ``record_seconds``."""
    lens = np.asarray([len(x) for x in sequences], np.int32)
    width = min(max_len, -(-int(lens.max()) // 32) * 32)  # few shapes, little padding
    tokens = np.zeros((len(sequences), width), np.int32)
    for r, x in enumerate(sequences):
        tokens[r, : len(x)] = x
    t0 = time.perf_counter()
    parts = [
        record(target.module, target.params, target.cfg, jnp.asarray(tokens[r : r + record_batch]), taps, top_k)
        for r in range(0, len(sequences), record_batch)
    ]
    feats, ids, logp = (np.concatenate([np.asarray(x[f]) for x in parts]) for f in range(3))
    return dict(tokens=tokens, lens=lens, feats=feats.view(np.uint16), top_ids=ids, top_logp=logp,
                record_seconds=np.float64(time.perf_counter() - t0))


def data_stats(*dirs: str | pathlib.Path) -> dict:
    """Sequences, tokens after the prompts (``generated_tokens``, or ``text_tokens`` for ``record_text_shards``'
    directories) and seconds (generation, feature recording) of the shards so far, summed over ``dirs``."""
    stats = dict(shards=0, sequences=0, generated_tokens=0, text_tokens=0, generate_seconds=0.0,
                 record_seconds=0.0)
    for d in map(pathlib.Path, dirs):
        manifest = d / MANIFEST
        text = manifest.is_file() and json.loads(manifest.read_text())["settings"].get("source") == "text"
        for f in sorted(d.glob("shard-*[0-9].npz")):
            with np.load(f) as z:
                stats["shards"] += 1
                stats["sequences"] += len(z["lens"])
                stats["text_tokens" if text else "generated_tokens"] += int(np.sum(z["lens"] - z["prompt_lens"]))
                stats["generate_seconds"] += float(z["generate_seconds"])
                stats["record_seconds"] += float(z["record_seconds"])
    return stats


def label_counts(vocab_size: int, *dirs: str | pathlib.Path) -> np.ndarray:  # -> [V] int64
    """How often the target's top-1 prediction is each token, over every position a drafter is trained on
    (after the prompt or context, up to the last token) of the data directories ``dirs``: the tokens the target
    emits there (``experiments/draft_vocab.py`` ranks them into a draft vocabulary)."""
    counts = np.zeros(vocab_size, np.int64)
    for d in map(pathlib.Path, dirs):
        settings = _read_settings(d)
        for i in range(-(-settings["num_prompts"] // settings["shard_size"])):
            with np.load(_shard_path(d, i)) as z:
                top1, lens, starts = z["top_ids"][..., 0], z["lens"], np.maximum(z["prompt_lens"] - 1, 0)
                for row, start, end in zip(top1, starts, lens - 1):
                    np.add.at(counts, row[start:end], 1)
    return counts


@dataclasses.dataclass(frozen=True)
class Distilled:
    """All shards of one or more data directories in memory (arrays as in ``generate_shards``, concatenated;
    the time axis padded to the longest directory's)."""

    tokens: np.ndarray  # [N, T] int32, T = prompt_tokens + max_new_tokens (zero padded)
    lens: np.ndarray  # [N]
    prompt_lens: np.ndarray  # [N]
    feats: np.ndarray  # [N, T, F] bf16
    top_ids: np.ndarray  # [N, T, K] int32
    top_logp: np.ndarray  # [N, T, K] fp16
    settings: tuple[dict, ...]  # each directory's manifest settings, in order

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def taps(self) -> list[int]:
        return self.settings[0]["taps"]


def _read_settings(data: pathlib.Path) -> dict:
    if not (data / MANIFEST).is_file():
        raise ValueError(
            f"{data}: no {MANIFEST}; make the data first (experiments/train_smollm2.py data, or text)"
        )
    settings = json.loads((data / MANIFEST).read_text())["settings"]
    n = -(-settings["num_prompts"] // settings["shard_size"])
    missing = [i for i in range(n) if not _shard_path(data, i).is_file()]
    if missing:
        stage = "text" if settings.get("source") == "text" else "data"
        raise ValueError(
            f"{data}: {len(missing)} of {n} shards missing (first {missing[0]}); resume the {stage} step"
        )
    return settings


def load_shards(*dirs: str | pathlib.Path) -> Distilled:
    """Every shard of the data directories ``dirs`` (made with the same taps and top-K) in memory."""
    dirs = [pathlib.Path(d) for d in dirs]
    if not dirs:
        raise ValueError("no data directory given")
    settings = [_read_settings(d) for d in dirs]
    for key in ("taps", "top_k"):
        if len({json.dumps(s[key]) for s in settings}) > 1:
            raise ValueError(f"the data directories differ in {key}: {[s[key] for s in settings]}")
    length = max(s["prompt_tokens"] + s["max_new_tokens"] for s in settings)
    fields = [f.name for f in dataclasses.fields(Distilled) if f.name != "settings"]
    cols = {f: [] for f in fields}
    for d, s in zip(dirs, settings):
        for i in range(-(-s["num_prompts"] // s["shard_size"])):
            with np.load(_shard_path(d, i)) as z:
                for f in fields:
                    x = z[f].view(ml_dtypes.bfloat16) if f == "feats" else z[f]
                    if x.ndim > 1:  # pad the time axis to the common length
                        x = np.pad(x, [(0, 0), (0, length - x.shape[1])] + [(0, 0)] * (x.ndim - 2))
                    cols[f].append(x)
    return Distilled(**{f: np.concatenate(v) for f, v in cols.items()}, settings=tuple(settings))


def batch_at(
    data: Distilled,
    step: int,
    *,
    batch: int,
    blocks: int,
    negatives: int,
    vocab: int,
    seed: int,
) -> dict:
    """The training batch of ``step``, a pure function of ``(data, step, seed)``: sequences in a per-epoch
    permutation, ``blocks`` anchors per sequence drawn uniformly over its response (the first anchor is the
    first response token, whose context is the prompt), ``negatives`` token ids drawn uniformly."""
    per_epoch = len(data) // batch
    if per_epoch == 0:
        raise ValueError(f"{len(data)} sequences are fewer than one batch of {batch}")
    epoch, pos = divmod(step, per_epoch)
    order = np.random.default_rng([seed, epoch]).permutation(len(data))
    idx = np.sort(order[pos * batch : (pos + 1) * batch])
    rng = np.random.default_rng([seed, epoch, pos, 1])
    lo = data.prompt_lens[idx]
    hi = np.maximum(data.lens[idx] - 1, lo + 1)  # anchors in [prompt_len, len - 2]: at least one label
    anchors = (lo[:, None] + rng.random((batch, blocks)) * (hi - lo)[:, None]).astype(np.int32)
    return dict(
        tokens=data.tokens[idx],
        lens=data.lens[idx],
        feats=data.feats[idx],
        top_ids=data.top_ids[idx],
        top_logp=data.top_logp[idx],
        anchors=anchors,
        negatives=rng.integers(0, vocab, negatives).astype(np.int32),
    )


# ----------------------------------------------------------------------------------------------------------
# Objective on the target's candidates
# ----------------------------------------------------------------------------------------------------------


def candidate_logits(dparams, dcfg, target, tparams, tcfg, ph, path, cand, shared=None):
    """``drafter.path_logits`` at the candidate ids only: ``ph [N, K, H]``, ``path [N, K]``, per-row
    candidates ``cand [N, K, C]`` and optionally ids ``shared [S]`` common to every row -> ``(base, final)``
    fp32, each ``[N, K, C + S]`` (the per-row candidates first), without the other head rows.  (It reads the
    head's rows from the params' ``embed`` / ``lm_head``: our target families' layout.)"""
    head_rows = tparams.embed if tcfg.tie_word_embeddings else tparams.lm_head.T  # [V, H]
    shared = jnp.zeros((0,), jnp.int32) if shared is None else shared

    def logits(x, table):  # x [N, K, D], table [V, D] -> x . table[c] for the candidates [N, K, C + S]
        f32 = jnp.float32
        own = jnp.einsum("nkd,nkcd->nkc", x, jnp.take(table, cand, axis=0), preferred_element_type=f32)
        common = jnp.einsum("nkd,sd->nks", x, jnp.take(table, shared, axis=0), preferred_element_type=f32)
        return jnp.concatenate([own, common], -1)

    base = drafter.scale_logits(dcfg, logits(ph, head_rows))
    if dparams.head is None:
        return base, base
    states = gru_run(dparams.head, target.embed(tparams, path))  # [N, K, G]
    hid = correction_hidden(dparams.head, ph, states)  # [N, K, E] fp32
    corrected = base + logits(hid, dparams.head.w2.astype(jnp.float32))
    use_head = jnp.arange(ph.shape[1]) >= dcfg.pure_draft_prefix_len
    return base, jnp.where(use_head[None, :, None], corrected, base)


def distill_loss(
    dparams,
    dcfg,
    target,
    tparams,
    tcfg,
    b: dict,
    lam,
    decay_gamma: float | None = None,
    vocab: jax.Array | None = None,  # [V'] int32 ascending: a draft vocabulary (``drafter.DraftVocab.ids``)
) -> tuple[jax.Array, dict]:
    """``(1 - lam) * KD(final) + lam * KD(base)`` over the valid block rows of batch ``b`` (``batch_at``);
    KD = cross-entropy from the target's renormalised top-K distribution to the drafter's softmax: over the
    whole vocabulary when ``b["negatives"]`` is empty, else over the K candidates plus those shared negatives,
    log-Q corrected.  With a draft ``vocab`` (and no negatives) the softmax runs over those tokens alone, the
    ones the drafter proposes from, and the target's top-K keeps its candidates inside them, renormalised (a
    row with none inside drops out).  ``decay_gamma`` weights row d (the d + 1-th token after the anchor) by
    ``exp(-d / decay_gamma)`` in that mean (SpecForge's ``loss_decay_gamma``: early rows decide acceptance);
    None: every row alike.  Aux: the two KD terms and ``top1``, how often the final logits rank the target's
    argmax first among its top-K (a proxy for greedy acceptance; unweighted)."""
    k_rows = jnp.arange(dcfg.num_draft_rows)
    tokens, anchors = b["tokens"], b["anchors"]
    ph = train.draft_hidden(dparams, dcfg, target, tparams, b["feats"], tokens, anchors)  # [N, K, H]
    path = train.block_gather(tokens, anchors, k_rows)
    top_ids = train.block_gather(b["top_ids"], anchors, k_rows)  # [N, K, Kt] candidates for depth d + 1
    p = jax.nn.softmax(train.block_gather(b["top_logp"], anchors, k_rows).astype(jnp.float32), -1)
    rows = jnp.repeat(jnp.arange(tokens.shape[0]), anchors.shape[1])
    label_pos = anchors.reshape(-1)[:, None] + 1 + k_rows
    valid = label_pos < b["lens"][rows][:, None]  # [N, K] the label lies inside the sequence
    kt, neg = top_ids.shape[-1], b["negatives"]
    inside = jnp.ones(top_ids.shape, bool)  # [N, K, Kt] candidates the drafter can propose
    if vocab is not None:
        if neg.shape[0]:
            raise ValueError("a draft vocabulary and sampled negatives do not combine; pass one of them")
        if vocab.shape[0] == 0 or (_is_concrete(vocab) and not _ascending_ids(np.asarray(vocab), tcfg.vocab_size)):
            raise ValueError(f"vocab must be ascending distinct token ids in [0, {tcfg.vocab_size}), at least one")
        cols = jnp.minimum(jnp.searchsorted(vocab, top_ids), vocab.shape[0] - 1)  # [N, K, Kt] columns in vocab
        inside = vocab[cols] == top_ids
        p = jnp.where(inside, p, 0.0)
        mass = jnp.sum(p, -1)
        p = p / jnp.maximum(mass, 1e-30)[..., None]
        valid = valid & (mass > 0)
        no_candidates = jnp.zeros(top_ids.shape[:-1] + (0,), jnp.int32)
        base, final = candidate_logits(dparams, dcfg, target, tparams, tcfg, ph, path, no_candidates, vocab)

        def at_candidates(logits):
            return jnp.take_along_axis(logits, cols, -1), jax.nn.logsumexp(logits, -1)
    elif neg.shape[0] == 0:  # the full heads
        base = drafter.scale_logits(dcfg, target.lm_head(tparams, tcfg, ph))
        final = base if dparams.head is None else drafter.path_logits(dparams, dcfg, target, tparams, tcfg, ph, path)

        def at_candidates(logits):  # (logits at the top-K [N, K, Kt], log partition [N, K])
            return jnp.take_along_axis(logits, top_ids, -1), jax.nn.logsumexp(logits, -1)
    else:
        base, final = candidate_logits(dparams, dcfg, target, tparams, tcfg, ph, path, top_ids, neg)
        clash = jnp.any(neg[None, None, :, None] == top_ids[:, :, None, :], -1)  # [N, K, n_neg] in top-K
        log_q = math.log((tcfg.vocab_size - kt) / neg.shape[0])  # a negative stands for (V - K) / n_neg

        def at_candidates(logits):
            rest = jnp.where(clash, -jnp.inf, logits[..., kt:] + log_q)
            return logits[..., :kt], jax.nn.logsumexp(jnp.concatenate([logits[..., :kt], rest], -1), -1)

    denom = jnp.maximum(jnp.sum(valid), 1)
    weight = jnp.where(valid, row_weights(dcfg.num_draft_rows, decay_gamma)[None, :], 0.0)  # [N, K]
    (cand_base, lse_base), (cand_final, lse_final) = at_candidates(base), at_candidates(final)

    def kd(cand, lse):
        ce = -jnp.sum(p * (cand - lse[..., None]), -1)
        return jnp.sum(jnp.where(valid, weight * ce, 0.0)) / jnp.maximum(jnp.sum(weight), 1e-9)

    kd_final, kd_base = kd(cand_final, lse_final), kd(cand_base, lse_base)
    ranked_first = (jnp.argmax(jnp.where(inside, cand_final, -jnp.inf), -1) == 0) & inside[..., 0]
    agree = jnp.sum(jnp.where(valid, ranked_first, False)) / denom
    return (1.0 - lam) * kd_final + lam * kd_base, dict(kd_final=kd_final, kd_base=kd_base, top1=agree)


def _ascending_ids(ids: np.ndarray, vocab_size: int) -> bool:
    return bool(ids.ndim == 1 and np.all(np.diff(ids) > 0) and ids[0] >= 0 and ids[-1] < vocab_size)


def row_weights(rows: int, decay_gamma: float | None) -> jax.Array:
    """``[rows]`` loss weights of the draft rows: ``exp(-d / decay_gamma)`` for row d, or ones (None);
    ``decay_gamma`` is a Python float (static under ``jit``)."""
    d = jnp.arange(rows, dtype=jnp.float32)
    if decay_gamma is None:
        return jnp.ones_like(d)
    if not decay_gamma > 0:
        raise ValueError(f"decay_gamma must be > 0 (or None), got {decay_gamma}")
    return jnp.exp(-d / decay_gamma)


def lambda_base(step, backbone_steps: int, head_steps: int, final: float = 0.3):
    """The lambda_base curriculum: 1 (backbone only) for ``backbone_steps``, then linear to ``final``."""
    frac = jnp.clip((step - backbone_steps) / max(head_steps, 1), 0.0, 1.0)
    return jnp.where(step < backbone_steps, 1.0, 1.0 - (1.0 - final) * frac)


# ----------------------------------------------------------------------------------------------------------
# Resumable training
# ----------------------------------------------------------------------------------------------------------


def _resume(mgr, params, state, meta: dict, *, where: str):
    """``(params, optimizer state, log)`` from ``mgr``'s latest checkpoint, or the given ones and a fresh log
    when it has none; ValueError when the checkpoint was made with other ``meta``."""
    import orbax.checkpoint as ocp

    if mgr.latest_step() is None:
        return params, state, dict(step=0, steps=[], loss=[], seconds=0.0)
    got = mgr.restore(
        mgr.latest_step(),
        args=ocp.args.Composite(
            state=ocp.args.StandardRestore(dict(params=params, opt=state)), log=ocp.args.JsonRestore()
        ),
    )
    if got.log["meta"] != json.loads(json.dumps(meta)):
        raise ValueError(
            f"{where}: checkpoint was made with other settings ({got.log['meta']}); "
            "pass another checkpoint directory or the same settings"
        )
    return got.state["params"], got.state["opt"], got.log["log"]


def _log_step(log: dict, step: int, loss: float, aux: dict[str, float], *, desc: str) -> None:
    """Appends a logged step to ``log``; FloatingPointError when the loss is not finite."""
    if not math.isfinite(loss):
        raise FloatingPointError(f"{desc}: loss became {loss} at step {step}")
    log["steps"].append(step)
    log["loss"].append(loss)
    for name, v in aux.items():
        log.setdefault(name, []).append(v)


def fit_resumable(
    params,
    loss_fn: Callable,  # (params, batch, step) -> (scalar, aux dict of scalars)
    batch_fn: Callable[[int], dict],  # step -> batch (numpy), deterministic
    ckpt_dir: str | pathlib.Path,
    *,
    steps: int,
    lr: float,
    warmup: int = 50,
    weight_decay: float = 0.01,
    save_every: int = 100,
    log_every: int = 10,
    stop_at: int | None = None,
    meta: dict | None = None,
    on_save: Callable[[dict], None] | None = None,
    desc: str = "train",
    progress: bool = True,
):
    """AdamW (``train.adamw``) for ``steps`` steps, checkpointed every ``save_every`` steps (and at the end)
    into ``ckpt_dir`` with orbax: params, optimizer state, the step and the log.  An existing checkpoint is
    resumed from its step (its ``meta`` must equal ``meta``); ``stop_at`` ends the run early at that step (a
    later call resumes it); ``on_save(log)`` runs after each save.  Returns ``(params, log)``, the log holding
    ``step`` (steps done), the logged ``steps`` with their ``loss`` and each aux, and ``seconds``."""
    import orbax.checkpoint as ocp
    from tqdm.auto import tqdm

    opt = train.adamw(steps, lr, warmup, weight_decay)
    state = opt.init(params)
    meta = dict(meta or {}, steps=steps, lr=lr, warmup=warmup, weight_decay=weight_decay)
    mgr = ocp.CheckpointManager(
        pathlib.Path(ckpt_dir).resolve(), options=ocp.CheckpointManagerOptions(max_to_keep=2)
    )
    start = mgr.latest_step() or 0
    params, state, log = _resume(mgr, params, state, meta, where=f"{ckpt_dir}")
    if start:
        print(f"{desc}: resuming at step {start} of {steps}", file=sys.stderr)

    @jax.jit
    def step_fn(params, state, batch, step):
        (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, batch, step)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss, aux

    def save(step):
        mgr.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(dict(params=params, opt=state)),
                log=ocp.args.JsonSave(dict(meta=meta, log=log)),
            ),
            force=True,
        )

    end = steps if stop_at is None else min(stop_at, steps)
    t0, seconds0 = time.perf_counter(), log["seconds"]
    bar = tqdm(range(start, end), desc=desc, disable=not progress, mininterval=5, initial=start, total=steps)
    for step in bar:
        params, state, loss, aux = step_fn(params, state, batch_fn(step), jnp.int32(step))
        if step % log_every == 0 or step == steps - 1:
            _log_step(log, step, float(loss), {k: float(v) for k, v in aux.items()}, desc=desc)
            bar.set_postfix(loss=f"{float(loss):.3f}", **{k: f"{float(v):.3f}" for k, v in aux.items()})
        if (step + 1) % save_every == 0 or step + 1 == end:
            log.update(step=step + 1, seconds=seconds0 + time.perf_counter() - t0)
            save(step + 1)
            if on_save is not None:
                on_save(log)
    mgr.wait_until_finished()
    mgr.close()
    return params, log
