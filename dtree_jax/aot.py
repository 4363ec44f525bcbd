"""Ahead-of-time compilation of a whole generation for a named chip, from any machine.

    from dtree_jax import aot
    report = aot.compile_for("Qwen3-8B/config.json", "Qwen3-8B-Domino/config.json", "dominotree", "v5e-4")
    print(report.summary())        # compile seconds, kernel calls, memory per chip, whether it fits

The generation (prefill + the ``while_loop`` of rounds, ``api.trace_generation``) is traced from abstract values
only (params from the configs, prompts, keys and temperature as ``jax.ShapeDtypeStruct`` on the chip's mesh),
lowered with the chip's Pallas kernels (Mosaic on TPU, Triton on GPU) and compiled by the chip's own compiler on
this host (``dtree_jax.chips``; call ``chips.allow_compile_only()`` before JAX's first device query so the CUDA
plugin registers on a host without a GPU).  One compiled program serves every temperature; the knobs that shape it are the
method, batch, prompt bucket, cache length, budget, k and M.  ``dtree-jax compile`` is the command line.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import time
from typing import Any

import jax

from dtree_jax import api, builders, chips, loop
from dtree_jax.models import kernels, sharding
from dtree_jax.models.config import ATTENTION_IMPLS

GIB = 2**30
MEMORY_FIELDS = ("argument", "output", "temp", "generated_code", "alias")


@dataclasses.dataclass
class CompileReport:
    """What compiling one generation for one chip gave; ``memory`` is per device in bytes
    (``compiled.memory_analysis()``), ``error`` the compiler's refusal in one line (None when it compiled)."""

    chip: str
    platform: str
    mesh: dict  # {"data": d, "model": m}
    method: str
    batch: int
    prompt_bucket: int
    cache_len: int
    budget: int | None
    target: str
    drafter: str | None
    dtype: str
    memory_limit: int  # HBM per device
    seconds: dict = dataclasses.field(default_factory=dict)  # trace / lower / compile
    kernel_calls: dict = dataclasses.field(default_factory=dict)  # "mosaic" / "triton" -> calls in the program
    memory: dict | None = None
    error: str | None = None
    hint: str | None = None  # which knob to lower when it does not fit

    @property
    def needed(self) -> int | None:
        """Bytes per device: arguments + outputs + temporaries + generated code, less what outputs alias."""
        if self.memory is None:
            return None
        m = self.memory
        return m["argument"] + m["output"] + m["temp"] + m["generated_code"] - m["alias"]

    @property
    def fits(self) -> bool:
        return self.error is None and self.needed is not None and self.needed <= self.memory_limit

    def to_dict(self) -> dict:
        return dict(dataclasses.asdict(self), needed=self.needed, fits=self.fits)

    def summary(self) -> str:
        mesh = f"data={self.mesh['data']},model={self.mesh['model']}"
        head = (f"{self.method} on {self.chip} (mesh {mesh}, batch {self.batch}, prompt bucket {self.prompt_bucket}, "
                f"cache {self.cache_len}" + (f", budget {self.budget}" if self.budget else "") + f", {self.dtype})")
        secs = ", ".join(f"{k} {v:.1f} s" for k, v in self.seconds.items())
        lines = [head, f"  {secs}"]
        if self.kernel_calls:
            lines.append("  kernel calls: " + ", ".join(f"{k} {v}" for k, v in self.kernel_calls.items() if v))
        if self.memory is not None:
            m = self.memory
            lines.append(f"  per device: arguments {m['argument'] / GIB:.2f} GiB, outputs {m['output'] / GIB:.2f}, "
                         f"temporaries {m['temp'] / GIB:.2f}, code {m['generated_code'] / GIB:.3f} -> "
                         f"{self.needed / GIB:.2f} of {self.memory_limit / GIB:.1f} GiB")
        if self.fits:
            lines.append("  fits")
        else:
            lines.append(f"  does not fit: {self.error}" + (f"; {self.hint}" if self.hint else ""))
        return "\n".join(lines)


def _one_line(e: BaseException) -> str:
    text = " ".join(line.strip() for line in str(e).strip().splitlines()[:2] if line.strip())
    return (text or type(e).__name__)[:400]


