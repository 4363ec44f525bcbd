"""How generations compile on the CPU backend: the weights baked into the program as constants, and XLA:CPU's
YNNPACK dot fusions.

On XLA:CPU a dot of a few rows against weights passed as arguments runs Eigen's GEMM, which costs about twice
the one-row matrix-vector product (SmolLM2-135M on 2 cores: a 5-node verify 1.46x an ``ar`` step).  With the
weights as compile-time constants and ``xla_cpu_experimental_ynn_fusion_type`` set, YNNPACK packs them once at
compile time and 5 or 9 rows cost what one row does (the verify of 5 nodes 1.0x an ``ar`` step, the draft 0.22x:
``experiments/bench_round.py``).  The price: a compiled program holds its own copy of the weights, it compiles
about twice as long, and it is never written to JAX's persistent compilation cache (an entry would hold the
weights).  So weights are baked only on the CPU backend, without a mesh, up to ``BAKE_LIMIT_BYTES``; options
go to ``Lowered.compile`` per program, never to ``XLA_FLAGS``, so programs for accelerators never see them.

Where the weights are baked in and ``cpu_dot`` builds on this machine, the dense weights (``DENSE_FIELDS``) are
baked as ``cpu_dot.PackedWeight`` panels and their dots run the few-row kernel instead of YNNPACK: on our Intel
hosts 5 / 9 rows cost 1.4x / 1.9x one row with YNNPACK and less with the kernel (``experiments/bench_round.py``);
their attention runs ``cpu_dot.tree_attention``, one FFI call a layer instead of about ten XLA ops.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
from typing import Callable

import jax
import jax.numpy as jnp

from dtree_jax import cpu_dot
from dtree_jax.models import kernels
from dtree_jax.models.decoder import DecoderParams
from dtree_jax.models.domino_head import DominoHead
from dtree_jax.models.drafter import DrafterParams
from dtree_jax.models.layers import DenseMLP, LayerParams
from dtree_jax.models.qwen3_5 import AttnParams, GDNParams, Qwen35Params

OPTION_SETS: dict[str, dict[str, str]] = {
    "default": {},
    # XLA:CPU's experimental library fusions: dots handed to YNNPACK / XNNPACK / oneDNN.
    "ynn": {"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_DOT"},
    "xnn": {"xla_cpu_experimental_xnn_fusion_type": "LIBRARY_FUSION_TYPE_DOT"},
    "onednn": {"xla_cpu_experimental_onednn_fusion_type": "LIBRARY_FUSION_TYPE_DOT"},
}
BAKED_OPTIONS = OPTION_SETS["ynn"]
ATTENTION_ENV = "DTREE_JAX_CPU_ATTENTION"  # "0": programs on the kernel's dots keep XLA's attention
BAKE_LIMIT_BYTES = 2 << 30  # weights above this stay arguments (each baked program holds a copy)
# The params fields the models use only as ``x @ w`` (or ``cpu_dot.matmul_fp32``): packed for the kernel.
DENSE_FIELDS = {
    LayerParams: ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"),
    DenseMLP: ("w_gate", "w_up", "w_down"),
    DecoderParams: ("lm_head",),
    DrafterParams: ("fc", "lm_head"),
    DominoHead: ("w_ih", "w_hh", "w1"),  # the Domino GRU and its correction's first layer (builder dots)
    AttnParams: ("wq", "wk", "wv", "wo"),  # the hybrid targets' full-attention layers
    GDNParams: ("w_qkv", "w_z", "w_b", "w_a", "w_out"),  # and their Gated DeltaNet layers
    Qwen35Params: ("lm_head",),
}


def params_bytes(*trees) -> int:
    return sum(x.size * x.dtype.itemsize for t in trees for x in jax.tree.leaves(t) if hasattr(x, "dtype"))


def bakes_weights(mesh, *params) -> bool:
    """Whether a generation over ``params`` compiles with its weights baked in: on the CPU backend, without a
    mesh, and ``params_bytes`` at most ``BAKE_LIMIT_BYTES``."""
    return jax.default_backend() == "cpu" and mesh is None and params_bytes(*params) <= BAKE_LIMIT_BYTES


def runs_kernel(mesh, *params, kernel: bool = True) -> bool:
    """Whether a generation over ``params`` compiled with ``kernel`` (``loop.Spec.cpu_kernel``) runs ``cpu_dot``'s
    kernel: its weights baked in (``bakes_weights``) and the kernel built here."""
    return kernel and cpu_dot.available() and bakes_weights(mesh, *params)


@contextlib.contextmanager
def no_persistent_cache():
    """Keeps the programs compiled inside out of JAX's persistent compilation cache (JAX decides once per
    process whether the cache is used, so the decision is reset on the way in and out)."""
    from jax._src import compilation_cache

    before = jax.config.jax_enable_compilation_cache
    compilation_cache.reset_cache()
    jax.config.update("jax_enable_compilation_cache", False)
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", before)
        compilation_cache.reset_cache()


def kernel_attention() -> bool:
    """Whether programs on the few-row kernel's dots run ``cpu_dot.tree_attention`` too (unless
    ``DTREE_JAX_CPU_ATTENTION=0``)."""
    return os.environ.get(ATTENTION_ENV, "1") != "0"


def compile_baked(fn: Callable, weights: tuple, *args, options: dict | None = None,
                  attention: bool | None = None, ops: bool | None = None) -> Callable:
    """``fn(*weights, *args)`` compiled for this CPU with ``weights`` (pytrees of arrays) as constants and
    ``options`` (default ``BAKED_OPTIONS``); returns the compiled program, called with ``args`` alone.  With
    ``attention`` (default: where ``weights`` hold ``cpu_dot.PackedWeight``s, unless ``DTREE_JAX_CPU_ATTENTION=0``)
    its attention runs ``cpu_dot.tree_attention`` where that takes the shapes (``models.kernels.cpu_attention``);
    with ``ops`` (default: where they hold ``PackedWeight``s) it runs ``cpu_dot``'s small ops too
    (``models.kernels.cpu_ops``)."""
    options = BAKED_OPTIONS if options is None else options
    packed = any(isinstance(w, cpu_dot.PackedWeight)
                 for w in jax.tree.leaves(weights, is_leaf=lambda x: isinstance(x, cpu_dot.PackedWeight)))
    if attention is None:
        attention = kernel_attention() and packed
    ops = packed if ops is None else ops
    with no_persistent_cache(), kernels.cpu_attention(attention), kernels.cpu_ops(ops):
        return jax.jit(functools.partial(fn, *weights)).lower(*args).compile(compiler_options=options)


def _packable(w) -> bool:
    return isinstance(w, jax.Array) and w.ndim == 2 and w.dtype in (jnp.float32, jnp.bfloat16)


def pack_dense(tree):
    """``tree`` (params: dataclasses, tuples, lists) with every fp32 or bf16 2-D weight in ``DENSE_FIELDS`` as a
    ``cpu_dot.PackedWeight``, and a tied output head as a packed copy of the embedding table's transpose (the
    table itself stays for the lookups).  Other fields, and params of other classes, are left as they are."""
    if isinstance(tree, (tuple, list)):
        return type(tree)(pack_dense(t) for t in tree)
    if not dataclasses.is_dataclass(tree) or isinstance(tree, type):
        return tree
    dense = next((f for cls, f in DENSE_FIELDS.items() if isinstance(tree, cls)), ())
    changes = {}
    for field in dataclasses.fields(tree):
        value = getattr(tree, field.name)
        if field.name in dense and _packable(value):
            changes[field.name] = cpu_dot.pack(value)
        elif isinstance(value, (tuple, list)) or dataclasses.is_dataclass(value):
            changes[field.name] = pack_dense(value)
    if isinstance(tree, (DecoderParams, Qwen35Params)) and tree.lm_head is None and _packable(tree.embed):
        changes["lm_head"] = cpu_dot.pack(tree.embed.T)
    return dataclasses.replace(tree, **changes)


def compile_here(fn: Callable, static, weights: tuple, *inputs, mesh=None, bake: Callable | None = None,
                 kernel: bool = True) -> Callable:
    """``fn(static, *weights, *inputs)`` compiled for this backend as generations compile: the weights baked in
    where ``bakes_weights`` says so (``bake(*weights)`` when given: the weights as baked, same values; with
    ``kernel``, their dense weights packed for ``cpu_dot`` where it is available), else every array an argument.
    Returns ``run(*weights, *inputs)``; a baked program ignores the weights it is given (it answers for its own,
    so callers key it by their identity)."""
    if bakes_weights(mesh, *weights):
        baked = weights if bake is None else bake(*weights)
        if kernel and cpu_dot.available():
            baked = pack_dense(baked)
        program = compile_baked(functools.partial(fn, static), baked, *inputs)
        return lambda *args: program(*args[len(weights):])
    return jax.jit(fn, static_argnums=0).lower(static, *weights, *inputs).compile()
