"""The sparse mixture-of-experts MLP of the Qwen MoE families (Qwen3-MoE, Qwen3-Next, Qwen3.5/3.6-MoE), one
implementation for all of them: its weight contract, its params and its forward (its config fields, as HF
writes them, are read by ``models.config.moe_fields``).

Routing: an fp32 softmax over ``x @ router`` (``[H, E]``), the top ``k`` experts per token (renormalised to sum
to 1 when ``norm_topk_prob``), each token's output the weighted sum of its experts' SwiGLU outputs, plus, where
the family has one (Qwen3-Next, Qwen3.5-MoE), ``sigmoid(x @ shared_gate) * shared(x)``.

Decoding needs no capacity: every token (a tree verify's every node) is routed on its own and none is dropped.
On GPU the experts run as grouped matmuls: the ``T * k`` token-expert pairs sorted by expert, then
``lax.ragged_dot`` over the per-expert group sizes.  XLA:CPU runs ``ragged_dot`` as every expert over every pair
(``experiments/bench_moe.py``: 33 tokens of a Qwen3-30B-A3B layer 2.5x the dense cost) and XLA:TPU's holds large
temporaries per layer, so there the pairs' expert weights are gathered while there are fewer pairs than experts,
and past that (a prefill) every expert runs on every token (``models.kernels.moe_grouping`` chooses, from the
platform and the static token count).  On a mesh each
expert's intermediate dimension is split over the ``model`` axis (``"mlp"``, as a dense MLP's is): every device
holds ``1/model`` of every expert and computes every routed pair's partial sum, so routing needs no all-to-all
and an uneven routing loads every device alike; the one all-reduce is the dense MLP's.

Checkpoints store experts one by one (``mlp.experts.{e}.{gate,up,down}_proj.weight``, what ``save_pretrained``
writes) or fused as transformers 5 holds them in memory (``mlp.experts.gate_up_proj [E, 2I, H]``,
``mlp.experts.down_proj [E, H, I]``); ``unfused_keys`` maps the fused tensors onto the per-expert contract
(the converter reads one expert's slice at a time).
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from dtree_jax.models import kernels, sharding
from dtree_jax.models.layers import DenseMLP, Leaf, derive, swiglu
from dtree_jax.models.sharding import axes


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MoEParams:
    router: jax.Array = axes(None, None)  # [H, E] (replicated: every device routes every token)
    w_gate: jax.Array = axes(None, None, "mlp")  # [E, H, I]
    w_up: jax.Array = axes(None, None, "mlp")  # [E, H, I]
    w_down: jax.Array = axes(None, "mlp", None)  # [E, I, H]
    shared: DenseMLP | None  # the shared expert (None: Qwen3-MoE has none)
    shared_gate: jax.Array | None = axes(None, None)  # [H, 1] its sigmoid gate


def dense_shapes(prefix: str, h: int, i: int) -> dict[str, tuple[int, int]]:
    """A SwiGLU MLP's HF keys under ``prefix`` -> ``[out, in]`` shapes (hidden ``h``, intermediate ``i``)."""
    return {f"{prefix}gate_proj.weight": (i, h), f"{prefix}up_proj.weight": (i, h), f"{prefix}down_proj.weight": (h, i)}


def hf_shapes(cfg, prefix: str) -> dict[str, tuple[int, ...]]:
    """One MoE MLP's HF keys under ``prefix`` (``...mlp.``), experts one by one -> HF shape ``[out, in]``."""
    h = cfg.hidden_size
    shapes = {f"{prefix}gate.weight": (cfg.num_experts, h)}
    for e in range(cfg.num_experts):
        shapes.update(dense_shapes(f"{prefix}experts.{e}.", h, cfg.moe_intermediate_size))
    if cfg.shared_expert_intermediate_size:
        shapes.update(dense_shapes(f"{prefix}shared_expert.", h, cfg.shared_expert_intermediate_size))
        shapes[f"{prefix}shared_expert_gate.weight"] = (1, h)
    return shapes


def load_dense(leaf: Leaf, prefix: str) -> DenseMLP:
    """A SwiGLU MLP from ``{prefix}{gate,up,down}_proj.weight``."""
    return DenseMLP(*(leaf(f"{prefix}{n}_proj.weight", True) for n in ("gate", "up", "down")))


