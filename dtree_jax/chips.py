"""Chips to compile for from any machine: compile-only TPU slices (libtpu) and deviceless GPUs (the CUDA plugin
given a target config), named as users know them.

    chip = chips.get("v5e-4")          # a 2x2 slice of TPU v5e: 4 chips, 16 GiB of HBM each
    mesh = chips.mesh(chip, data=1, model=4)   # a (data, model) mesh over its compile-only devices

Nothing can be placed on these devices: a program for them is traced from abstract values
(``jax.ShapeDtypeStruct`` with shardings) and compiled, which runs the chip's real compilers (XLA:TPU + Mosaic, or
XLA:GPU + Triton + ptxas) on this host, with their tiling, VMEM / shared-memory and (TPU) HBM checks.
``api.compile_for`` compiles a whole generation this way.

Names: TPU ``v5e-N`` / ``v6e-N`` (N chips: 1, 4, 8, 16, ..., 256), ``v4-N`` / ``v5p-N`` (N TensorCores, two per chip,
as Cloud TPU names them: ``v5p-8`` is 4 chips in a 2x2x1 slice, each chip one megacore device); GPU ``h100`` /
``h200`` and ``h100-N`` / ``h200-N`` (N GPUs on one host).  The GPU figures are the spec files in
``chip_specs/`` (written from NVIDIA's public figures; each cites its sources).

Needs the compilers: ``pip install "dtree-jax[chips]"`` (libtpu, and the CUDA plugin with ptxas).  The CUDA
plugin checks for CUDA libraries when JAX starts its backends and drops out on a host without them: call
``allow_compile_only()`` (or set ``JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1``) before JAX's first device query to keep
it; ``dtree-jax compile`` does.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
from pathlib import Path

import jax

GIB = 2**30
SPEC_DIR = Path(__file__).parent / "chip_specs"

# TPU generation -> (topology prefix, HBM bytes per chip (Cloud TPU's published figures), TensorCores the
# name counts per chip, torus dimensions).  v4 / v5p chips are one megacore device each.
TPU_GENERATIONS = {
    "v4": ("v4", 32 * GIB, 2, 3),
    "v5e": ("v5e", 16 * GIB, 1, 2),
    "v5p": ("v5p", 95 * GIB, 2, 3),
    "v6e": ("v6e", 32 * GIB, 1, 2),
}
SLICES_2D = {1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16", 256: "16x16"}
SLICES_3D = {4: "2x2x1", 8: "2x2x2", 16: "2x2x4", 32: "2x4x4", 64: "4x4x4"}
GPUS = {"h100": "h100.txtpb", "h200": "h200.txtpb"}  # name -> spec file in SPEC_DIR
MAX_GPUS = 8  # GPUs on one host


@dataclasses.dataclass(frozen=True)
class Chip:
    """A compile target: ``platform`` is the kernel platform ("tpu" | "gpu"; "cpu" for an attached CPU, whose
    kernels run in interpret mode), ``num_devices`` the chips or GPUs a program spans, ``memory_bytes`` the HBM
    of each."""

    name: str
    platform: str
    num_devices: int
    memory_bytes: int
    topology: str  # get_topology_desc's name: "v5e:2x2", or "1x1xN" (partitions x hosts x GPUs) for GPUs
    spec_file: str | None = None  # GPUs: the target config in SPEC_DIR

    @property
    def description(self) -> str:
        what = "TPU slice" if self.platform == "tpu" else "GPU" + ("s" if self.num_devices > 1 else "")
        return (f"{self.name}: {self.num_devices} x {self.device_kind} ({what} {self.topology}), "
                f"{self.memory_bytes / GIB:.1f} GiB each")

    @property
    def device_kind(self) -> str:
        if self.topology == "attached":
            return jax.devices()[0].device_kind
        if self.platform == "gpu":
            return self.name.split("-")[0].upper()
        return "TPU " + self.name.split("-")[0]


def examples() -> list[str]:
    """Chip names to show in help texts and errors."""
    return ["v4-8", "v5e-1", "v5e-4", "v5e-8", "v5p-8", "v6e-1", "v6e-4", "v6e-8", "h100", "h200", "h200-8"]


def attached() -> Chip:
    """This process's own devices as a chip ("attached"): its platform's kernels (the TPU kernels in interpret
    mode on a CPU), its device count, and its first device's memory (the allocator's limit on accelerators,
    physical memory on a CPU)."""
    found = jax.devices()
    platform = found[0].platform if found[0].platform in ("tpu", "gpu") else "cpu"
    memory = (found[0].memory_stats() or {}).get("bytes_limit") or os.sysconf("SC_PAGE_SIZE") * os.sysconf(
        "SC_PHYS_PAGES")
    return Chip("attached", platform, len(found), int(memory), "attached")


def get(name: str) -> Chip:
    """The chip called ``name`` (see the module docstring; "attached": this process's devices); ValueError
    naming the accepted forms otherwise."""
    if isinstance(name, Chip):
        return name
    text = str(name).strip().lower()
    if text == "attached":
        return attached()
    m = re.fullmatch(r"(v4|v5e|v5p|v6e)-(\d+)", text)
    if m:
        gen, count = m.group(1), int(m.group(2))
        prefix, hbm, cores, dims = TPU_GENERATIONS[gen]
        chips, left = divmod(count, cores)
        shapes = SLICES_3D if dims == 3 else SLICES_2D
        if left or chips not in shapes:
            sizes = ", ".join(f"{gen}-{n * cores}" for n in shapes)
            raise ValueError(f"unknown chip {name!r}: {gen} slices are {sizes}")
        return Chip(text, "tpu", chips, hbm, f"{prefix}:{shapes[chips]}")
    m = re.fullmatch(r"(h100|h200)(?:-(\d+))?", text)
    if m:
        count = int(m.group(2) or 1)
        if not 1 <= count <= MAX_GPUS:
            raise ValueError(f"unknown chip {name!r}: {m.group(1)}-N takes 1 to {MAX_GPUS} GPUs (one host)")
        spec = _gpu_spec(GPUS[m.group(1)])
        memory = int(re.search(r"device_memory_size:\s*(\d+)", spec).group(1))
        return Chip(text, "gpu", count, memory, f"1x1x{count}", GPUS[m.group(1)])
    raise ValueError(f"unknown chip {name!r}; known forms: {', '.join(examples())} (v4/v5p-N count TensorCores, "
                     "v5e/v6e-N chips, h100/h200-N GPUs)")


@functools.cache
def _gpu_spec(file: str) -> str:
    return (SPEC_DIR / file).read_text()


def allow_compile_only() -> None:
    """Sets up this process to compile for chips it does not have: the CUDA plugin registers without a GPU's
    libraries (effective before JAX starts its backends), and libtpu takes no per-process TPU lock."""
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")


@functools.cache
def devices(chip: Chip, shared_memory_limit: int | None = None) -> tuple:
    """The chip's compile-only devices (one per TPU chip or GPU).  ``shared_memory_limit`` (GPUs) replaces the
    spec's opt-in shared memory per block: a kernel over it fails to compile with the bytes it requested, which
    is how ``aot.compile_kernel`` measures them.  ValueError with the install line when this process has no
    compiler for the chip."""
    from jax.experimental import topologies

    if chip.topology == "attached":
        return tuple(jax.devices())
    try:
        allow_compile_only()
        if chip.platform == "tpu":
            kwargs = {}
            if chip.num_devices == 1:
                kwargs["chips_per_host_bounds"] = (1, 1, 1)
            if chip.name.startswith(("v4", "v5p")):
                kwargs["chip_config_name"] = "megacore"
            topology = topologies.get_topology_desc(chip.topology, "tpu", **kwargs)
        else:
            spec = _gpu_spec(chip.spec_file)
            if shared_memory_limit is not None:
                spec = re.sub(r"shared_memory_per_block_optin:\s*\d+", f"shared_memory_per_block_optin: "
                              f"{int(shared_memory_limit)}", spec)
            topology = topologies.get_topology_desc(chip.topology, "cuda", target_config=spec, topology=chip.topology)
    except (RuntimeError, NotImplementedError, ValueError, ImportError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        need = "libtpu" if chip.platform == "tpu" else "the CUDA plugin and ptxas"
        raise ValueError(f"cannot compile for {chip.name} on this machine ({first[:200]}): it needs {need}; "
                         "pip install \"dtree-jax[chips]\" (GPU: and dtree_jax.chips.allow_compile_only() called before "
                         "JAX's first device query)") from e
    found = tuple(topology.devices)
    if len(found) != chip.num_devices:
        raise ValueError(f"{chip.name}: the compiler gave {len(found)} devices for topology {chip.topology}, "
                         f"expected {chip.num_devices}")
    return found


def mesh(chip: Chip, data: int = 1, model: int | None = None, **device_options) -> jax.sharding.Mesh:
    """A ``(data, model)`` mesh over the chip's compile-only devices (``model`` default: every device the data
    axis leaves).  ValueError when it needs more devices than the chip has."""
    from dtree_jax.models import sharding

    if model is None:
        model = max(1, chip.num_devices // data)
    if data * model > chip.num_devices:
        raise ValueError(f"a data={data} x model={model} mesh needs {data * model} devices; {chip.name} has "
                         f"{chip.num_devices}")
    return sharding.make_mesh(data, model, devices=devices(chip, **device_options))
