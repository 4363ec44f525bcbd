"""Decoding over a device mesh: one table of logical axes for every param, cache and decode-state leaf, the rules
that map them onto the mesh axes ``("data", "model")``, and the per-shard form of the Pallas kernels.

Nothing else changes under a mesh.  Params, caches and the decode state are placed (``place``) or constrained
(``constrain``) with the ``NamedSharding`` the table gives them, and XLA's SPMD partitioner splits every
computation accordingly: attention / GDN heads and MLP columns over ``model``, the vocabulary of the embedding
table and the output head over ``model``, the batch over ``data``.  A dimension that an axis does not divide is
replicated over it (KV heads when ``model`` exceeds them, a batch of 1 on ``data = 2``), as serving engines do.
The partitioner cannot split a Pallas call, so the kernels run per shard under ``shard_map``
(``head_plan``): batch over ``data``, heads over ``model``.  Those read the mesh from the tracing context, which
``dtree_jax.api`` sets (``jax.set_mesh``) around every trace of a sharded generation.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from typing import Mapping

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

DATA, MODEL = "data", "model"
MESH_AXES = (DATA, MODEL)

# logical axis -> mesh axis
RULES: dict[str, str] = {
    "batch": DATA,
    "heads": MODEL,  # attention query heads
    "kv_heads": MODEL,  # attention key/value heads (of the projections)
    "cache_kv_heads": MODEL,  # the KV cache's heads (repeated to the model degree by ``for_mesh``)
    "v_heads": MODEL,  # Gated DeltaNet value heads
    "gdn_channels": MODEL,  # the GDN's [q | k | v] conv channels (depthwise, so split anywhere)
    "mlp": MODEL,  # MLP hidden columns (dense and per expert)
    "vocab": MODEL,  # embedding-table rows and output-head columns
    "taps": MODEL,  # the drafter's concatenated target features (its fc's input rows)
}

AXES_KEY = "logical_axes"  # dataclass field metadata: the logical axes of the field's array leaves


def axes(*logical: str | None, **field_kwargs):
    """A dataclass field whose array leaf (or each array of a tuple of them) has these logical axes, one per
    dimension (``None``: replicated; names in ``RULES``), declared next to the field:
    ``wq: jax.Array = axes(None, "heads")``.  ``field_kwargs`` go to ``dataclasses.field`` (a default)."""
    return dataclasses.field(metadata={AXES_KEY: tuple(logical)}, **field_kwargs)


# ----------------------------------------------------------------------------------------------------------
# Meshes
# ----------------------------------------------------------------------------------------------------------


def make_mesh(data: int = 1, model: int = 1, devices=None) -> jax.sharding.Mesh:
    """A ``(data, model)`` mesh over the first ``data * model`` devices (all processes' devices in a
    multi-host run), with automatic (partitioner-propagated) axes."""
    for name, n in ((DATA, data), (MODEL, model)):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"mesh axis {name!r} needs a positive integer size, got {n!r}")
    devices = jax.devices() if devices is None else list(devices)
    if data * model > len(devices):
        visible = f"{len(devices)} {'is' if len(devices) == 1 else 'are'} visible"
        hint = (" (on a CPU, XLA_FLAGS=--xla_force_host_platform_device_count=N gives N host devices)"
                if devices[0].platform == "cpu" else "")
        raise ValueError(f"a data={data} x model={model} mesh needs {data * model} devices; {visible}{hint}")
    auto = (jax.sharding.AxisType.Auto,) * 2
    return jax.make_mesh((data, model), MESH_AXES, axis_types=auto, devices=devices[: data * model])


def parse_mesh(text: str) -> dict[str, int]:
    """``"data=2,model=4"`` -> ``{"data": 2, "model": 4}`` (missing axes are 1)."""
    sizes = {DATA: 1, MODEL: 1}
    seen = set()
    for part in filter(None, (p.strip() for p in str(text).split(","))):
        m = re.fullmatch(r"(\w+)\s*=\s*(\d+)", part)
        if not m or m.group(1) not in sizes or m.group(1) in seen or int(m.group(2)) < 1:
            raise ValueError(f"bad mesh {text!r}: expected axis=size pairs over {MESH_AXES}, "
                             "each at most once, e.g. data=2,model=4")
        seen.add(m.group(1))
        sizes[m.group(1)] = int(m.group(2))
    if not seen:
        raise ValueError(f"bad mesh {text!r}: expected e.g. data=2,model=4")
    return sizes


def as_mesh(mesh) -> jax.sharding.Mesh | None:
    """``mesh`` as a ``Mesh``: a ``Mesh`` (its axes must be ``data`` / ``model``), a ``{"data": 2, "model": 4}``
    dict, a ``"data=2,model=4"`` string, or None (single device)."""
    if mesh is None or isinstance(mesh, jax.sharding.Mesh):
        if mesh is not None and not set(mesh.axis_names) <= set(MESH_AXES):
            raise ValueError(f"mesh axes must be named from {MESH_AXES}, got {mesh.axis_names}")
        return mesh
    sizes = parse_mesh(mesh) if isinstance(mesh, str) else dict(mesh)
    if not set(sizes) <= set(MESH_AXES):
        raise ValueError(f"mesh axes must be named from {MESH_AXES}, got {sorted(sizes)}")
    return make_mesh(sizes.get(DATA, 1), sizes.get(MODEL, 1))


def axis_size(mesh, name: str) -> int:
    """Size of axis ``name`` of a ``Mesh`` / ``AbstractMesh`` (1 when the mesh has no such axis)."""
    return int(dict(mesh.shape).get(name, 1))


def context_mesh():
    """The abstract mesh set for tracing (``jax.set_mesh``), or None when there is none or it has one device."""
    mesh = jax.sharding.get_abstract_mesh()
    return None if mesh.empty or mesh.size == 1 else mesh


# ----------------------------------------------------------------------------------------------------------
# The table applied to pytrees
# ----------------------------------------------------------------------------------------------------------


def units(cfg) -> dict[str, int]:
    """How many whole units a logical axis counts for ``cfg`` (a target's config, or a drafter's: its
    backbone's): heads must be split whole, so ``model`` shards them only if it divides their number."""
    cfg = getattr(cfg, "model", cfg)
    got = dict(heads=getattr(cfg, "num_heads", None), kv_heads=getattr(cfg, "num_kv_heads", None),
               cache_kv_heads=getattr(cfg, "cache_kv_heads", None), v_heads=getattr(cfg, "linear_num_v_heads", None))
    return {k: int(v) for k, v in got.items() if v}


def for_mesh(cfg, mesh):
    """``cfg`` (a target's, or a drafter's: its backbone) set up for ``mesh``: when ``model`` is a multiple of the
    KV heads (and divides the query heads), the cache holds each KV head ``model / Hkv`` times
    (``kv_head_repeat``) so that it splits over ``model`` like the query heads, one KV head per device, instead
    of being replicated whole on every device (the serving engines' layout; the weights are unchanged)."""
    if mesh is None or getattr(cfg, "model", cfg) is None:
        return cfg
    inner = getattr(cfg, "model", cfg)
    if not hasattr(inner, "kv_head_repeat"):
        return cfg
    m, hkv, hq = axis_size(mesh, MODEL), inner.num_kv_heads, inner.num_heads
    repeat = m // hkv if m > hkv and m % hkv == 0 and hq % m == 0 else 1
    inner = dataclasses.replace(inner, kv_head_repeat=repeat)
    return dataclasses.replace(cfg, model=inner) if hasattr(cfg, "model") else inner


def leaf_axes(tree) -> list[tuple[str, tuple | None]]:
    """``(path, logical axes)`` of every leaf of ``tree``, in ``tree_leaves`` order: the axes its dataclass field
    declares (``axes``), None where no field declares any (a leaf outside our params, caches and decode state)."""
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    out = []
    for path, _ in flat:
        node, declared = tree, None
        for entry in path:
            if isinstance(entry, jax.tree_util.GetAttrKey):
                fields = {f.name: f for f in dataclasses.fields(node)} if dataclasses.is_dataclass(node) else {}
                field = fields.get(entry.name)
                declared = field.metadata.get(AXES_KEY) if field is not None else None
                node = getattr(node, entry.name)
            elif isinstance(entry, jax.tree_util.SequenceKey):
                node = node[entry.idx]  # a tuple of arrays shares its field's axes
            elif isinstance(entry, jax.tree_util.DictKey):
                node, declared = node[entry.key], None
            else:
                node, declared = None, None
        out.append((jax.tree_util.keystr(path), declared))
    return out


def partition_spec(axes: tuple | None, shape: tuple[int, ...], mesh, unit_counts: Mapping[str, int] = {}
                   ) -> PartitionSpec:
    """``PartitionSpec`` for one leaf: each logical axis on its mesh axis (``RULES``) when that axis has more
    than one device and divides both the dimension and the axis's unit count; otherwise replicated."""
    if axes is None:
        return PartitionSpec()
    out, used = [], set()
    for dim, axis in zip(shape, axes):
        name = RULES.get(axis) if axis else None
        n = axis_size(mesh, name) if name else 1
        whole = unit_counts.get(axis, dim)
        if name and name not in used and n > 1 and dim % n == 0 and whole % n == 0:
            out.append(name)
            used.add(name)
        else:
            out.append(None)
    while out and out[-1] is None:
        out.pop()
    return PartitionSpec(*out)


def partition_specs(tree, mesh, cfg=None):
    """The ``PartitionSpec`` of every leaf of ``tree`` (arrays or ``ShapeDtypeStruct``s) on ``mesh`` (a ``Mesh`` or
    the tracing context's ``AbstractMesh``): the table's logical axes through ``partition_spec``, with ``cfg``'s
    head counts (``units``)."""
    counts = units(cfg) if cfg is not None else {}
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    out = []
    for (path, logical), x in zip(leaf_axes(tree), leaves):
        if logical is None:
            raise ValueError(f"leaf {path} declares no logical axes, so it cannot be placed on a mesh (declare them "
                             "next to its dataclass field with models.sharding.axes)")
        if len(logical) != len(x.shape):
            raise ValueError(f"leaf {path}: logical axes {logical} for a rank-{len(x.shape)} array {tuple(x.shape)}")
        out.append(partition_spec(logical, tuple(x.shape), mesh, counts))
    return jax.tree_util.tree_unflatten(treedef, out)


def shardings(tree, mesh, cfg=None):
    """The ``NamedSharding`` of every leaf of ``tree`` on ``mesh`` (``partition_specs``)."""
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), partition_specs(tree, mesh, cfg),
                        is_leaf=lambda x: isinstance(x, PartitionSpec))