def _hint(message: str, platform: str) -> str | None:
    low = message.lower()
    if "vmem" in low or "shared memory" in low or "smem" in low:
        return ("a kernel's tiles exceed the chip's on-chip memory: smaller block sizes "
                "(pallas_kernels.tree_attention.BLOCK_SIZES) or a smaller budget")
    if "hbm" in low or "memory" in low:
        more = "a slice with more chips" if platform == "tpu" else "more GPUs"
        return f"lower batch, cache_len (prompt bucket + max_new_tokens) or budget, or use {more} on the model axis"
    return None


def _abstract(model, dtype) -> api.Model | None:
    """A ``Model`` with abstract params: from a path (its config alone, no weights read) or an ``api.Model``
    (its params' shapes)."""
    if model is None:
        return None
    if isinstance(model, api.Model):
        return dataclasses.replace(model, params=jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                                                              model.params))
    from dtree_jax import convert

    kind, cfg, params = convert.abstract_model(model, dtype)
    return api.Model(kind, cfg, params, str(model))


def _mesh(chip: chips.Chip, mesh) -> jax.sharding.Mesh:
    if mesh is None:
        return chips.mesh(chip)
    sizes = sharding.parse_mesh(mesh) if isinstance(mesh, str) else dict(mesh)
    if not set(sizes) <= set(sharding.MESH_AXES):
        raise ValueError(f"mesh axes must be named from {sharding.MESH_AXES}, got {sorted(sizes)}")
    return chips.mesh(chip, sizes.get(sharding.DATA, 1), sizes.get(sharding.MODEL, 1))


def compile_for(
    target,
    drafter=None,
    method: str = "dominotree",
    chip: str | chips.Chip = "v5e-4",
    *,
    batch: int = 1,
    prompt_bucket: int = 16,
    cache_len: int | None = None,
    mesh: Any = None,
    attention_impl: str = "pallas",
    dtype: Any = None,
    **knobs,
) -> CompileReport:
    """Compiles ``method``'s whole generation for ``chip`` on this host and reports its seconds, kernel calls and
    memory per device.  ``target`` / ``drafter``: ``api.Model``s (only their shapes are used) or paths (a
    ``config.json``, a model directory or a GGUF file: the config alone is read).  ``mesh``: ``"data=2,model=2"`` or
    a dict over the chip's devices (default: every device on ``model``).  ``knobs`` go to ``api.make_spec``
    (budget, node_topk, corr_topm, max_depth, max_new_tokens, stop_ids, top_k, top_p; defaults as
    ``api.trace_generation``'s).  User errors (unknown chip, a mesh larger than the chip, a config that is no
    supported model, knobs out of range) raise ValueError; the compiler's refusal (HBM, VMEM) is the report's
    ``error``, with ``hint`` naming the knob to lower."""
    chip = chips.get(chip)
    target, drafter = _abstract(target, dtype), _abstract(drafter, dtype)
    if target.is_drafter:
        raise ValueError(f"{target.path or 'the target'} is a DFlash/Domino drafter, not a target model")
    if not builders.get_method(method).drafts:
        drafter = None
    target, drafter = (api.with_kernels(m, attention_impl, chip.platform) for m in (target, drafter))
    mesh = _mesh(chip, mesh)
    spec, args = api.abstract_generation(target, drafter, method, batch=batch, prompt_bucket=prompt_bucket,
                                         mesh=mesh, cache_len=cache_len, **knobs)
    report = CompileReport(
        chip=chip.name, platform=chip.platform, mesh={k: int(v) for k, v in mesh.shape.items()}, method=method,
        batch=batch, prompt_bucket=prompt_bucket, cache_len=spec.cache_len,
        budget=spec.budget if spec.record.tree else None, target=target.path or target.kind,
        drafter=None if drafter is None else (drafter.path or drafter.kind),
        dtype=jax.tree.leaves(args[0])[0].dtype.name, memory_limit=chip.memory_bytes,
    )
    with jax.set_mesh(mesh):
        t0 = time.perf_counter()
        traced = loop.generate_on_device.trace(spec, *args)
        t1 = time.perf_counter()
        lowered = traced.lower()
        t2 = time.perf_counter()
        report.seconds.update(trace=t1 - t0, lower=t2 - t1)
        report.kernel_calls = {k: v for k, v in lowered_kernel_calls(lowered.as_text()).items() if v}
        try:
            compiled = lowered.compile()
        except jax.errors.JaxRuntimeError as e:
            report.seconds["compile"] = time.perf_counter() - t2
            report.error = _one_line(e)
            report.hint = _hint(report.error, chip.platform)
            return report
        report.seconds["compile"] = time.perf_counter() - t2
    mem = compiled.memory_analysis()
    report.memory = {f: int(getattr(mem, f"{f}_size_in_bytes")) for f in MEMORY_FIELDS}
    if report.needed > chip.memory_bytes:
        report.error = (f"needs {report.needed / GIB:.2f} GiB of memory per device, {chip.name} has "
                        f"{chip.memory_bytes / GIB:.1f} GiB")
        report.hint = _hint("memory", chip.platform)
    return report


