"""A few-row fp32 dot for XLA:CPU: ``x [..., K] @ w [K, N]`` with ``w`` (fp32 or bf16) packed into 64-column panels
of its own dtype (``PackedWeight``), run by ``cpu_dot.cc`` through XLA's FFI (bf16 widened to fp32 as it is read:
exact, so both give the same sums at half the bytes for bf16).

XLA:CPU's dots (YNNPACK, with the weights baked in) cost 1.4x one row at 5 rows and 1.9x at 9 on our Intel hosts,
so a 5-node verify cost 1.3-1.4x an ``ar`` step there.  This kernel reads each weight panel from memory once for
up to 12 rows of a call and sums every output element in the same order whatever the number of rows, so a row's
result never depends on the others: a tree verify computes, bit for bit, what one-row ``ar`` steps compute.

It is built on first use with the host's C++ compiler (``$CXX``, else ``c++`` or ``g++``) for this CPU
(``-march=native``, AVX-512F or AVX2 with FMA) into the cache (``$DTREE_JAX_CACHE/cpu-dot``, keyed by the source,
the compiler, jax's version and the CPU).  Where it cannot be built, or with ``DTREE_JAX_CPU_DOT=0``,
``available()`` is False (``status()`` says why) and programs keep XLA's dots; ``DTREE_JAX_CPU_DOT=avx2`` builds
the AVX2 variant on a CPU with AVX-512 (to measure what hosts without AVX-512 run).  ``cpu_options`` packs the dense
weights of CPU programs that bake their weights in; programs for accelerators never see it.

The same library holds ``cpu_attention.cc``: ``tree_attention``, the XLA path's tree attention as one call a layer
over an fp32 or bf16 cache (about ten XLA ops and two transposed copies of the cache otherwise), which those
programs run too
(``models.kernels.cpu_attention``; ``DTREE_JAX_CPU_ATTENTION=0`` keeps XLA's), and ``cpu_ops.cc``: ``fusion_barrier``
(RoPE's tables computed once, not in every layer's fusion) and ``first_argmax`` (greedy acceptance's argmax).
"""

from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

PANEL = 64  # columns per panel; cpu_dot.cc's kPanel
FFI_TARGETS = {"float32": ("dtree_jax_cpu_fewrow_dot", "DtreeJaxFewRowDot"),  # panels' dtype -> (target, symbol)
               "bfloat16": ("dtree_jax_cpu_fewrow_dot_bf16", "DtreeJaxFewRowDotBf16")}
SOURCE = Path(__file__).with_name("cpu_dot.cc")
ATTENTION_SOURCE = Path(__file__).with_name("cpu_attention.cc")  # built into the same library
ATTENTION_TARGETS = {"float32": ("dtree_jax_cpu_tree_attention", "DtreeJaxTreeAttention"),  # cache dtype ->
                     "bfloat16": ("dtree_jax_cpu_tree_attention_bf16", "DtreeJaxTreeAttentionBf16")}  # (target, symbol)
OPS_SOURCE = Path(__file__).with_name("cpu_ops.cc")  # built into the same library: two small ops
OPS_TARGETS = {"copy": ("dtree_jax_cpu_copy", "DtreeJaxCopy"),  # op -> (target, symbol)
               "first_argmax": ("dtree_jax_cpu_first_argmax", "DtreeJaxFirstArgmax")}
SOURCES = (SOURCE, ATTENTION_SOURCE, OPS_SOURCE)  # the library this process builds
HEADER = Path(__file__).with_name("cpu_threads.h")  # included by both (the thread pool's work sharing)
DISABLE_ENV = "DTREE_JAX_CPU_DOT"  # "0": never use the kernel; "avx2": build it without AVX-512
NATIVE_FLAGS, AVX2_FLAGS = ("-march=native",), ("-march=native", "-mno-avx512f")