def unknown_leaves(tree) -> list[str]:
    """Paths of the leaves whose dataclass field declares no logical axes (``shardings`` refuses them)."""
    return [path for path, logical in leaf_axes(tree) if logical is None]


def place(tree, mesh, cfg=None):
    """``tree``'s leaves on ``mesh`` with their table shardings, one leaf at a time; works across processes
    (every process passes the same full values, each keeps its own shards)."""
    if mesh is None:
        return tree
    return jax.tree.map(put, tree, shardings(tree, mesh, cfg))


def put(x, s: jax.sharding.Sharding) -> jax.Array:
    """``x`` (an array, or typed PRNG keys) with sharding ``s``, built shard by shard from its host value, so
    it also works when ``s`` spans several processes (each passes the same ``x``)."""
    if isinstance(x, jax.Array) and x.sharding == s:
        return x
    if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        impl = jax.random.key_impl(x)
        data = put(jax.random.key_data(x), NamedSharding(s.mesh, PartitionSpec(*s.spec, None)))
        return jax.random.wrap_key_data(data, impl=impl)
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, s, lambda idx: host[idx])


def constrain(tree, mesh, cfg=None):
    """``with_sharding_constraint`` of every leaf to its table sharding (inside ``jit``); identity without a
    mesh."""
    if mesh is None or tree is None:
        return tree
    return jax.lax.with_sharding_constraint(tree, shardings(tree, mesh, cfg))


