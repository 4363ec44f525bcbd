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

import contextlib
import dataclasses
import functools
import importlib
import json
import math
import pathlib
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dtree_jax import builders, cpu_options, loop, round_costs
from dtree_jax.cost import auto_budget, choose_budget, load_calibration, parse_taus
from dtree_jax.models import MODEL_MODULES, sharding

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
    def embedding_shape(self) -> tuple[int, int]:
        """``(V, H)`` of the target's embedding table (through the protocol, for any implementation)."""
        return tuple(jnp.shape(self.module.embed_table(self.params)))

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


def check_fit(target: Model, drafter: Model) -> None:
    """ValueError naming both checkpoints unless ``drafter`` was built for ``target``'s shapes: the same
    embedding table ``[V, H]``, tap layers inside the target, a mask token inside the vocabulary, and the
    target depth the drafter states (``num_target_layers``)."""
    if target.kind == "drafter":
        raise ValueError(f"{target.path or 'the target'} is a DFlash/Domino drafter, not a target model")
    vocab, hidden = target.embedding_shape
    dcfg = drafter.cfg
    layers = getattr(target.cfg, "num_layers", None)
    problems = []
    if (dcfg.model.vocab_size, dcfg.model.hidden_size) != (vocab, hidden):
        problems.append(f"vocabulary x hidden {dcfg.model.vocab_size} x {dcfg.model.hidden_size} != the target's "
                        f"{vocab} x {hidden}")
    if not 0 <= dcfg.mask_token_id < vocab:
        problems.append(f"mask token {dcfg.mask_token_id} is outside the target's vocabulary ({vocab})")
    if layers is not None and any(not 0 <= i < layers for i in dcfg.target_layer_ids):
        problems.append(f"tap layers {list(dcfg.target_layer_ids)} are outside the target's {layers} layers")
    if layers is not None and dcfg.num_target_layers not in (None, layers):
        problems.append(f"it was trained for a {dcfg.num_target_layers}-layer target, this one has {layers}")
    if problems:
        raise ValueError(f"the drafter {drafter.path or ''} does not fit the target {target.path or ''}: "
                         + "; ".join(problems))


def check_token_ids(ids, vocab: int, what: str) -> None:
    """ValueError unless ``ids`` are integers (not bools or floats) in ``[0, vocab)``."""
    bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, (int, np.integer)) or not 0 <= t < vocab]
    if bad:
        raise ValueError(f"{what}: token ids must be integers in [0, {vocab}), got {bad[:5]}")


