"""The Python API: load models, run a generation, read its tokens and statistics.

    from dtree_jax import api
    target, drafter = api.load_model("checkpoints/tiny-target"), api.load_model("checkpoints/tiny-domino")
    result = api.generate(target, [[1, 2, 3]], "dominotree", drafter, budget=16)

``generate`` composes the API's parts, one module per job: ``loading`` (``Model``, ``load_model``, kernel
overrides), ``planning`` (checks, the loop's static ``Spec``, ``budget="auto"``), ``running`` (the compiled
generation, compiled once per (knobs, shapes) and reused; the instrumented mode that times each stage;
abstract arguments and tracing for compile-only devices) and ``results`` (``Generation``).  A target is one
of ours (a converted / HF / GGUF checkpoint) or any object satisfying ``models.protocol.TargetModel``
(``Model(kind, cfg, params, impl=...)``; ``models.nnx_target`` wraps a Flax NNX module).
"""

from __future__ import annotations

import contextlib
from typing import Callable, Sequence

from dtree_jax import builders, cpu_options, loop
from dtree_jax.loading import Model, cpu_layout, eos_ids, load_model, load_pair, model_for_mesh, with_kernels
from dtree_jax.models import sharding
from dtree_jax.planning import (
    CPU_DOTS,
    check_fit,
    check_memory,
    check_token_ids,
    choose_auto,
    device_memory_bytes,
    draft_vocabulary,
    encode_requests,
    make_spec,
    memory_estimate,
    request_keys,
)
from dtree_jax.results import Generation, collect
from dtree_jax.running import abstract_generation, compilations, run, trace_generation

METHODS = tuple(builders.REGISTRY)  # the method registry's names, "ar" first