def batch_sharding(mesh, shape) -> NamedSharding:
    """A per-request array's sharding: requests over ``data`` (when it divides the batch), the rest replicated."""
    axes = ("batch",) + (None,) * (len(shape) - 1)
    return NamedSharding(mesh, partition_spec(axes, tuple(shape), mesh))


def mesh_context(mesh):
    """``jax.set_mesh(mesh)`` (the Pallas kernels read it while tracing), or nothing without a mesh."""
    import contextlib

    return contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh)


def whole_last_axis(x: jax.Array) -> jax.Array:
    """Inside a trace under a mesh context: ``x`` with its last axis gathered (the other axes as the
    partitioner likes).  For a top-k over the vocabulary of logits the output head left split over it (XLA:CPU
    cannot partition a top-k); the identity without a mesh."""
    if jax.sharding.get_abstract_mesh().empty:
        return x
    return jax.lax.with_sharding_constraint(x, PartitionSpec(*([PartitionSpec.UNCONSTRAINED] * (x.ndim - 1)), None))


def to_host(x) -> np.ndarray:
    """A (possibly multi-process sharded) array as one numpy array on this process."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


# ----------------------------------------------------------------------------------------------------------
# Kernels per shard
# ----------------------------------------------------------------------------------------------------------


def head_plan(mesh, batch: int, q_heads: int, kv_heads: int) -> tuple[str | None, str | None, str | None, bool]:
    """How a grouped-head kernel (query heads ``q_heads`` sharing ``kv_heads`` key/value heads, head ``h`` using
    key head ``h * kv_heads // q_heads``) splits over ``mesh``: ``(batch axis, query-head axis, kv-head axis,
    select)``.  KV heads split like the query heads when ``model`` divides them; when ``model`` is a multiple
    of them they stay replicated (as the cache's table does) and each shard ``select``s the one it needs
    (``select_kv_head``); otherwise heads are not split at all."""
    data = DATA if axis_size(mesh, DATA) > 1 and batch % axis_size(mesh, DATA) == 0 else None
    m = axis_size(mesh, MODEL)
    if m > 1 and kv_heads % m == 0 and q_heads % m == 0:
        return data, MODEL, MODEL, False
    if m > 1 and m % kv_heads == 0 and q_heads % m == 0:
        return data, MODEL, None, True
    return data, None, None, False


def select_kv_head(x: jax.Array, kv_heads: int, axis: int) -> jax.Array:
    """Inside ``shard_map``: the one kv head (of all ``kv_heads`` on ``axis``) this ``model`` shard's query
    heads use, as a size-1 axis."""
    m = jax.lax.axis_size(MODEL)
    return jax.lax.dynamic_slice_in_dim(x, jax.lax.axis_index(MODEL) * kv_heads // m, 1, axis=axis)


def per_shard(fn, in_specs, out_specs):
    """``fn`` under ``shard_map`` over the tracing context's mesh (``context_mesh``)."""
    return jax.shard_map(fn, in_specs=in_specs, out_specs=out_specs, check_vma=False)


# ----------------------------------------------------------------------------------------------------------
# Several hosts
# ----------------------------------------------------------------------------------------------------------

CLUSTER_VARIABLES = ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", "TPU_WORKER_HOSTNAMES")


def initialize_distributed(env: Mapping[str, str] = os.environ, force: bool = False) -> bool:
    """``jax.distributed.initialize`` when the environment describes a multi-process run, before anything
    touches a device: explicitly through ``JAX_COORDINATOR_ADDRESS`` (host:port of process 0) with
    ``JAX_NUM_PROCESSES`` and ``JAX_PROCESS_ID``, or a cluster JAX detects itself (Slurm, Open MPI, a GKE TPU
    slice: ``CLUSTER_VARIABLES`` naming more than one process); ``force`` lets JAX detect the cluster in any
    case (Cloud TPU VMs, which describe the pod through their metadata server, not the environment).  Returns
    whether it initialised."""
    if env.get("JAX_COORDINATOR_ADDRESS"):
        missing = [k for k in ("JAX_NUM_PROCESSES", "JAX_PROCESS_ID") if not env.get(k, "").isdigit()]
        if missing:
            raise ValueError(f"JAX_COORDINATOR_ADDRESS is set, so {' and '.join(missing)} must be too "
                             "(non-negative integers)")
        _initialize(env["JAX_COORDINATOR_ADDRESS"], int(env["JAX_NUM_PROCESSES"]), int(env["JAX_PROCESS_ID"]))
        return True
    def several(value: str) -> bool:  # a process count above 1, or a list of more than one host
        return int(value) > 1 if value.isdigit() else len(value.split(",")) > 1

    if force or any(several(env[k]) for k in CLUSTER_VARIABLES if env.get(k)):
        _initialize()
        return True
    return False


def _initialize(*args) -> None:
    """``jax.distributed.initialize(*args)``, with gloo between the CPU devices of different processes
    (accelerators ignore that option); set only for a multi-process run."""
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(*args)


def per_device_bytes(tree, mesh, cfg=None) -> int:
    """Bytes one device holds of ``tree`` (arrays or ``ShapeDtypeStruct``s) under their shardings (all of it on a
    one-device mesh, whatever its leaves declare)."""
    if mesh.size == 1:
        return sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))
    return sum(math.prod(s.shard_shape(tuple(x.shape))) * np.dtype(x.dtype).itemsize
               for x, s in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings(tree, mesh, cfg))))


__all__ = ["DATA", "MODEL", "MESH_AXES", "RULES", "AXES_KEY", "axes", "leaf_axes", "make_mesh", "parse_mesh",
           "as_mesh", "axis_size",
           "context_mesh", "units", "for_mesh", "partition_spec", "shardings",
           "unknown_leaves", "place", "put", "constrain", "batch_sharding", "mesh_context", "whole_last_axis",
           "to_host", "head_plan", "select_kv_head", "per_shard",
           "initialize_distributed", "per_device_bytes"]