def device_memory_bytes() -> int:
    """Memory of this process's first device: its allocator's limit on accelerators, physical memory on CPU."""
    import os

    stats = jax.local_devices()[0].memory_stats() or {}
    if stats.get("bytes_limit"):
        return int(stats["bytes_limit"])
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def memory_estimate(spec: loop.Spec, target: Model, drafter: Model | None, batch: int) -> dict:
    """A generation's memory per device in bytes, from shapes alone (params may be abstract): the params and
    caches as the sharding table splits them over ``spec.mesh``, a round's logits (target, softmax, drafter
    block) and tree mask + one layer's attention scores for each device's requests and heads."""
    mesh = spec.mesh if spec.mesh is not None else sharding.make_mesh(devices=jax.devices()[:1])
    nbytes = lambda tree, cfg: sharding.per_device_bytes(tree, mesh, cfg)  # noqa: E731  one device's share
    n, cache_len = spec.num_nodes, spec.cache_len
    vocab = target.embedding_shape[0]
    rows = -(-batch // sharding.axis_size(mesh, sharding.DATA))  # requests per device
    heads = getattr(spec.target_cfg, "num_heads", 1)
    model = sharding.axis_size(mesh, sharding.MODEL)
    heads = heads // model if heads % model == 0 else heads
    est = dict(
        params=nbytes(target.params, target.cfg) + (
            nbytes(drafter.params, drafter.cfg) if spec.drafter_cfg is not None else 0),
        cache=nbytes(jax.eval_shape(lambda: target.module.init_cache(spec.target_cfg, batch, cache_len)),
                     target.cfg),
        logits=3 * rows * n * vocab * 4,
        tree=rows * n * n + 4 * rows * n * (cache_len + n) * heads,
    )
    if spec.drafter_cfg is not None:
        from dtree_jax.models import drafter as drafter_module

        est["cache"] += nbytes(jax.eval_shape(
            lambda: drafter_module.init_drafter_cache(spec.drafter_cfg, batch, cache_len)), drafter.cfg)
    return est


def check_memory(spec: loop.Spec, target: Model, drafter: Model | None, batch: int, fraction: float = 0.8) -> dict:
    """``memory_estimate`` before anything is compiled; raises a ValueError naming the knob to lower when it
    exceeds ``fraction`` of the device's memory.  Returns the estimate (bytes)."""
    est = memory_estimate(spec, target, drafter, batch)
    limit = fraction * device_memory_bytes()
    if sum(est.values()) > limit:
        biggest = max(est, key=est.get)
        knob = dict(params="a smaller model or dtype, or a mesh", cache="max_new_tokens, the prompt length or the batch",
                    logits="budget or the batch", tree="budget or the batch")[biggest]
        raise ValueError(
            f"this generation needs about {sum(est.values()) / 2**30:.1f} GiB per device ({biggest}: "
            f"{est[biggest] / 2**30:.1f} GiB) but the device has {limit / fraction / 2**30:.1f} GiB; lower {knob}")
    return est


def request_keys(seed: int, batch: int) -> jax.Array:  # [batch] keys
    """Request ``i``'s random stream: ``fold_in(key(seed), i)``, so a request's sample depends on the seed and
    its index, never on the other requests of its batch."""
    return jax.vmap(lambda i: jax.random.fold_in(jax.random.key(seed), i))(jnp.arange(batch))


def load_model(model, mesh=None) -> Model | None:
    """A ``Model`` from a checkpoint path (converted or HF directory, or a GGUF file: its converted copy in the
    cache), a ``(kind, cfg, params)`` tuple, or a ``Model``; None stays None.  With a ``mesh`` (``Mesh``,
    ``"data=2,model=4"`` or a dict; see ``models.sharding``) the params are placed on it with their table
    shardings: a converted checkpoint is restored straight into its shards."""
    mesh = sharding.as_mesh(mesh)
    if model is None:
        return None
    if isinstance(model, (str, bytes)) or hasattr(model, "__fspath__"):
        from dtree_jax import convert

        path = convert.model_dir(model, weights=mesh is None)  # with a mesh a GGUF file streams into its shards
        kind, cfg, params = convert.load_model(model, mesh=mesh)
        return cpu_layout(Model(kind, cfg, params, str(path), eos_ids(path)), mesh)
    if isinstance(model, tuple) and len(model) == 3:
        model = Model(*model)
    if not isinstance(model, Model):
        raise TypeError(f"expected a Model, a (kind, cfg, params) tuple or a checkpoint path, got "
                        f"{type(model).__name__}")
    return model if mesh is None else dataclasses.replace(model, params=sharding.place(model.params, mesh, model.cfg))


def cpu_layout(model: Model, mesh=None) -> Model:
    """On the CPU backend, a loaded target with tied embeddings gets its output head as its own contiguous
    ``[H, V]`` copy of the table (``Qwen3Params.lm_head``; placed on ``mesh`` with the table's sharding when
    given).  The logits are the same; XLA:CPU's matmuls read ``[H, V]`` faster than the transposed ``[V, H]``
    table (SmolLM2-135M's 49,152 x 576 head, 5 rows on 2 cores: 6.4 ms instead of 8.7), for a second copy of
    the table in memory, so accelerators keep the tied table.  Drafters, custom implementations and untied
    targets are returned as they are."""
    params = model.params
    if model.kind == "drafter" or model.impl is not None or jax.default_backend() != "cpu":
        return model
    if getattr(params, "lm_head", 0) is not None:  # untied already (or no such field)
        return model
    head = None
    if mesh is not None:
        table = jax.ShapeDtypeStruct(params.embed.shape[::-1], params.embed.dtype)
        head = sharding.shardings(dataclasses.replace(params, lm_head=table), mesh, model.cfg).lm_head
    lm_head = jax.jit(jnp.transpose, out_shardings=head)(params.embed)
    return dataclasses.replace(model, params=dataclasses.replace(params, lm_head=lm_head))


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
    mesh: jax.sharding.Mesh | None = None,
    stream: bool = False,
) -> loop.Spec:
    """Validates the knobs and returns the static description of a generation (on ``mesh``, if given)."""
    record = builders.get_method(method)
    if record.drafts:
        if drafter is None:
            raise ValueError(f"method {method!r} needs a drafter")
        if drafter.kind != "drafter":
            raise ValueError(f"the drafter checkpoint is a {drafter.kind!r} model, not a DFlash/Domino drafter")
        if record.needs_head and not drafter.cfg.has_head:
            raise ValueError(f"method {method!r} needs a Domino drafter (with the GRU head); this is plain DFlash")
        check_fit(target, drafter)
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
        mesh=mesh,
        stream=stream,
    )
    need = prompt_bucket + max_new_tokens + spec.draft_span
    if cache_len is None:
        cache_len = _bucket(need, 64)
    elif cache_len < prompt_bucket + spec.draft_span:
        raise ValueError(f"cache_len {cache_len} cannot hold a {prompt_bucket}-token prompt bucket plus one round")
    return dataclasses.replace(spec, cache_len=cache_len)