def load(cfg, leaf: Leaf, prefix: str) -> MoEParams:
    """An MoE MLP from the per-expert keys of ``hf_shapes(cfg, prefix)``, experts stacked (``derive``: a mesh
    read makes each stacked leaf from its experts when it is placed)."""
    experts = [load_dense(leaf, f"{prefix}experts.{e}.") for e in range(cfg.num_experts)]
    stack = lambda *xs: jnp.stack(xs)  # noqa: E731
    shared = cfg.shared_expert_intermediate_size > 0
    return MoEParams(
        router=leaf(prefix + "gate.weight", True),
        w_gate=derive(stack, *(e.w_gate for e in experts)),
        w_up=derive(stack, *(e.w_up for e in experts)),
        w_down=derive(stack, *(e.w_down for e in experts)),
        shared=load_dense(leaf, prefix + "shared_expert.") if shared else None,
        shared_gate=leaf(prefix + "shared_expert_gate.weight", True) if shared else None,
    )


_FUSED = re.compile(r"^(?P<mlp>.*\.mlp\.experts\.)(?P<name>gate_up_proj|down_proj)$")


def unfused_keys(keys, num_experts_of) -> dict[str, tuple[str, int, str]]:
    """For the fused expert tensors among checkpoint ``keys`` (``...mlp.experts.gate_up_proj [E, 2I, H]``,
    ``...mlp.experts.down_proj [E, H, I]``): each per-expert key they hold -> ``(fused key, expert, part)``,
    part ``"gate"`` / ``"up"`` (row halves of ``gate_up_proj``) or ``"down"``; ``num_experts_of(key)`` is a
    fused tensor's ``E``.  Empty for a checkpoint that stores experts one by one."""
    out = {}
    for key in keys:
        m = _FUSED.match(key)
        if m:
            parts = ("down",) if m["name"] == "down_proj" else ("gate", "up")
            for e in range(num_experts_of(key)):
                out.update({f"{m['mlp']}{e}.{part}_proj.weight": (key, e, part) for part in parts})
    return out


def expert_part(x: np.ndarray, part: str) -> np.ndarray:
    """One expert's ``[out, in]`` tensor ``part`` from its slice ``x`` of a fused tensor (``gate_up_proj[e]``
    ``[2I, H]``: gate rows, then up rows; ``down_proj[e]`` ``[H, I]``)."""
    if part == "down":
        return x
    half = x.shape[0] // 2
    return x[:half] if part == "gate" else x[half:]


GROUPINGS = ("ragged", "gather", "dense")  # how the routed experts run (``moe_mlp``; ``kernels.moe_grouping``)


def route(p: MoEParams, xf: jax.Array, top_k: int, norm_topk_prob: bool):  # [M, H] -> ([M, k] fp32, [M, k])
    """Each token's ``top_k`` experts and their weights: fp32 softmax over the router's logits, top-k
    (renormalised to sum to 1 when ``norm_topk_prob``)."""
    probs = jax.nn.softmax((xf @ p.router).astype(jnp.float32), axis=-1)  # [M, E]
    top_w, top_e = jax.lax.top_k(probs, top_k)
    if norm_topk_prob:
        top_w = top_w / jnp.sum(top_w, axis=-1, keepdims=True)
    return top_w, top_e


def _ragged(p: MoEParams, xf, top_w, top_e):  # grouped GEMM over the pairs sorted by expert
    k = top_e.shape[-1]
    flat_e = top_e.reshape(-1)
    order = jnp.argsort(flat_e, stable=True)  # [M*k] pairs grouped by expert
    token = order // k
    sizes = jnp.bincount(flat_e, length=p.router.shape[-1]).astype(jnp.int32)  # [E]
    xs = xf[token]  # [M*k, H]
    hidden = jax.nn.silu(jax.lax.ragged_dot(xs, p.w_gate, sizes)) * jax.lax.ragged_dot(xs, p.w_up, sizes)
    ys = jax.lax.ragged_dot(hidden, p.w_down, sizes) * top_w.astype(xf.dtype).reshape(-1)[order][:, None]
    return jnp.zeros_like(xf).at[token].add(ys)


