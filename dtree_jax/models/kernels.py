"""Which kernel runs where: the one place that turns a model config into kernel arguments.

A config's ``attention_impl`` says whether the Pallas kernels are wanted ("pallas") or not ("xla"); its
``kernel_platform`` says whose kernels: "tpu" (Mosaic), "gpu" (Triton) or "cpu" (the TPU kernels in interpret
mode).  ``kernel_platform=None`` means the platform this process runs on, ``runtime_platform()``, resolved here
and nowhere else; a fixed value makes the traced program the same on any machine, so a CPU can cross-lower the
real TPU or GPU program (``jit(...).trace(...).lower(lowering_platforms=...)``).

Where a kernel has no version for a platform, the XLA path runs there on purpose (``KERNELS``).

On the CPU the XLA path's attention may instead run ``dtree_jax.cpu_dot.tree_attention`` (one FFI call a layer):
programs traced inside ``cpu_attention()`` do, where it takes the shapes (``cpu_options.compile_baked`` traces the
programs whose dense dots run the few-row kernel there), and inside ``cpu_ops()`` its small ops: RoPE's tables
computed once, greedy acceptance's argmax.
"""

from __future__ import annotations

import contextlib
import contextvars

import jax

from dtree_jax.models.config import ATTENTION_IMPLS, KERNEL_PLATFORMS, check_kernel_platform

# op -> platform -> what attention_impl="pallas" runs: a Pallas kernel ("mosaic", "triton", "interpret") or "xla"
KERNELS = {
    "tree_attention": {"tpu": "mosaic", "gpu": "triton", "cpu": "interpret"},
    "tree_gdn": {"tpu": "mosaic", "gpu": "xla", "cpu": "interpret"},  # no GPU tree-GDN kernel yet
}


def runtime_platform() -> str:
    """This process's default JAX backend as a kernel platform ("tpu", "gpu"; anything else is "cpu")."""
    backend = jax.default_backend()
    return backend if backend in ("tpu", "gpu") else "cpu"


def kernel_platform(cfg) -> str:
    """The platform whose kernels ``cfg`` selects: ``cfg.kernel_platform``, or the runtime's when None."""
    platform = getattr(cfg, "kernel_platform", None)
    check_kernel_platform(platform)
    return runtime_platform() if platform is None else platform


def kernel_choice(op: str, cfg) -> str:
    """``KERNELS[op][platform]`` when ``cfg.attention_impl == "pallas"``, else "xla"."""
    if cfg.attention_impl not in ATTENTION_IMPLS:
        raise ValueError(f"attention_impl must be one of {ATTENTION_IMPLS}, got {cfg.attention_impl!r}")
    if cfg.attention_impl == "xla":
        return "xla"
    return KERNELS[op][kernel_platform(cfg)]


_CPU_ATTENTION = contextvars.ContextVar("dtree_jax_cpu_attention", default=False)


@contextlib.contextmanager
def cpu_attention(enabled: bool = True):
    """Programs traced inside, with ``attention_impl="xla"`` on the CPU, run the XLA path's attention as
    ``cpu_dot.tree_attention`` where it takes the shapes (``cpu_attention_wanted``)."""
    token = _CPU_ATTENTION.set(enabled)
    try:
        yield
    finally:
        _CPU_ATTENTION.reset(token)


def cpu_attention_wanted(cfg) -> bool:
    """Whether ``cfg``'s attention, traced now, should run ``cpu_dot.tree_attention``: inside ``cpu_attention()``,
    for the XLA path on the CPU."""
    return _CPU_ATTENTION.get() and kernel_choice("tree_attention", cfg) == "xla" and kernel_platform(cfg) == "cpu"


_CPU_OPS = contextvars.ContextVar("dtree_jax_cpu_ops", default=False)


@contextlib.contextmanager
def cpu_ops(enabled: bool = True):
    """Programs traced inside, on the CPU, run ``cpu_dot``'s small ops (``cpu_ops_wanted``): RoPE's tables behind
    ``cpu_dot.fusion_barrier`` and greedy acceptance's ``cpu_dot.first_argmax``."""
    token = _CPU_OPS.set(enabled)
    try:
        yield
    finally:
        _CPU_OPS.reset(token)


def cpu_ops_wanted() -> bool:
    """Whether what is traced now should run ``cpu_dot``'s small ops: inside ``cpu_ops()``, on the CPU."""
    return _CPU_OPS.get() and runtime_platform() == "cpu"


def moe_grouping(cfg, tokens: int) -> str:
    """How ``models.moe.moe_mlp`` runs ``tokens`` tokens' routed experts for ``cfg``: "ragged" (grouped GEMM) on
    GPU; on TPU and CPU "gather" while the token-expert pairs are no more than the experts, else "dense".
    XLA:CPU's ``ragged_dot`` costs every expert for every pair; XLA:TPU's held ~0.7 GB of temporaries per layer
    in the decode loop of a Qwen3-Next-80B generation on a v5e-16 (33.8 GB: refused), gather + dense 0.4 GB in
    all (README, "Real model sizes")."""
    if kernel_platform(cfg) == "gpu":
        return "ragged"
    return "gather" if tokens * cfg.num_experts_per_tok <= cfg.num_experts else "dense"


def attention_kwargs(cfg) -> dict:
    """``tree_attention``'s ``backend`` / ``interpret`` for ``cfg`` (backend "xla": the jnp reference): the
    kernel choice in the kernel package's own terms (``tree_gdn_mixer`` takes the choice as it is)."""
    choice = kernel_choice("tree_attention", cfg)
    backend = {"mosaic": "tpu", "triton": "gpu", "interpret": "tpu", "xla": "xla"}[choice]
    return dict(backend=backend, interpret=choice == "interpret")


__all__ = ["KERNELS", "KERNEL_PLATFORMS", "runtime_platform", "kernel_platform", "kernel_choice", "moe_grouping",
           "attention_kwargs", "cpu_attention", "cpu_attention_wanted", "cpu_ops", "cpu_ops_wanted"]
