"""Running a planned generation: abstract arguments and tracing (for compile-only devices), the compiled
generation (compiled once per static knobs and shapes, then reused: ``COMPILED``, the ``MAX_COMPILED`` most
recently used), and the instrumented mode that runs and times the stages one by one.
"""

from __future__ import annotations

import collections
import functools
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from dtree_jax import cpu_options, loop
from dtree_jax.loading import Model, model_for_mesh
from dtree_jax.models import sharding
from dtree_jax.planning import make_spec


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
    target, drafter = model_for_mesh(target, mesh), model_for_mesh(drafter, mesh)
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
        prompts, lens, keys = (with_sharding(x, sharding.batch_sharding(mesh, x.shape)) for x in (prompts, lens, keys))
        temp = with_sharding(temp, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
    return spec, (tparams, dparams, prompts, lens, keys, temp)


def trace_generation(target: Model, drafter: Model | None, method: str, **kwargs) -> jax.stages.Traced:
    """``generate_on_device`` (prefill + the while_loop) traced from ``abstract_generation``'s arguments (same
    keywords), without running it.  ``.lower(lowering_platforms=("tpu",))`` then cross-lowers the whole
    generation (give the configs a fixed ``kernel_platform`` to get that platform's kernels: ``with_kernels``);
    ``.lower().compile()`` compiles it for the mesh's devices (this machine's without a mesh); ``dtree_jax.aot``
    compiles it for a named chip."""
    spec, args = abstract_generation(target, drafter, method, **kwargs)
    with sharding.mesh_context(spec.mesh):
        return loop.generate_on_device.trace(spec, *args)


_draft_jit = jax.jit(loop.draft, static_argnums=0)
_build_jit = jax.jit(loop.build_tree, static_argnums=0)
_verify_jit = jax.jit(loop.verify, static_argnums=0)
_commit_jit = jax.jit(loop.accept_commit, static_argnums=0)


def _timed(fn, *args):
    t0 = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
    return out, time.perf_counter() - t0


# This process's compiled generations, most recently used last: (spec, argument shapes) -> (program, params,
# baked weight bytes).  Bounded: each program holds its code (XLA:CPU maps ~700 memory regions per generation;
# Linux allows 65,530 per process) and, baked, its weights several times over (SmolLM2's pair, 0.8 GB of weights:
# ~3.4 GB resident per program; eight of them were killed for memory on a 24 GiB host), so the baked weights
# held are also capped at MAX_BAKED_FRACTION of the host's memory.
COMPILED: collections.OrderedDict = collections.OrderedDict()
MAX_COMPILED = 8
MAX_BAKED_FRACTION = 0.1
_compiled_count = 0


def _baked_bytes(baked: bool, *params) -> int:
    return sum(x.nbytes for p in params for x in jax.tree.leaves(p) if hasattr(x, "nbytes")) if baked else 0


def _evict() -> None:
    """Frees the least recently used programs (their code and baked weights) past ``MAX_COMPILED`` programs or
    past ``MAX_BAKED_FRACTION`` of the host's memory in baked weights; the newest program always stays."""
    limit = MAX_BAKED_FRACTION * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    while len(COMPILED) > 1 and (len(COMPILED) > MAX_COMPILED or sum(e[3] for e in COMPILED.values()) > limit):
        COMPILED.popitem(last=False)


def _compiled(args):
    """The compiled generation for these static knobs and argument shapes (compiled once, then reused), called
    with ``args[1:]``.  On the CPU backend the weights are baked in (``cpu_options``): that program belongs to
    these params objects, so they are part of its key (and held, so that their ids are not reused)."""
    spec, tparams, dparams, *rest = args
    baked = cpu_options.bakes_weights(spec.mesh, tparams, dparams)
    leaves, treedef = jax.tree_util.tree_flatten(rest if baked else args[1:])
    key = (spec, baked and (id(tparams), id(dparams)), treedef, tuple((jnp.shape(x), jnp.result_type(x)) for x in leaves))
    global _compiled_count
    if key in COMPILED:
        COMPILED.move_to_end(key)
        return COMPILED[key][0], 0.0
    t0 = time.perf_counter()
    with sharding.mesh_context(spec.mesh):
        run = cpu_options.compile_here(loop.generate_loop, spec, (tparams, dparams), *rest, mesh=spec.mesh,
                                       bake=functools.partial(loop.unshared_heads, spec), kernel=spec.cpu_kernel)
    COMPILED[key] = (run, tparams, dparams, _baked_bytes(baked, tparams, dparams))
    _compiled_count += 1
    _evict()
    return run, time.perf_counter() - t0


def compilations() -> int:
    """How many generations have been compiled in this process (for recompilation checks)."""
    return _compiled_count


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


def run(args, instrument: bool, mesh):
    """Runs the generation: ``(state, seconds, compile_seconds, stage_seconds, round_trees)``; ``seconds``
    excludes compilation (instrumented: the sum of the timed stages)."""
    if instrument:
        with sharding.mesh_context(mesh):
            state, stages, round_trees, compile_seconds = _run_instrumented(*args)
        seconds = sum(sum(v) for v in stages.values())
        return state, seconds, compile_seconds, {k: float(np.mean(v)) if v else 0.0 for k, v in stages.items()}, \
            round_trees
    compiled, compile_seconds = _compiled(args)
    t1 = time.perf_counter()
    state = jax.block_until_ready(compiled(*args[1:]))
    return state, time.perf_counter() - t1, compile_seconds, None, None