def _gather(p: MoEParams, xf, top_w, top_e):  # each pair's expert weights gathered: reads the routed experts only
    k = top_e.shape[-1]
    flat_e = top_e.reshape(-1)
    xs = jnp.repeat(xf, k, axis=0)  # [M*k, H]
    hidden = jax.nn.silu(jnp.einsum("ph,phi->pi", xs, p.w_gate[flat_e])) * \
        jnp.einsum("ph,phi->pi", xs, p.w_up[flat_e])
    ys = jnp.einsum("pi,pih->ph", hidden, p.w_down[flat_e]) * top_w.astype(xf.dtype).reshape(-1, 1)
    return ys.reshape(xf.shape[0], k, -1).sum(1)


def _dense(p: MoEParams, xf, top_w, top_e):  # every expert on every token, weighted by the routing
    rows = jnp.arange(xf.shape[0])[:, None]
    combine = jnp.zeros((xf.shape[0], p.router.shape[-1]), xf.dtype).at[rows, top_e].set(top_w.astype(xf.dtype))
    hidden = jax.nn.silu(jnp.einsum("mh,ehi->emi", xf, p.w_gate)) * jnp.einsum("mh,ehi->emi", xf, p.w_up)
    return jnp.einsum("emi,eih,me->mh", hidden, p.w_down, combine)


def moe_mlp(p: MoEParams, x: jax.Array, *, top_k: int, norm_topk_prob: bool,
            grouping: str = "ragged") -> jax.Array:  # [B, T, H] -> [B, T, H]
    """The MoE MLP (module docstring): ``route``, the routed experts run as ``grouping`` says (``GROUPINGS``:
    "ragged", ``lax.ragged_dot`` over the token-expert pairs sorted by expert, the grouped GEMM of TPUs and
    GPUs; "gather", each pair's expert weights gathered, which reads only the routed experts; "dense", every
    expert on every token, weighted by the routing; all three compute the same), plus the gated shared expert
    when ``p`` has one.  Under a mesh whose ``model`` axis splits the experts' intermediate dimension, the
    routed experts run per shard on their slices and one ``psum`` adds the partial outputs (nothing is
    gathered: the partitioner would replicate the expert weights for a ``ragged_dot``)."""
    if grouping not in GROUPINGS:
        raise ValueError(f"grouping must be one of {GROUPINGS}, got {grouping!r}")
    run = {"ragged": _ragged, "gather": _gather, "dense": _dense}[grouping]

    def routed(p: MoEParams, x: jax.Array) -> jax.Array:  # [B, T, H], this shard's experts' slice
        xf = x.reshape(-1, x.shape[-1])  # [M, H]
        return run(p, xf, *route(p, xf, top_k, norm_topk_prob)).reshape(x.shape)

    experts = dataclasses.replace(p, shared=None, shared_gate=None)
    mesh = sharding.context_mesh()
    specs = sharding.partition_specs(experts, mesh) if mesh is not None else None
    if specs is None or specs.w_down == PartitionSpec():
        out = routed(experts, x)
    else:
        data = sharding.DATA if x.shape[0] % sharding.axis_size(mesh, sharding.DATA) == 0 else None
        rows = PartitionSpec(data)
        out = sharding.per_shard(lambda p, x: jax.lax.psum(routed(p, x), sharding.MODEL), (specs, rows), rows)(
            experts, x)
    if p.shared is not None:
        out = out + swiglu(p.shared, x) * jax.nn.sigmoid(x @ p.shared_gate)
    return out


def mlp_for(cfg, p: MoEParams, x: jax.Array) -> jax.Array:  # [B, T, H] -> [B, T, H]
    """``moe_mlp`` as a model config sets it up: its top-k and renormalisation, and the grouping
    ``models.kernels.moe_grouping`` picks for its platform and ``x``'s token count."""
    return moe_mlp(p, x, top_k=cfg.num_experts_per_tok, norm_topk_prob=cfg.norm_topk_prob,
                   grouping=kernels.moe_grouping(cfg, x.size // x.shape[-1]))