@dataclasses.dataclass(frozen=True)
class PackedWeight:
    """A weight ``[K, N]`` (fp32 or bf16) as panels ``[ceil(N / 64), K, 64]`` of its own dtype (zero columns past
    N); ``x @ packed`` runs the kernel and gives what ``x @ w`` would: fp32 sums (a bf16 weight widened to fp32,
    exact), in ``x @ w``'s dtype (Python falls back to ``__rmatmul__`` because JAX arrays decline unknown
    operands)."""

    panels: jax.Array  # [P, K, 64] fp32 or bf16
    cols: int  # N

    @property
    def shape(self) -> tuple[int, int]:
        return (self.panels.shape[1], self.cols)

    @property
    def dtype(self):
        return self.panels.dtype

    def __rmatmul__(self, x: jax.Array) -> jax.Array:  # [..., K] -> [..., N] in x @ w's dtype
        return fewrow_dot(x, self).astype(jnp.result_type(x.dtype, self.dtype))


jax.tree_util.register_dataclass(PackedWeight, data_fields=["panels"], meta_fields=["cols"])


def _pair_halves(rows: jax.Array, inverse: bool = False) -> jax.Array:  # [..., 64] bf16 -> [..., 64]
    """bf16 panels store each 32-column chunk as pairs (column i, column 16 + i) (``cpu_dot.cc``'s
    ``load_weights``): natural order -> pairs, or back with ``inverse``."""
    lead = rows.shape[:-1]
    split = (2, 16, 2) if inverse else (2, 2, 16)
    return rows.reshape(*lead, *split).swapaxes(-1, -2).reshape(*lead, PANEL)