def abstract_generation(target: Model, drafter: Model | None, method: str, *, batch: int = 1,
                        prompt_bucket: int = 16, mesh=None, **knobs) -> tuple[loop.Spec, tuple]:
    """The static ``Spec`` and the abstract arguments of ``generate_on_device`` for ``batch`` prompts of one
    bucket: params (``abstract_params``, or any params: only their shapes are kept), prompts, lengths, the
    requests' keys and the temperature, all ``jax.ShapeDtypeStruct`` (on a ``mesh``, with the table's
    shardings), so the generation traces on compile-only devices too.  ``knobs`` go to ``make_spec``
    (defaults: budget 8, k 4, 16 new tokens)."""
    knobs = dict(dict(budget=8, node_topk=4, corr_topm=None, max_depth=None, max_new_tokens=16, stop_ids=(),
                      top_k=0, top_p=1.0), **knobs)
    mesh = sharding.as_mesh(mesh)
    target, drafter = _for_mesh(target, mesh), _for_mesh(drafter, mesh)
    spec = make_spec(target, drafter, method, prompt_bucket=prompt_bucket, mesh=mesh, **knobs)
    shape = lambda tree: jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), x.dtype), tree)  # noqa: E731
    tparams = shape(target.params)
    dparams = shape(drafter.params) if spec.record.drafts else None
    prompts = jax.ShapeDtypeStruct((batch, prompt_bucket), jnp.int32)
    lens = jax.ShapeDtypeStruct((batch,), jnp.int32)
    keys = jax.ShapeDtypeStruct((batch,), jax.random.key(0).dtype)
    temp = jax.ShapeDtypeStruct((), jnp.float32)
    if mesh is not None:
        with_sharding = lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)  # noqa: E731
        on_mesh = lambda tree, cfg: jax.tree.map(with_sharding, tree, sharding.shardings(tree, mesh, cfg))  # noqa: E731
        tparams = on_mesh(tparams, target.cfg)
        dparams = on_mesh(dparams, drafter.cfg) if dparams is not None else None
        prompts, lens, keys = (with_sharding(x, _batch_sharding(mesh, x.shape)) for x in (prompts, lens, keys))
        temp = with_sharding(temp, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
    return spec, (tparams, dparams, prompts, lens, keys, temp)


def trace_generation(target: Model, drafter: Model | None, method: str, **kwargs) -> jax.stages.Traced:
    """``generate_on_device`` (prefill + the while_loop) traced from ``abstract_generation``'s arguments (same
    keywords), without running it.  ``.lower(lowering_platforms=("tpu",))`` then cross-lowers the whole
    generation (give the configs a fixed ``kernel_platform`` to get that platform's kernels: ``with_kernels``);
    ``.lower().compile()`` compiles it for the mesh's devices (this machine's without a mesh); ``dtree_jax.aot``
    compiles it for a named chip."""
    spec, args = abstract_generation(target, drafter, method, **kwargs)
    with _mesh_context(spec.mesh):
        return loop.generate_on_device.trace(spec, *args)


def _for_mesh(model: Model | None, mesh) -> Model | None:
    """``model`` with its config set up for ``mesh`` (``sharding.for_mesh``: the KV cache's head layout)."""
    if model is None or mesh is None:
        return model
    return dataclasses.replace(model, cfg=sharding.for_mesh(model.cfg, mesh))


def _batch_sharding(mesh, shape) -> jax.sharding.NamedSharding:
    """Requests over ``data`` (when it divides the batch), the rest replicated."""
    axes = ("batch",) + (None,) * (len(shape) - 1)
    return jax.sharding.NamedSharding(mesh, sharding.partition_spec(axes, tuple(shape), mesh))


def _mesh_context(mesh):
    """``jax.set_mesh(mesh)`` (the Pallas kernels read it while tracing), or nothing without a mesh."""
    import contextlib

    return contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh)



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
    """The compiled generation for these static knobs and argument shapes (compiled once, then reused), called
    with ``args[1:]``.  On the CPU backend the weights are baked in (``cpu_options``): that program belongs to
    these params objects, so they are part of its key (and held, so that their ids are not reused)."""
    spec, tparams, dparams, *rest = args
    baked = cpu_options.bakes_weights(spec.mesh, tparams, dparams)
    leaves, treedef = jax.tree_util.tree_flatten(rest if baked else args[1:])
    key = (spec, baked and (id(tparams), id(dparams)), treedef, tuple((jnp.shape(x), jnp.result_type(x)) for x in leaves))
    if key in COMPILED:
        return COMPILED[key][0], 0.0
    t0 = time.perf_counter()
    with _mesh_context(spec.mesh):
        run = cpu_options.compile_here(loop.generate_loop, spec, (tparams, dparams), *rest, mesh=spec.mesh,
                                       bake=functools.partial(loop.unshared_heads, spec))
    COMPILED[key] = (run, tparams, dparams)
    return run, time.perf_counter() - t0


