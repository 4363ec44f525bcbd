"""Roofline cost model of a verify step, and the budget choice (``choose_budget``; ``auto_budget`` from a
measured calibration): ridge point, break-even batch, step cost.

A decode/verify step reads every weight once and does ``2 * params`` flops per token, so it stays
bandwidth-bound until the batch verifies about ``ridge_tokens`` tokens per step.  A tree of N nodes at
batch B verifies ``B * N`` tokens: past the ridge every unused branch is paid-for compute.
"""

from __future__ import annotations

import dataclasses
import math
import pathlib
from typing import Callable, Mapping

from dtree_jax import checkpoint_files


@dataclasses.dataclass(frozen=True)
class Device:
    name: str
    peak_flops: float  # dense bf16 FLOP/s
    hbm_bandwidth: float  # bytes/s
    source: str  # datasheet the figures come from


# Dense (non-sparse) bf16 tensor throughput and memory bandwidth from the vendors' datasheets.
DEVICES: dict[str, Device] = {
    d.name: d
    for d in (
        Device("h100-sxm", 989e12, 3.35e12, "NVIDIA H100 Tensor Core GPU datasheet (SXM5: 989 TFLOPS bf16 dense, 3.35 TB/s)"),
        Device("h200-sxm", 989e12, 4.8e12, "NVIDIA H200 Tensor Core GPU datasheet (SXM: 989 TFLOPS bf16 dense, 4.8 TB/s)"),
        Device("a100-sxm-80gb", 312e12, 2.039e12, "NVIDIA A100 datasheet (80GB SXM: 312 TFLOPS bf16 dense, 2,039 GB/s)"),
        Device("rtx-5090", 209.5e12, 1.792e12, "NVIDIA RTX Blackwell GPU architecture whitepaper (GeForce RTX 5090: 209.5 TFLOPS fp16/bf16 dense with fp32 accumulate, 1,792 GB/s)"),
        Device("tpu-v5e", 197e12, 819e9, "Google Cloud TPU v5e documentation (197 TFLOPS bf16, 819 GB/s HBM)"),
        Device("tpu-v5p", 459e12, 2.765e12, "Google Cloud TPU v5p documentation (459 TFLOPS bf16, 2,765 GB/s HBM)"),
        Device("tpu-v6e", 918e12, 1.64e12, "Google Cloud TPU v6e (Trillium) documentation (918 TFLOPS bf16, 1,640 GB/s HBM)"),
    )
}


def _positive(**values: float) -> None:
    for k, v in values.items():
        if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
            raise ValueError(f"{k} must be a positive finite number, got {v!r}")


def ridge_tokens(peak_flops: float, hbm_bandwidth: float, bytes_per_param: float = 2) -> float:
    """Tokens per step at which ``2 * P * T`` flops take as long as reading ``P * bytes_per_param`` bytes."""
    _positive(peak_flops=peak_flops, hbm_bandwidth=hbm_bandwidth, bytes_per_param=bytes_per_param)
    return peak_flops * bytes_per_param / (2.0 * hbm_bandwidth)


def break_even_batch(verify_tokens: int, ridge: float) -> int:
    """Largest batch whose ``batch * verify_tokens`` stays at or below the ridge (floor)."""
    if not isinstance(verify_tokens, int) or verify_tokens < 1:
        raise ValueError(f"verify_tokens must be a positive integer, got {verify_tokens!r}")
    _positive(ridge=ridge)
    return int(math.floor(ridge / verify_tokens))


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """The parts of a decoder's shape that set its step cost (dense GQA transformer)."""

    num_layers: int
    hidden: int
    intermediate: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab: int
    tied_embeddings: bool = False

    @property
    def params(self) -> int:
        attn = self.hidden * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)
        mlp = 3 * self.hidden * self.intermediate
        head = 0 if self.tied_embeddings else self.vocab * self.hidden
        return self.num_layers * (attn + mlp) + self.vocab * self.hidden + head

    @property
    def matmul_params(self) -> int:
        """Parameters touched by every token's matmuls (the input embedding is a gather)."""
        return self.params - (0 if self.tied_embeddings else self.vocab * self.hidden)


QWEN3_4B = ModelShape(36, 2560, 9728, 32, 8, 128, 151936, tied_embeddings=True)
QWEN3_8B = ModelShape(36, 4096, 12288, 32, 8, 128, 151936)


@dataclasses.dataclass(frozen=True)
class StepCost:
    weight_bytes: float
    kv_bytes: float
    flops: float
    seconds: float  # roofline: max(compute time, memory time)
    bound: str  # "memory" or "compute"


def step_cost(
    model: ModelShape,
    device: Device,
    batch: int,
    tree_nodes: int,
    context: int,
    bytes_per_param: float = 2,
    bytes_per_kv: float = 2,
) -> StepCost:
    """Roofline estimate of one verify step: ``batch`` requests, ``tree_nodes`` tokens each, ``context``
    committed tokens each (weights read once; KV read once per request; matmul and attention flops)."""
    for k, v in dict(batch=batch, tree_nodes=tree_nodes).items():
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{k} must be a positive integer, got {v!r}")
    if not isinstance(context, int) or context < 0:
        raise ValueError(f"context must be a non-negative integer, got {context!r}")
    tokens = batch * tree_nodes
    weight_bytes = model.params * bytes_per_param
    kv_per_token = 2 * model.num_layers * model.num_kv_heads * model.head_dim * bytes_per_kv
    kv_bytes = batch * (context + tree_nodes) * kv_per_token
    attn_flops = 4 * tokens * (context + tree_nodes) * model.num_heads * model.head_dim * model.num_layers
    flops = 2 * model.matmul_params * tokens + attn_flops
    t_mem = (weight_bytes + kv_bytes) / device.hbm_bandwidth
    t_flops = flops / device.peak_flops
    return StepCost(weight_bytes, kv_bytes, flops, max(t_mem, t_flops), "memory" if t_mem >= t_flops else "compute")