def generate(
    target, prompts: Sequence[Sequence[int]], method: str = "dominotree", drafter=None, *,
    budget: int | str = 32, node_topk: int = 8, corr_topm: int | None = None, max_depth: int | None = None,
    temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0, max_new_tokens: int = 64,
    stop_ids: Sequence[int] | None = None, prompt_bucket: int | None = None, cache_len: int | None = None,
    instrument: bool = False, calibration: dict | str | None = None, attention_impl: str | None = None,
    kernel_platform: str | None = None, chat: bool = False, mesh=None,
    stream: Callable[[list[list[int]]], None] | None = None, draft_vocab: str | Sequence[int] | None = "auto",
    cpu_dots: str = "auto",
) -> Generation:
    """Generates continuations of ``prompts`` with ``method`` on device.

    ``prompts`` are token-id lists, or strings encoded with the target's ``tokenizer.json``; with ``chat``
    each string is one user message, wrapped in the checkpoint's chat template first (the result's ``texts``
    then hold the decoded responses).  ``target`` and ``drafter`` are ``Model``s, ``(kind, cfg, params)``
    tuples, or checkpoint paths (converted or HF directories; a target may be a GGUF file).  ``budget`` is the number of non-root tree nodes (tree methods), ``node_topk`` the
    branching cap k, ``corr_topm`` the Domino candidate width M (0 = full vocabulary; default: the reference's, full for
    ``domino`` and 64 for ``dominotree``); ``budget="auto"`` chooses the budget, or plain ``ar``
    (``stats[i]["method"]``), with the most tokens/s from tau per budget (the drafter's calibration, or
    ``calibration``) and this machine's seconds per round (``choose_auto``; the result's ``auto`` says why).  Temperature 0 is
    greedy; above 0 the target is sampled at every node (lossless).  ``stop_ids`` default to the target's
    EOS ids.  Prompts are right-padded to ``prompt_bucket`` (default: the longest rounded up to 16) so
    prompts of one bucket share one compilation.  ``attention_impl`` ("xla" | "pallas") and ``kernel_platform``
    ("tpu" | "gpu" | "cpu") override both models' configs (``with_kernels``; None keeps them).  ``mesh``
    (a ``Mesh`` with axes ``data`` / ``model``, ``"data=2,model=4"`` or a dict) runs the same generation sharded
    (``models.sharding``): params, caches and the decode state placed on it, the same tokens as on one device.
    ``stream`` (one device) is called on the host each time tokens are committed, with each request's new
    token ids (``[]`` for a request that committed none); the returned ``tokens`` are the same.  ``draft_vocab``:
    the tokens the drafter may propose (``planning.draft_vocabulary``: "auto" uses the drafter's
    ``draft_vocab.json`` where the weights are baked in, None every token); the drafts change, the output does not.
    ``cpu_dots``: the dense dots of CPU programs that bake their weights in: "kernel" (``cpu_dot``'s few-row
    kernel, where it builds), "xla" (XLA's), or "auto" (the kernel; with ``budget="auto"``, whichever gave more
    tokens/s here).  The result's ``cpu_dots`` says which ran, its ``ar_cpu_dots`` which a fair ar baseline runs.
    """
    if cpu_dots not in CPU_DOTS:
        raise ValueError(f"cpu_dots must be one of {', '.join(CPU_DOTS)}, got {cpu_dots!r}")
    mesh = sharding.as_mesh(mesh)
    if stream is not None and (mesh is not None or not callable(stream)):
        raise ValueError("stream must be a callable, and streaming runs on one device (mesh=None)")
    target, drafter = load_pair(target, drafter, mesh, attention_impl, kernel_platform)
    req = encode_requests(target, prompts, chat=chat, stop_ids=stop_ids, temperature=temperature, seed=seed,
                          max_new_tokens=max_new_tokens, prompt_bucket=prompt_bucket, mesh=mesh)
    knobs = dict(node_topk=node_topk, corr_topm=corr_topm, max_depth=max_depth, max_new_tokens=max_new_tokens,
                 prompt_bucket=req.prompt_bucket, stop_ids=req.stop_ids, top_k=top_k, top_p=top_p,
                 cache_len=cache_len, mesh=mesh, draft_vocab=draft_vocabulary(target, drafter, draft_vocab, mesh))
    auto, kernel = None, cpu_dots != "xla"
    ar_kernel = kernel
    if budget == "auto":
        choice = choose_auto(target, drafter, method, calibration, knobs, (*req.inputs, req.temperature), cpu_dots)
        method, budget, auto, kernel, ar_kernel = choice
    spec = make_spec(target, drafter, method, budget=budget, stream=stream is not None, cpu_kernel=kernel, **knobs)
    check_memory(spec, target, drafter, len(req.prompts), prompt_bucket=req.prompt_bucket)
    dparams = drafter.params if spec.record.drafts else None
    args = (spec, target.params, dparams, *req.inputs, req.temperature)
    sink = (lambda toks, num: stream([t[:n].tolist() for t, n in zip(toks, num)])) if stream else None
    with loop.streaming(sink) if sink else contextlib.nullcontext():
        state, seconds, compile_seconds, stage_seconds, round_trees = run(args, instrument, mesh)
    tokens, stats = collect(state, spec, seconds=seconds)
    texts = None
    if req.text:
        from dtree_jax.text import load_tokenizer

        texts = [load_tokenizer(target.path).decode(t) for t in tokens]

    def dots(kernel: bool, *params) -> str:
        return "kernel" if cpu_options.runs_kernel(mesh, *params, kernel=kernel) else "xla"

    return Generation(tokens, stats, compile_seconds, seconds, stage_seconds, round_trees, texts, auto,
                      dots(spec.cpu_kernel, target.params, dparams), dots(ar_kernel, target.params))


__all__ = ["CPU_DOTS", "METHODS", "Generation", "Model", "abstract_generation", "check_fit", "check_memory",
           "check_token_ids", "choose_auto", "compilations", "cpu_layout", "device_memory_bytes", "draft_vocabulary",
           "eos_ids", "generate", "load_model", "make_spec", "memory_estimate", "model_for_mesh", "request_keys",
           "trace_generation", "with_kernels"]
