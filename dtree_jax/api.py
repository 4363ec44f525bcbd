"""The Python API: load models, run a generation, read its tokens and statistics.

    from dtree_jax import api
    target, drafter = api.load_model("checkpoints/tiny-target"), api.load_model("checkpoints/tiny-domino")
    result = api.generate(target, [[1, 2, 3]], "dominotree", drafter, budget=16)

``generate`` validates the knobs, builds the loop's static ``Spec`` (``dtree_jax.loop``), compiles the whole
generation once per (knobs, shapes) and runs it; ``instrument=True`` runs the same stages one by one and
times them.  A target is one of ours (a converted / HF / GGUF checkpoint) or any object satisfying
``models.protocol.TargetModel`` (``Model(kind, cfg, params, impl=...)``; ``models.nnx_target`` wraps a Flax
NNX module).
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import pathlib
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dtree_jax import builders, loop
from dtree_jax.cost import auto_budget, load_calibration
from dtree_jax.models import MODEL_MODULES

METHODS = tuple(builders.REGISTRY)  # the method registry's names, "ar" first


@dataclasses.dataclass(frozen=True)
class Model:
    """A loaded model: ``kind`` names its module in ``models.MODEL_MODULES`` ("qwen3" / "qwen2" / "llama"
    (dense), "qwen3_5", "drafter"), or ``impl`` is its own ``TargetModel`` implementation (a hashable object;
    ``kind`` is then a free label).  ``cfg`` is static."""

    kind: str
    cfg: Any
    params: Any
    path: str | None = None  # where it was loaded from (tokenizer lookup)
    eos_token_ids: tuple[int, ...] = ()  # from config.json / generation_config.json
    impl: Any = None  # a TargetModel implementation replacing the kind's module

    @property
    def module(self):
        if self.impl is not None:
            return self.impl
        if self.kind not in MODEL_MODULES:
            raise ValueError(f"unknown model kind {self.kind!r}; expected one of {sorted(MODEL_MODULES)}")
        return importlib.import_module(MODEL_MODULES[self.kind])


def eos_ids(path) -> tuple[int, ...]:
    """EOS ids from ``generation_config.json`` (preferred) or ``config.json`` (int or list)."""
    for name in ("generation_config.json", "config.json"):
        f = pathlib.Path(path) / name
        if f.is_file():
            d = json.loads(f.read_text())
            d = d.get("text_config", d) if "eos_token_id" not in d else d
            eos = d.get("eos_token_id")
            if eos is not None:
                return tuple(int(e) for e in (eos if isinstance(eos, list) else [eos]))
    return ()


def load_model(model) -> Model | None:
    """A ``Model`` from a checkpoint path (converted or HF directory, or a GGUF file: its converted copy in the
    cache), a ``(kind, cfg, params)`` tuple, or a ``Model`` (returned as is); None stays None."""
    if model is None or isinstance(model, Model):
        return model
    if isinstance(model, (str, bytes)) or hasattr(model, "__fspath__"):
        from dtree_jax import convert

        path = convert.model_dir(model)
        kind, cfg, params = convert.load_model(path)
        return Model(kind, cfg, params, str(path), eos_ids(path))
    if isinstance(model, tuple) and len(model) == 3:
        return Model(*model)
    raise TypeError(f"expected a Model, a (kind, cfg, params) tuple or a checkpoint path, got {type(model).__name__}")


def with_kernels(model: Model | None, attention_impl: str | None = None, kernel_platform: str | None = None):
    """``model`` with its config's ``attention_impl`` ("xla" | "pallas") and ``kernel_platform`` ("tpu" | "gpu" |
    "cpu"; whose kernels "pallas" runs) replaced where given (None keeps the config's; a drafter's apply to its
    backbone).  ``models.kernels`` documents which kernel runs where."""
    if model is None or (attention_impl is None and kernel_platform is None):
        return model
    from dtree_jax.models.config import ATTENTION_IMPLS, check_kernel_platform

    if attention_impl is not None and attention_impl not in ATTENTION_IMPLS:
        raise ValueError(f"attention_impl must be one of {ATTENTION_IMPLS}, got {attention_impl!r}")
    check_kernel_platform(kernel_platform)
    knobs = {k: v for k, v in dict(attention_impl=attention_impl, kernel_platform=kernel_platform).items() if v}
    cfg = model.cfg
    if model.kind == "drafter":
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, **knobs))
    else:
        cfg = dataclasses.replace(cfg, **knobs)
    return dataclasses.replace(model, cfg=cfg)


def _bucket(n: int, multiple: int = 16) -> int:
    return max(multiple, -(-n // multiple) * multiple)


def make_spec(
    target: Model,
    drafter: Model | None,
    method: str,
    *,
    budget: int,
    node_topk: int,
    corr_topm: int | None,
    max_depth: int | None,
    max_new_tokens: int,
    prompt_bucket: int,
    stop_ids: Sequence[int],
    top_k: int,
    top_p: float,
    cache_len: int | None = None,
) -> loop.Spec:
    """Validates the knobs and returns the static description of a generation."""
    record = builders.get_method(method)
    if record.drafts:
        if drafter is None:
            raise ValueError(f"method {method!r} needs a drafter")
        if drafter.kind != "drafter":
            raise ValueError(f"the drafter checkpoint is a {drafter.kind!r} model, not a DFlash/Domino drafter")
        if record.needs_head and not drafter.cfg.has_head:
            raise ValueError(f"method {method!r} needs a Domino drafter (with the GRU head); this is plain DFlash")
    for name, v in dict(budget=budget, node_topk=node_topk, max_new_tokens=max_new_tokens).items():
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    corr_topm = record.corr_topm if corr_topm is None else corr_topm
    if not isinstance(corr_topm, int) or corr_topm < 0:
        raise ValueError(f"corr_topm must be a non-negative integer (0 = full vocabulary), got {corr_topm!r}")
    if top_k < 0 or not 0 < top_p <= 1:
        raise ValueError(f"need top_k >= 0 and 0 < top_p <= 1, got top_k={top_k}, top_p={top_p}")
    dcfg = drafter.cfg if record.drafts else None
    depth_cap = dcfg.num_draft_rows if dcfg is not None else 1
    max_depth = depth_cap if max_depth is None else max_depth
    if not isinstance(max_depth, int) or max_depth < 1:
        raise ValueError(f"max_depth must be a positive integer, got {max_depth!r}")
    spec = loop.Spec(
        target=target.module,
        target_cfg=target.cfg,
        drafter_cfg=dcfg,
        method=method,
        budget=budget,
        node_topk=node_topk,
        corr_topm=corr_topm,
        max_depth=min(max_depth, depth_cap),
        max_new_tokens=max_new_tokens,
        cache_len=0,
        stop_ids=tuple(int(s) for s in stop_ids),
        top_k=top_k,
        top_p=float(top_p),
    )
    need = prompt_bucket + max_new_tokens + spec.draft_span
    if cache_len is None:
        cache_len = _bucket(need, 64)
    elif cache_len < prompt_bucket + spec.draft_span:
        raise ValueError(f"cache_len {cache_len} cannot hold a {prompt_bucket}-token prompt bucket plus one round")
    return dataclasses.replace(spec, cache_len=cache_len)



def trace_generation(target: Model, drafter: Model | None, method: str, *, batch: int = 1,
                     prompt_bucket: int = 16, temperature: float = 0.0, **knobs) -> jax.stages.Traced:
    """``generate_on_device`` (prefill + the while_loop) traced for ``batch`` prompts of one bucket, without
    running it; params may be abstract (``abstract_params``).  ``.lower(lowering_platforms=("tpu",))`` then
    cross-lowers the whole generation (give the configs a fixed ``kernel_platform`` to get that platform's
    kernels: ``with_kernels``).  ``knobs`` go to ``make_spec`` (defaults: budget 8, k 4, 16 new tokens)."""
    knobs = dict(dict(budget=8, node_topk=4, corr_topm=None, max_depth=None, max_new_tokens=16, stop_ids=(),
                      top_k=0, top_p=1.0), **knobs)
    spec = make_spec(target, drafter, method, prompt_bucket=prompt_bucket, **knobs)
    prompts = jax.ShapeDtypeStruct((batch, prompt_bucket), jnp.int32)
    lens = jax.ShapeDtypeStruct((batch,), jnp.int32)
    dparams = drafter.params if builders.get_method(method).drafts else None
    return loop.generate_on_device.trace(spec, target.params, dparams, prompts, lens, jax.random.key(0),
                                    jnp.float32(temperature))



_draft_jit = jax.jit(loop.draft, static_argnums=0)
_build_jit = jax.jit(loop.build_tree, static_argnums=0)
_verify_jit = jax.jit(loop.verify, static_argnums=0)
_commit_jit = jax.jit(loop.accept_commit, static_argnums=0)


def _timed(fn, *args):
    t0 = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
    return out, time.perf_counter() - t0


COMPILED: dict = {}  # compiled generations by (spec, argument shapes); tests swap it for a fresh one


def _compiled(args):
    """The compiled generation for these static knobs and argument shapes (compiled once, then reused)."""
    leaves, treedef = jax.tree_util.tree_flatten(args[1:])
    key = (args[0], treedef, tuple((jnp.shape(x), jnp.result_type(x)) for x in leaves))
    if key in COMPILED:
        return COMPILED[key], 0.0
    t0 = time.perf_counter()
    COMPILED[key] = loop.generate_on_device.lower(*args).compile()
    return COMPILED[key], time.perf_counter() - t0


def compilations() -> int:
    """How many distinct generations have been compiled in this process (for recompilation checks)."""
    return len(COMPILED)


def _run_instrumented(spec, tparams, dparams, prompts, lens, key, temperature):
    state = jax.block_until_ready(loop.prefill_on_device(spec, tparams, dparams, prompts, lens, key, temperature))
    stages = {"draft": [], "build": [], "verify": [], "commit": []}
    trees = []
    while bool(jnp.any(~state.done)) and int(state.step) < spec.max_new_tokens:
        rnd, t_draft = _timed(_draft_jit, spec, tparams, dparams, state)
        tree, t_build = _timed(_build_jit, spec, tparams, dparams, rnd, state)
        (logits, feats, cache), t_verify = _timed(_verify_jit, spec, tparams, tree, state)
        before = state
        state, t_commit = _timed(_commit_jit, spec, dparams, tree, logits, feats, cache, state, temperature)
        for name, t in zip(stages, (t_draft, t_build, t_verify, t_commit)):
            stages[name].append(t)
        trees.append(
            dict(
                active=(~np.asarray(before.done)).tolist(),
                lens=np.asarray(before.lens).tolist(),
                tokens=np.asarray(tree.tokens).tolist(),
                parents=np.asarray(tree.parents).tolist(),
                emitted=(np.asarray(state.out_len) - np.asarray(before.out_len)).tolist(),
            )
        )
    return state, stages, trees



@dataclasses.dataclass
class Generation:
    tokens: list[list[int]]  # generated ids per request (stop token included, nothing after it)
    stats: list[dict]  # per request: generated, rounds, tau, seconds, tokens_per_second, stop_reason
    compile_seconds: float
    stage_seconds: dict | None = None  # instrumented mode: mean seconds per round of each stage
    # Instrumented mode: per round, per request: active, lens (committed length), the tree's tokens and
    # parents (node 0 = the root) and the number of tokens emitted.
    round_trees: list[dict] | None = None
    texts: list[str] | None = None  # text prompts only: ``tokens`` decoded (special tokens skipped)


def generate(
    target,
    prompts: Sequence[Sequence[int]],
    method: str = "dominotree",
    drafter=None,
    *,
    budget: int | str = 32,
    node_topk: int = 8,
    corr_topm: int | None = None,
    max_depth: int | None = None,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    max_new_tokens: int = 64,
    stop_ids: Sequence[int] | None = None,
    prompt_bucket: int | None = None,
    cache_len: int | None = None,
    instrument: bool = False,
    calibration: dict | str | None = None,
    attention_impl: str | None = None,
    kernel_platform: str | None = None,
    chat: bool = False,
) -> Generation:
    """Generates continuations of ``prompts`` with ``method`` on device.

    ``prompts`` are token-id lists, or strings encoded with the target's ``tokenizer.json``; with ``chat``
    each string is one user message, wrapped in the checkpoint's chat template first (the result's ``texts``
    then hold the decoded responses).  ``target`` and ``drafter`` are ``Model``s, ``(kind, cfg, params)``
    tuples, or checkpoint paths (converted or HF directories; a target may be a GGUF file).  ``budget`` is the number of non-root tree nodes (tree methods), ``node_topk`` the
    branching cap k, ``corr_topm`` the Domino candidate width M (0 = full vocabulary; default: the reference's, full for
    ``domino`` and 64 for ``dominotree``).  Temperature 0 is
    greedy; above 0 the target is sampled at every node (lossless).  ``stop_ids`` default to the target's
    EOS ids.  Prompts are right-padded to ``prompt_bucket`` (default: the longest rounded up to 16) so
    prompts of one bucket share one compilation.  ``attention_impl`` ("xla" | "pallas") and ``kernel_platform``
    ("tpu" | "gpu" | "cpu") override both models' configs (``with_kernels``; None keeps them).
    """
    target, drafter = load_model(target), load_model(drafter)
    target = with_kernels(target, attention_impl, kernel_platform)
    drafter = with_kernels(drafter, attention_impl, kernel_platform)
    text_prompts = bool(prompts) and all(isinstance(p, str) for p in prompts)
    if chat and not text_prompts:
        raise ValueError("chat=True needs text prompts (one user message per prompt)")
    if text_prompts:
        from dtree_jax.text import encode_prompts

        prompts = encode_prompts(target.path, prompts, chat=chat)
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("need at least one prompt, and every prompt needs at least one token")
    vocab = jnp.shape(target.module.embed_table(target.params))[0]
    for i, p in enumerate(prompts):
        bad = [t for t in p if not 0 <= int(t) < vocab]
        if bad:
            raise ValueError(f"prompt {i} has token ids outside [0, {vocab}): {bad[:5]}")
    longest = max(len(p) for p in prompts)
    prompt_bucket = _bucket(longest) if prompt_bucket is None else prompt_bucket
    if prompt_bucket < longest:
        raise ValueError(f"prompt_bucket {prompt_bucket} is shorter than the longest prompt ({longest})")
    if stop_ids is None:
        stop_ids = target.eos_token_ids
    if budget == "auto":
        budget = auto_budget(load_calibration(calibration, drafter and drafter.path), len(prompts))
    spec = make_spec(
        target, drafter, method, budget=budget, node_topk=node_topk, corr_topm=corr_topm, max_depth=max_depth,
        max_new_tokens=max_new_tokens, prompt_bucket=prompt_bucket, stop_ids=stop_ids, top_k=top_k, top_p=top_p,
        cache_len=cache_len,
    )
    padded = np.zeros((len(prompts), prompt_bucket), np.int32)
    for i, p in enumerate(prompts):
        padded[i, : len(p)] = p
    lens = np.asarray([len(p) for p in prompts], np.int32)
    key = jax.random.key(seed)
    temp = jnp.float32(temperature)
    dparams = drafter.params if spec.record.drafts else None
    args = (spec, target.params, dparams, jnp.asarray(padded), jnp.asarray(lens), key, temp)
    stage_seconds = round_trees = None
    if instrument:
        state, stages, round_trees = _run_instrumented(*args)
        compile_seconds = float("nan")
        seconds = sum(sum(v) for v in stages.values())
        stage_seconds = {k: float(np.mean(v)) if v else 0.0 for k, v in stages.items()}
    else:
        compiled, compile_seconds = _compiled(args)
        t1 = time.perf_counter()
        state = jax.block_until_ready(compiled(*args[1:]))
        seconds = time.perf_counter() - t1
    out, out_len = np.asarray(state.out), np.asarray(state.out_len)
    rounds, reasons = np.asarray(state.rounds), np.asarray(state.stop_reason)
    tokens, stats = [], []
    for i in range(len(prompts)):
        toks = out[i, : out_len[i]].tolist()
        tokens.append(toks)
        stats.append(
            dict(
                generated=len(toks),
                rounds=int(rounds[i]),
                tau=(len(toks) - 1) / rounds[i] if rounds[i] else float("nan"),
                seconds=seconds,
                tokens_per_second=len(toks) / seconds if seconds > 0 else float("nan"),
                stop_reason=loop.STOP_REASONS[int(reasons[i])],
                budget=spec.budget if spec.record.tree else None,
            )
        )
    texts = None
    if text_prompts:
        from dtree_jax.text import load_tokenizer

        texts = [load_tokenizer(target.path).decode(t) for t in tokens]
    return Generation(tokens, stats, compile_seconds, stage_seconds, round_trees, texts)