def choose_budget(
    batch: int,
    tau_by_budget: Mapping[int, float],
    verify_seconds: Callable[[int, int], float],
    draft_seconds: Callable[[int, int], float] | float = 0.0,
) -> int:
    """Node budget maximising expected tokens per unit time, ``batch * tau(b) / (draft + verify)``.

    ``tau_by_budget`` maps a non-root node budget to the measured (or modelled) mean tokens per round;
    ``verify_seconds(batch, verify_tokens)`` is the step time for ``budget + 1`` tokens per request (from
    ``step_cost`` or from measurements), ``draft_seconds(batch, budget)`` the drafting/building time.
    At small batch a wide tree wins; as ``batch * (budget + 1)`` passes the ridge the choice shrinks
    toward a chain.  Ties go to the smaller budget.
    """
    if not tau_by_budget:
        raise ValueError("tau_by_budget is empty")
    if not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch must be a positive integer, got {batch!r}")
    best, best_rate = None, -math.inf
    for budget in sorted(tau_by_budget):
        tau = tau_by_budget[budget]
        if not isinstance(budget, int) or budget < 0:
            raise ValueError(f"budgets must be non-negative integers, got {budget!r}")
        if not (math.isfinite(tau) and tau >= 1):
            raise ValueError(f"tau for budget {budget} must be >= 1 (one token per round at least), got {tau!r}")
        draft = draft_seconds(batch, budget) if callable(draft_seconds) else float(draft_seconds)
        seconds = draft + verify_seconds(batch, budget + 1)
        if not seconds > 0:
            raise ValueError(f"step time for budget {budget} must be positive, got {seconds!r}")
        rate = batch * tau / seconds
        if rate > best_rate * (1 + 1e-12):
            best, best_rate = budget, rate
    return best


CALIBRATION_FILE = "calibration.json"


def parse_taus(calibration: dict) -> dict[int, float]:
    """``calibration["tau_by_budget"]`` as ``{budget: tau}``, with budget 0 (plain ar, tau 1) added."""
    try:
        taus = {int(b): float(t) for b, t in calibration["tau_by_budget"].items()}
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ValueError(f"malformed calibration (need tau_by_budget: {{budget: tau}}): {e}") from e
    if taus.get(0, 1.0) != 1.0:
        raise ValueError(f"calibration: budget 0 is plain ar, one token a round, so its tau must be 1, got {taus[0]}")
    return {0: 1.0, **taus}


def auto_budget(calibration: dict, batch: int) -> int:
    """The node budget ``cost.choose_budget`` picks for ``batch`` from a calibration measured on this machine:
    ``{"tau_by_budget": {budget: tau}, "round_seconds": {batch: {budget: seconds per round}}}``.  Seconds for
    an unmeasured batch are interpolated log-linearly between measured batches (proportionally beyond).
    Budget 0 stands for not speculating (plain ``ar``: tau 1, its seconds per token): a calibration that
    measured it lets ``auto`` answer 0 where no tree pays for itself."""
    taus = parse_taus(calibration)
    try:
        table = {int(bs): {int(b): float(t) for b, t in row.items()} for bs, row in calibration["round_seconds"].items()}
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ValueError(f"malformed calibration (need tau_by_budget and round_seconds): {e}") from e
    batches = sorted(table)
    if any(0 not in table[b] for b in batches):  # plain ar not measured: choose among the trees
        taus.pop(0)
    if not batches or any(set(table[b]) < set(taus) for b in batches):
        raise ValueError("calibration round_seconds must cover every budget in tau_by_budget at every batch")

    def seconds(b: int, verify_tokens: int) -> float:
        budget = verify_tokens - 1
        if b <= batches[0]:
            return table[batches[0]][budget]
        if b >= batches[-1]:
            return table[batches[-1]][budget] * b / batches[-1]
        hi = next(x for x in batches if x >= b)
        lo = max(x for x in batches if x <= b)
        if hi == lo:
            return table[lo][budget]
        w = (math.log(b) - math.log(lo)) / (math.log(hi) - math.log(lo))
        return float(math.exp((1 - w) * math.log(table[lo][budget]) + w * math.log(table[hi][budget])))

    return choose_budget(batch, taus, seconds)


def load_calibration(calibration: dict | str | None, drafter_dir: str | None) -> dict:
    """``calibration`` itself (a dict), the JSON file it names, or ``CALIBRATION_FILE`` in ``drafter_dir``."""
    if isinstance(calibration, dict):
        return calibration
    path = calibration or (drafter_dir and pathlib.Path(drafter_dir) / CALIBRATION_FILE)
    if not path or not pathlib.Path(path).is_file():
        raise ValueError(
            f"budget='auto' needs a calibration ({CALIBRATION_FILE} beside the drafter, or calibration=...); "
            "experiments/run_experiments.py measures one"
        )
    return checkpoint_files.read_json(pathlib.Path(path).parent, pathlib.Path(path).name)