# ----------------------------------------------------------------------------------------------------------
# One kernel configuration for one chip


# Attention shapes per head size (query heads, kv heads): Llama-3 / Qwen3-8B style at 64 and 128, the hybrid
# Qwen3.6-27B's full-attention layers at 256.  The tree-GDN kernel at Qwen3.6-27B's linear-attention shape.
ATTENTION_HEADS = {64: (32, 8), 128: (32, 8), 256: (24, 4)}
GDN_SHAPE = dict(key_heads=16, value_heads=48, key_dim=128, value_dim=128)
# The custom-call targets the kernels lower to, by kernel kind.
CUSTOM_CALLS = {"mosaic": "tpu_custom_call", "triton": "__gpu$xla.gpu.triton"}


def lowered_kernel_calls(text: str) -> dict[str, int]:
    """Kernel calls executed by a lowered StableHLO module (``Lowered.as_text()``), per kind ("mosaic",
    "triton"; "mosaic_gpu" if any kernel fell to that backend).  A jitted callee is emitted once and called
    from several places, so calls are summed over the ``call`` graph from ``main``."""
    funcs = dict(re.findall(r"func\.func (?:public |private )?@([\w$.-]+)\((.*?)(?=\n  func\.func |\Z)", text, re.S))
    patterns = {kind: re.escape(t) + r"\b" for kind, t in CUSTOM_CALLS.items()}
    patterns["mosaic_gpu"] = r"mosaic_gpu\w*"  # "mosaic_gpu_v2" in jax 0.10
    memo: dict[str, dict[str, int]] = {}

    def calls(name: str) -> dict[str, int]:
        if name not in memo:
            body = funcs.get(name, "")
            got = {kind: len(re.findall(r"custom_call @" + pat, body)) for kind, pat in patterns.items()}
            for callee in re.findall(r"\bcall @([\w$.-]+)\(", body):
                for kind, n in calls(callee).items():
                    got[kind] += n
            memo[name] = got
        return memo[name]

    return calls("main")


# op -> the chips' platforms that have a compiled kernel for it (``models.kernels.KERNELS``; GPU tree-GDN: XLA)
KERNEL_PLATFORMS = {op: tuple(p for p, c in by.items() if c in CUSTOM_CALLS) for op, by in kernels.KERNELS.items()}


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """One kernel call's static shape: ``nodes`` tree nodes (budget + 1) per request over ``context`` cache rows
    (attention) for ``batch`` requests, at ``head_dim`` (attention) in ``dtype``."""

    kernel: str  # "tree_attention" | "tree_gdn"
    dtype: str
    nodes: int
    batch: int
    head_dim: int = 128
    context: int = 4096

    def abstract_args(self, sharding_: jax.sharding.Sharding) -> tuple:
        import jax.numpy as jnp

        sd = lambda shape, dt=self.dtype: jax.ShapeDtypeStruct(shape, dt, sharding=sharding_)  # noqa: E731
        b, n = self.batch, self.nodes
        if self.kernel == "tree_attention":
            h, hkv = ATTENTION_HEADS[self.head_dim]
            d, s = self.head_dim, self.context
            return (sd((b, n, h, d)), sd((b, s, hkv, d)), sd((b, s, hkv, d)), sd((b,), jnp.int32),
                    sd((b, n, n), jnp.bool_))
        hk, hv, dk, dv = (GDN_SHAPE[k] for k in ("key_heads", "value_heads", "key_dim", "value_dim"))
        return (sd((b, n, hk, dk)), sd((b, n, hk, dk)), sd((b, n, hv, dv)), sd((b, n, hv), jnp.float32),
                sd((b, n, hv), jnp.float32), sd((b, hv, dk, dv), jnp.float32), sd((b, n, n), jnp.bool_))

    def function(self, platform: str, vmem_limit_bytes: int | None = None):
        if self.kernel == "tree_attention":
            from pallas_kernels.tree_attention import tree_attention

            kw = dict(vmem_limit_bytes=vmem_limit_bytes) if platform == "tpu" else {}
            return lambda q, k, v, lens, mask: tree_attention(q, k, v, lens, mask, scale=self.head_dim**-0.5,
                                                               backend=platform, **kw)
        from pallas_kernels.tree_gdn import tree_gdn

        return lambda *args: tree_gdn(*args, vmem_limit_bytes=vmem_limit_bytes)