def compilations() -> int:
    """How many distinct generations have been compiled in this process (for recompilation checks)."""
    return len(COMPILED)


def _run_instrumented(spec, tparams, dparams, prompts, lens, key, temperature):
    """The loop's stages one by one, each timed; prefill and one untimed pass of every stage on the first
    round's shapes come first (their seconds are the returned compile time), so no stage time holds a
    compilation."""
    t0 = time.perf_counter()
    state = jax.block_until_ready(loop.prefill_on_device(spec, tparams, dparams, prompts, lens, key, temperature))
    if bool(jnp.any(~state.done)):
        rnd = jax.block_until_ready(_draft_jit(spec, tparams, dparams, state))
        tree = jax.block_until_ready(_build_jit(spec, tparams, dparams, rnd, state))
        logits, feats, cache = jax.block_until_ready(_verify_jit(spec, tparams, tree, state))
        jax.block_until_ready(_commit_jit(spec, dparams, tree, logits, feats, cache, state, temperature))
    compile_seconds = time.perf_counter() - t0
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
    return state, stages, trees, compile_seconds



def choose_auto(target: Model, drafter: Model | None, method: str, calibration, knobs: dict,
                inputs: tuple) -> tuple[str, int, str]:
    """``budget="auto"``: ``(method, budget, why)``.  Tau per budget comes from the calibration (``calibration``,
    else the drafter's ``calibration.json``); seconds per round from ``calibration["round_seconds"]`` when the
    caller passed a calibration holding them, else measured on this machine at this batch and cached
    (``round_costs``).  Budget 0 is plain ar: where no tree pays for itself here, ar runs."""
    record = builders.get_method(method)
    if not record.tree:
        return method, 1, f"budget auto: {method} drafts a chain, no budget to choose"
    cal = load_calibration(calibration, drafter and drafter.path)
    batch = int(inputs[0].shape[0])
    if calibration is not None and isinstance(cal, dict) and "round_seconds" in cal:
        budget = auto_budget(cal, batch)
        why = "from the given calibration's round_seconds"
    else:
        taus = parse_taus(cal)
        specs = {b: make_spec(target, drafter if b else None, method if b else "ar", budget=max(b, 1), **knobs)
                 for b in taus}
        from dtree_jax.convert import cache_dir

        dparams = drafter.params if drafter is not None else None
        with _mesh_context(knobs.get("mesh")):
            seconds, source = round_costs.seconds_per_round(specs, target.params, dparams, inputs, taus, cache_dir())
        budget = choose_budget(batch, {b: taus[b] for b in seconds}, lambda _, n: seconds[n - 1])
        rate = lambda b: batch * taus[b] / seconds[b]  # noqa: E731
        why = (f"expected {rate(budget):.1f} tok/s (tau {taus[budget]:.2f}, {seconds[budget] * 1e3:.0f} ms a round) vs "
               f"ar {rate(0):.1f} tok/s ({seconds[0] * 1e3:.0f} ms), "
               + ", ".join(f"budget {b} {rate(b):.1f}" for b in sorted(seconds) if b not in (0, budget))
               + f"; round costs {'measured now on this machine' if source == 'measured now' else 'of this machine from ' + source}")
    if budget == 0:
        return "ar", 1, f"budget auto: plain ar at batch {batch}, no tree pays for itself here; {why}"
    return method, budget, f"budget auto: {method} budget {budget} at batch {batch}; {why}"