def pack(w: jax.Array) -> PackedWeight:  # [K, N] fp32 or bf16 -> panels [P, K, 64] of the same dtype
    k, n = w.shape
    if jnp.dtype(w.dtype).name not in FFI_TARGETS:
        raise ValueError(f"cpu_dot packs fp32 or bf16 weights, got {w.dtype}")
    p = -(-n // PANEL)
    panels = jnp.pad(jnp.asarray(w), ((0, 0), (0, p * PANEL - n))).reshape(k, p, PANEL).transpose(1, 0, 2)
    return PackedWeight(_pair_halves(panels) if panels.dtype == jnp.bfloat16 else panels, n)


def unpack(w: PackedWeight) -> jax.Array:  # -> [K, N] in the weight's dtype
    p, k, _ = w.panels.shape
    panels = _pair_halves(w.panels, inverse=True) if w.dtype == jnp.bfloat16 else w.panels
    return panels.transpose(1, 0, 2).reshape(k, p * PANEL)[:, : w.cols]


def fewrow_dot(x: jax.Array, w: PackedWeight, targets: dict[str, str] | None = None) -> jax.Array:
    """``x [..., K] @ w`` -> ``[..., N]`` fp32 by the kernel (``available()`` must be True where the program is
    compiled and run); ``targets`` {panel dtype: FFI target}: another build's handlers (``register_build``)."""
    k = w.shape[0]
    if x.shape[-1] != k:
        raise ValueError(f"cpu_dot: x {x.shape} against a [{k}, {w.cols}] weight")
    out = jax.ShapeDtypeStruct(x.shape[:-1] + (w.cols,), jnp.float32)
    target = targets[w.dtype.name] if targets else FFI_TARGETS[w.dtype.name][0]
    return jax.ffi.ffi_call(target, out)(x.astype(jnp.float32), w.panels)


def tree_attention(
    q: jax.Array,  # [B, T, H, D] queries, RoPE applied (read as fp32)
    k: jax.Array,  # [B, S, Hkv, D] fp32 or bf16 key cache (new tokens written at [lens, lens + T))
    v: jax.Array,  # [B, S, Hkv, D] value cache, k's dtype
    lens: jax.Array,  # [B] int32 committed length before the T new tokens
    local_mask: jax.Array,  # [B, T, T] bool visibility among the new tokens
    scale: float,
) -> jax.Array:  # [B, T, H, D] fp32
    """``pallas_kernels.tree_attention.reference_tree_attention`` (no ``window``) as one call of
    ``cpu_attention.cc`` (``available()`` must be True where the program is compiled and run), in fp32: a bf16
    cache is widened as it is read (exact) and its probabilities rounded to bf16 as the reference's bf16 matmul
    takes them.  A query's output depends on its visible rows alone, in cache order.  ``attends(q, k)`` says
    which shapes and dtypes it takes."""
    if not attends(q, k) or v.shape != k.shape or v.dtype != k.dtype:
        raise ValueError(f"cpu_attention: q {q.shape} {q.dtype} / k {k.shape} {k.dtype} / v {v.shape} {v.dtype} "
                         "it cannot take")
    out = jax.ShapeDtypeStruct(q.shape, jnp.float32)
    return jax.ffi.ffi_call(ATTENTION_TARGETS[k.dtype.name][0], out)(
        q.astype(jnp.float32), k, v, jnp.asarray(lens, jnp.int32), jnp.asarray(local_mask, bool),
        scale=np.float32(scale))


def attends(q: jax.Array, k: jax.Array) -> bool:
    """Whether ``tree_attention`` takes queries ``q [B, T, H, D]`` against a cache ``k [B, S, Hkv, D]``: q fp32
    or bf16, the cache fp32 or bf16, ``H / Hkv`` whole and at most 16, ``D`` a multiple of 8."""
    (b, _, h, d), (bk, _, hkv, dk) = q.shape, k.shape
    return (q.dtype in (jnp.float32, jnp.bfloat16) and jnp.dtype(k.dtype).name in ATTENTION_TARGETS and b == bk
            and d == dk and d % 8 == 0 and hkv > 0 and h % hkv == 0 and h // hkv <= 16)


def fusion_barrier(x: jax.Array) -> jax.Array:  # any -> the same values, computed once
    """``x`` as it is, through ``cpu_ops.cc``'s copy (``available()`` must be True where the program is compiled
    and run): XLA cannot fuse through a custom call, so ``x``'s producers run once instead of inside each of its
    users' fusions (XLA:CPU keeps no optimization barrier up to fusion)."""
    return jax.ffi.ffi_call(OPS_TARGETS["copy"][0], jax.ShapeDtypeStruct(x.shape, x.dtype),
                            vmap_method="broadcast_all")(x)


def first_argmax(x: jax.Array) -> jax.Array:  # [..., V] fp32 -> [...] int32
    """``jnp.argmax(x, -1)`` (the first index of the largest value, or of the first NaN) by ``cpu_ops.cc``
    (``available()`` must be True where the program is compiled and run)."""
    if x.dtype != jnp.float32 or x.ndim == 0 or x.shape[-1] == 0:
        raise ValueError(f"cpu_dot.first_argmax: x [..., V] fp32 with V > 0, got {x.shape} {x.dtype}")
    return jax.ffi.ffi_call(OPS_TARGETS["first_argmax"][0], jax.ShapeDtypeStruct(x.shape[:-1], jnp.int32),
                            vmap_method="broadcast_all")(x)


def reference_first_argmax(x: jax.Array) -> jax.Array:  # [..., V] -> [...] int32
    """Pure-jnp ``first_argmax``."""
    return jnp.argmax(x, axis=-1).astype(jnp.int32)


def reference_fewrow_dot(x: jax.Array, w: PackedWeight) -> jax.Array:  # [..., K] -> [..., N] fp32
    """Pure-jnp ``fewrow_dot`` (the same product, XLA's summation order)."""
    return jnp.matmul(x.astype(jnp.float32), unpack(w).astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)


def matmul_fp32(x: jax.Array, w) -> jax.Array:  # [..., K] @ [K, N] -> [..., N] fp32
    """``x @ w`` with fp32 results: the kernel for a ``PackedWeight``, else a dot accumulating in fp32."""
    if isinstance(w, PackedWeight):
        return fewrow_dot(x, w)
    return jnp.einsum("...k,kn->...n", x, w, preferred_element_type=jnp.float32)


# ----------------------------------------------------------------------------------------------------------
# Building and registering the kernel
# ----------------------------------------------------------------------------------------------------------

_lock = threading.Lock()
_state: dict[str, object] = {}  # "status": str, "ok": bool (once decided in this process)


def _cache_dir() -> Path:
    from dtree_jax.convert import cache_dir

    return cache_dir() / "cpu-dot"


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "c++", "g++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _cpu_fingerprint() -> str:
    try:
        info = Path("/proc/cpuinfo").read_text(errors="replace").split("\n\n")[0]
    except OSError:
        info = ""
    keep = [line for line in info.splitlines() if line.split(":")[0].strip() in ("model name", "flags")]
    return "\n".join(keep) or platform.processor() or platform.machine()


def _build(compiler: str, arch: tuple[str, ...] = NATIVE_FLAGS, sources: tuple[Path, ...] = SOURCES) -> Path:
    """The shared library for ``sources``, compiler, ``arch`` flags, jax and CPU: from the cache, else compiled
    into it."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    parts = [*(source.read_bytes() for source in (*sources, HEADER)), version.encode(), " ".join(arch).encode(),
             jax.__version__.encode(), _cpu_fingerprint().encode()]
    key = hashlib.sha256(b"\0".join(parts)).hexdigest()[:24]
    lib = _cache_dir() / f"cpu_dot-{key}.so"
    if lib.exists():
        return lib
    lib.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=lib.parent) as tmp:
        built = Path(tmp) / lib.name
        cmd = [compiler, "-O3", *arch, "-std=c++17", "-shared", "-fPIC", "-w",
               f"-I{jax.ffi.include_dir()}", f"-I{HEADER.parent}", *map(str, sources), "-o", str(built)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["no output"])[-1]
            raise RuntimeError(f"{Path(compiler).name} failed: {last}")
        os.replace(built, lib)  # atomic: a concurrent process sees the old state or the whole library
    return lib


def _register(library: ctypes.CDLL, suffix: str = "") -> dict[str, str]:
    """Registers ``library``'s handlers (all found before any is registered) as the FFI targets
    ``<target><suffix>``; returns {panel dtype: target}."""
    handlers = {dtype: getattr(library, symbol) for dtype, (_, symbol) in FFI_TARGETS.items()}
    targets = {dtype: FFI_TARGETS[dtype][0] + suffix for dtype in handlers}
    for dtype, handler in handlers.items():
        jax.ffi.register_ffi_target(targets[dtype], jax.ffi.pycapsule(handler), platform="cpu")
    return targets


def _load() -> tuple[bool, str]:
    choice = os.environ.get(DISABLE_ENV, "1")
    if choice == "0":
        return False, f"XLA's dots ({DISABLE_ENV}=0)"
    if platform.machine() not in ("x86_64", "AMD64"):
        return False, f"XLA's dots (the kernel is x86-64 only; this is {platform.machine()})"
    compiler = _compiler()
    if compiler is None:
        return False, "XLA's dots (no C++ compiler found to build the few-row kernel; set CXX)"
    arch = AVX2_FLAGS if choice == "avx2" else NATIVE_FLAGS

    def register(lib: Path) -> None:
        library = ctypes.cdll.LoadLibrary(str(lib))
        others = {target: getattr(library, symbol)  # all found before any is registered
                  for target, symbol in (*ATTENTION_TARGETS.values(), *OPS_TARGETS.values())}
        _register(library)
        for target, handler in others.items():
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(handler), platform="cpu")

    try:
        lib = _build(compiler, arch)
        try:
            register(lib)
        except (OSError, AttributeError):  # a cached library that does not load (truncated, foreign): rebuilt once
            lib.unlink(missing_ok=True)
            lib = _build(compiler, arch)
            register(lib)
    except (OSError, AttributeError, RuntimeError, subprocess.SubprocessError) as err:
        return False, f"XLA's dots (the few-row kernel did not build here: {err})"
    return True, f"the few-row kernel ({lib.name}{', AVX2' if choice == 'avx2' else ''})"


def register_build(suffix: str, source: Path = SOURCE, arch: tuple[str, ...] = NATIVE_FLAGS) -> dict[str, str]:
    """Builds ``source`` (a version of ``cpu_dot.cc``) with ``arch`` flags and registers its handlers as the FFI
    targets ``<target><suffix>``, beside this process's build (to test the AVX2 variant, or time two versions in
    one process); returns {panel dtype: target} for ``fewrow_dot(targets=)``."""
    compiler = _compiler()
    if compiler is None:
        raise RuntimeError("no C++ compiler found to build the few-row kernel; set CXX")
    return _register(ctypes.cdll.LoadLibrary(str(_build(compiler, arch, (source,)))), suffix)


def available() -> bool:
    """Whether the kernel is built and registered in this process (built on the first call; cached after)."""
    with _lock:
        if "ok" not in _state:
            _state["ok"], _state["status"] = _load()
        return bool(_state["ok"])


def status() -> str:
    """One phrase: which dots the CPU programs that bake their weights in use, and why."""
    available()
    return str(_state["status"])