# The kernel configurations we claim (README): each compiles for every chip of experiments/compile_kernels.py,
# and for v5e and the H200 in tests/test_chips.py.
KERNEL_MATRIX = dict(head_dims=(64, 128, 256), dtypes=("bfloat16", "float32"), contexts=(4096, 32768),
                     budgets=(4, 16, 64, 128), batches=(1, 8))


def kernel_configs(platform: str) -> list[KernelConfig]:
    """``KERNEL_MATRIX`` for the kernels ``platform`` has ("tpu" | "gpu"): tree attention at every head size,
    dtype, context, budget (nodes = budget + 1) and batch; the tree-GDN kernel (no context) at every dtype, budget
    and batch."""
    m = KERNEL_MATRIX
    out = []
    for kernel, platforms in KERNEL_PLATFORMS.items():
        if platform not in platforms:
            continue
        heads, contexts = (m["head_dims"], m["contexts"]) if kernel == "tree_attention" else ((128,), (0,))
        out += [KernelConfig(kernel, dtype, budget + 1, batch, d, context)
                for d in heads for dtype in m["dtypes"] for budget in m["budgets"] for context in contexts
                for batch in m["batches"]]
    return out


_ONCHIP = {  # the compilers' words for an on-chip allocation over its limit, and the size they name
    "tpu": re.compile(r"Scoped allocation with size ([\d.]+)([KMG]?)"),
    "gpu": re.compile(r"Shared memory size limit exceeded: requested (\d+)"),
}
_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}


def compile_kernel(config: KernelConfig, chip: str | chips.Chip, measure: bool = True) -> dict:
    """Compiles one kernel configuration for one device of ``chip`` with the compiler's own limits:
    ``{"compiles", "seconds", "error"}``; with ``measure`` also the on-chip memory it allocates
    (``onchip_bytes``), read from the compiler's refusals under lowered limits.  GPU: the shared memory per block
    the Triton kernel requests (exact: one compile at a 1 KiB limit).  TPU: the scoped VMEM the Mosaic kernel
    needs, found by raising ``vmem_limit_bytes`` to each refusal's cumulative size until it compiles (to the
    compiler's printed 0.1 KiB)."""
    chip = chips.get(chip)
    if chip.platform not in KERNEL_PLATFORMS[config.kernel]:
        raise ValueError(f"{config.kernel} has no {chip.platform} kernel")

    def attempt(vmem_limit=None, shared_limit=None):
        options = {} if shared_limit is None else dict(shared_memory_limit=shared_limit)
        rep = jax.sharding.NamedSharding(chips.mesh(chip, 1, 1, **options), jax.sharding.PartitionSpec())
        t0 = time.perf_counter()
        try:
            jax.jit(config.function(chip.platform, vmem_limit)).lower(*config.abstract_args(rep)).compile()
            return None, time.perf_counter() - t0
        except jax.errors.JaxRuntimeError as e:
            return str(e), time.perf_counter() - t0

    error, seconds = attempt()
    row = dict(compiles=error is None, seconds=round(seconds, 2), error=None if error is None else _one_line(error))
    if not measure or error is not None:
        return row
    if chip.platform == "gpu":
        m = _ONCHIP["gpu"].search(attempt(shared_limit=1024)[0] or "")
        row["onchip_bytes"] = int(m.group(1)) if m else None
        return row
    limit = 1024
    for _ in range(16):
        refusal, _ = attempt(vmem_limit=limit)
        if refusal is None:
            row["onchip_bytes"] = limit
            break
        m = _ONCHIP["tpu"].search(refusal)
        if not m:
            break
        limit = max(limit + 1024, int(float(m.group(1)) * _UNITS[m.group(2)]) + 103)  # + the 0.1K rounding
    else:
        row["onchip_bytes"] = None
    return row