def _run(args, instrument: bool, mesh):
    """Runs the generation: ``(state, seconds, compile_seconds, stage_seconds, round_trees)``; ``seconds``
    excludes compilation (instrumented: the sum of the timed stages)."""
    if instrument:
        with _mesh_context(mesh):
            state, stages, round_trees, compile_seconds = _run_instrumented(*args)
        seconds = sum(sum(v) for v in stages.values())
        return state, seconds, compile_seconds, {k: float(np.mean(v)) if v else 0.0 for k, v in stages.items()}, \
            round_trees
    compiled, compile_seconds = _compiled(args)
    t1 = time.perf_counter()
    state = jax.block_until_ready(compiled(*args[1:]))
    return state, time.perf_counter() - t1, compile_seconds, None, None


@dataclasses.dataclass
class Generation:
    tokens: list[list[int]]  # generated ids per request (stop token included, nothing after it)
    # per request: generated, rounds, tau, seconds (until this request stopped: the batch's wall time times
    # its share of the rounds), tokens_per_second, stop_reason, method (the one run: "ar" where budget "auto"
    # chose not to speculate), budget (tree methods)
    stats: list[dict]
    compile_seconds: float  # 0.0 when this generation was already compiled in this process
    seconds: float  # wall time of the whole batch (goodput = sum of generated / seconds)
    stage_seconds: dict | None = None  # instrumented mode: mean seconds per round of each stage
    # Instrumented mode: per round, per request: active, lens (committed length), the tree's tokens and
    # parents (node 0 = the root) and the number of tokens emitted.
    round_trees: list[dict] | None = None
    texts: list[str] | None = None  # text prompts only: ``tokens`` decoded (special tokens skipped)
    auto: str | None = None  # budget="auto": what it chose and why, in one line


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
    mesh=None,
    stream: Callable[[list[list[int]]], None] | None = None,
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
    token ids (``[]`` for a request that committed none); the returned ``tokens`` are the same.
    """
    mesh = sharding.as_mesh(mesh)
    if stream is not None and (mesh is not None or not callable(stream)):
        raise ValueError("stream must be a callable, and streaming runs on one device (mesh=None)")
    target, drafter = _for_mesh(load_model(target, mesh), mesh), _for_mesh(load_model(drafter, mesh), mesh)
    if target.kind == "drafter":
        raise ValueError(f"{target.path or 'the target'} is a DFlash/Domino drafter, not a target model; pass it as "
                         "the drafter")
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
    vocab = target.embedding_shape[0]
    for i, p in enumerate(prompts):
        check_token_ids(p, vocab, f"prompt {i}")
    if stop_ids is None:
        stop_ids = target.eos_token_ids
    check_token_ids(stop_ids, vocab, "stop_ids")
    if not isinstance(temperature, (int, float)) or not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {temperature!r}")
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise ValueError(f"seed must be an integer, got {seed!r}")
    longest = max(len(p) for p in prompts)
    max_positions = getattr(target.cfg, "max_position_embeddings", None)
    if max_positions and isinstance(max_new_tokens, int) and longest + max_new_tokens > max_positions:
        raise ValueError(f"a {longest}-token prompt plus max_new_tokens={max_new_tokens} exceeds the target's "
                         f"{max_positions} positions (max_position_embeddings); shorten the prompt or lower "
                         "max_new_tokens")
    prompt_bucket = _bucket(longest) if prompt_bucket is None else prompt_bucket
    if prompt_bucket < longest:
        raise ValueError(f"prompt_bucket {prompt_bucket} is shorter than the longest prompt ({longest})")
    padded = np.zeros((len(prompts), prompt_bucket), np.int32)
    for i, p in enumerate(prompts):
        padded[i, : len(p)] = p
    lens = np.asarray([len(p) for p in prompts], np.int32)
    key = request_keys(seed, len(prompts))
    inputs = [jnp.asarray(padded), jnp.asarray(lens), key]
    if mesh is not None:
        inputs = [sharding.put(x, _batch_sharding(mesh, x.shape)) for x in inputs]
    temp = jnp.float32(temperature)
    knobs = dict(node_topk=node_topk, corr_topm=corr_topm, max_depth=max_depth, max_new_tokens=max_new_tokens,
                 prompt_bucket=prompt_bucket, stop_ids=stop_ids, top_k=top_k, top_p=top_p, cache_len=cache_len,
                 mesh=mesh)
    auto = None
    if budget == "auto":
        method, budget, auto = choose_auto(target, drafter, method, calibration, knobs, (*inputs, temp))
    spec = make_spec(target, drafter, method, budget=budget, stream=stream is not None, **knobs)
    check_memory(spec, target, drafter, len(prompts))
    dparams = drafter.params if spec.record.drafts else None
    args = (spec, target.params, dparams, *inputs, temp)
    sink = (lambda toks, num: stream([t[:n].tolist() for t, n in zip(toks, num)])) if stream else None
    with loop.streaming(sink) if sink else contextlib.nullcontext():
        state, seconds, compile_seconds, stage_seconds, round_trees = _run(args, instrument, mesh)
    out, out_len = sharding.to_host(state.out), sharding.to_host(state.out_len)
    rounds, reasons = sharding.to_host(state.rounds), sharding.to_host(state.stop_reason)
    tokens, stats = [], []
    for i in range(len(prompts)):
        toks = out[i, : out_len[i]].tolist()
        tokens.append(toks)
        # Rounds run in lockstep: request i was done after its own rounds (+ the prefill) of the batch's.
        own = seconds * (int(rounds[i]) + 1) / (int(rounds.max()) + 1)
        stats.append(
            dict(
                generated=len(toks),
                rounds=int(rounds[i]),
                tau=float((len(toks) - 1) / rounds[i]) if rounds[i] else float("nan"),
                seconds=own,
                tokens_per_second=len(toks) / own if own > 0 else float("nan"),
                stop_reason=loop.STOP_REASONS[int(reasons[i])],
                method=method,
                budget=spec.budget if spec.record.tree else None,
            )
        )
    texts = None
    if text_prompts:
        from dtree_jax.text import load_tokenizer

        texts = [load_tokenizer(target.path).decode(t) for t in tokens]
    return Generation(tokens, stats, compile_seconds, seconds, stage_seconds, round_trees, texts, auto)