def compile_kernels(configs: list[KernelConfig], chip: str | chips.Chip) -> list[dict]:
    """``compile_kernel(config, chip, measure=False)`` for many configurations at once: one program holding
    every call (one XLA compile; each kernel still goes through the chip's kernel compiler), and only when that
    is refused, each configuration on its own to tell which.  Rows in ``configs`` order."""
    chip = chips.get(chip)
    rep = jax.sharding.NamedSharding(chips.mesh(chip, 1, 1), jax.sharding.PartitionSpec())
    fns = [c.function(chip.platform) for c in configs]
    args = [c.abstract_args(rep) for c in configs]
    t0 = time.perf_counter()
    try:
        jax.jit(lambda all_args: [f(*a) for f, a in zip(fns, all_args)]).lower(args).compile()
    except jax.errors.JaxRuntimeError:
        return [compile_kernel(c, chip, measure=False) for c in configs]
    seconds = round((time.perf_counter() - t0) / max(1, len(configs)), 2)
    return [dict(compiles=True, seconds=seconds, error=None) for _ in configs]


# ----------------------------------------------------------------------------------------------------------
# CLI


def _run_cli(args) -> int:
    import json
    import os
    import sys

    chips.allow_compile_only()
    if not os.environ.get("JAX_PLATFORMS"):  # this process only compiles: no accelerator probing
        jax.config.update("jax_platforms", "cpu")
    method = args.method or ("dominotree" if args.drafter else "ar")
    chip = chips.get(args.chip)
    knobs = {k: v for k, v in dict(budget=args.budget, node_topk=args.node_topk, corr_topm=args.corr_topm,
                                   max_new_tokens=args.max_new_tokens).items() if v is not None}
    print(f"compiling {method} for {chip.description} ...", file=sys.stderr, flush=True)
    report = compile_for(args.target, args.drafter, method, chip, batch=args.batch, prompt_bucket=args.prompt_bucket,
                         cache_len=args.cache_len, mesh=args.mesh, attention_impl=args.attention_impl,
                         dtype=args.dtype, **knobs)
    print(json.dumps(report.to_dict()) if args.json else report.summary())
    return 0 if report.fits else 1


def add_cli(sub) -> None:
    p = sub.add_parser(
        "compile", help="compile a whole generation for a TPU slice or GPU from this machine (no chip needed)",
        description="Compiles prefill + the decoding loop with the chip's Pallas kernels for a named chip on this "
                    "host, from the models' configs alone (no weights read), and reports the compile time, kernel "
                    "calls and memory per device.  Exit 0 when it fits the chip, 1 when it does not (one line says "
                    "why and which knob to lower), 2 on bad input.  Needs pip install 'dtree-jax[chips]'.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--chip", required=True, help=f"what to compile for, e.g. {', '.join(chips.examples())}")
    p.add_argument("--target", required=True,
                   help="target: a config.json file, an HF or converted model directory, or a GGUF file")
    p.add_argument("--drafter", help="DFlash/Domino drafter: a config.json file or a model directory")
    p.add_argument("--method", choices=tuple(builders.REGISTRY), default=None,
                   help="decoding method (default: dominotree with a drafter, else ar)")
    p.add_argument("--batch", type=int, default=1, help="requests per generation")
    p.add_argument("--prompt-bucket", type=int, default=512, help="prompt length the program is compiled for")
    p.add_argument("--max-new-tokens", type=int, default=2048, help="tokens per request")
    p.add_argument("--cache-len", type=int, default=None,
                   help="KV cache rows per request (default: prompt bucket + max new tokens + one round)")
    p.add_argument("--budget", type=int, default=32, help="non-root tree nodes (tree methods)")
    p.add_argument("--node-topk", type=int, default=8, help="children per tree node (k)")
    p.add_argument("--corr-topm", type=int, default=None, help="Domino candidate width M (default: the method's)")
    p.add_argument("--mesh", default=None, help="e.g. data=2,model=2 (default: every device on the model axis)")
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default=None,
                   help="params and activations (default: the config's, float32 when it names none)")
    p.add_argument("--attention-impl", choices=ATTENTION_IMPLS, default="pallas",
                   help="the chip's Pallas kernels, or the XLA path")
    p.add_argument("--json", action="store_true", help="the report as one JSON object")
    p.set_defaults(func=_run_cli)
