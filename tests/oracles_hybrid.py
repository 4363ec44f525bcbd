"""Tiny random HF hybrid GDN models (transformers ``Qwen3_5ForCausalLM``, ``Qwen3NextForCausalLM`` and
``Qwen3_5MoeForCausalLM``), fp32 on CPU, with every norm weight, ``A_log``, ``dt_bias`` and conv weight randomised (HF initialises zero-centred
norms to 0 and gated norms to 1, which would hide ``w`` vs ``1 + w`` mistakes)."""

from __future__ import annotations

import numpy as np
import torch

from tests.oracles import checkpoint_state  # noqa: F401  (shared with the dense oracles)

TINY_HYBRID = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,  # layers 0-2 GDN, layer 3 full attention
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    linear_num_key_heads=2,  # Hk != Hv, dk != dv so orientation bugs show
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=8,
    linear_conv_kernel_dim=4,
    rms_norm_eps=1e-6,
    max_position_embeddings=512,
    initializer_range=0.1,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
)
TINY_MOE = dict(
    num_experts=6, num_experts_per_tok=2, moe_intermediate_size=24, shared_expert_intermediate_size=40
)


def randomize_hybrid(model: torch.nn.Module, seed: int) -> None:
    """Norm weights U(-0.5, 0.5) (zero-centred) or U(0.5, 1.5) (gated norm), ``A_log`` U(-1, 1),
    ``dt_bias`` U(-1, 1), conv weights N(0, 0.3^2), MoE routers N(0, 1); reproducibly."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            u = torch.rand(p.shape, generator=gen)
            if name.endswith("linear_attn.norm.weight"):
                p.copy_(u + 0.5)
            elif "norm" in name and name.endswith("weight"):
                p.copy_(u - 0.5)
            elif name.endswith(("A_log", "dt_bias")):
                p.copy_(2 * u - 1)
            elif name.endswith("conv1d.weight"):
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
            elif name.endswith("mlp.gate.weight"):  # MoE routers: clear winners
                p.copy_(torch.randn(p.shape, generator=gen))


def tiny_hybrid(kind: str, seed: int = 0, tie: bool = False, **overrides):
    """``(model, config_dict)``: a tiny HF ``Qwen3_5ForCausalLM`` (``kind="qwen3_5"``, via
    ``Qwen3_5TextConfig``), ``Qwen3NextForCausalLM`` (``kind="qwen3_next"``, MoE in every layer) or
    ``Qwen3_5MoeForCausalLM`` (``kind="qwen3_5_moe"``, MoE in every layer), eager attention, fp32, eval mode."""
    fields = dict(TINY_HYBRID, tie_word_embeddings=tie, **overrides)
    torch.manual_seed(seed)
    if kind == "qwen3_5":
        from transformers.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5TextConfig

        cfg = Qwen3_5TextConfig(**fields)
        cls = Qwen3_5ForCausalLM
    elif kind == "qwen3_next":
        from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

        cfg = Qwen3NextConfig(**dict(TINY_MOE, **fields))
        cls = Qwen3NextForCausalLM
    elif kind == "qwen3_5_moe":
        from transformers import Qwen3_5MoeForCausalLM
        from transformers.models.qwen3_5_moe import Qwen3_5MoeTextConfig

        cfg = Qwen3_5MoeTextConfig(**dict(TINY_MOE, **fields))
        cls = Qwen3_5MoeForCausalLM
    else:
        raise ValueError(f"unknown kind {kind!r}")
    cfg._attn_implementation = "eager"
    model = cls(cfg).eval()
    randomize_hybrid(model, seed + 1)
    return model, cfg.to_dict()


def hf_run(model, ids, cache=None):
    """``(logits [B, T, V] numpy, cache)``: one HF forward of ``ids [B, T]`` continuing ``cache``
    (a fresh ``DynamicCache`` when None)."""
    from transformers import DynamicCache

    if cache is None:
        cache = DynamicCache(config=model.config)
    with torch.no_grad():
        out = model(torch.as_tensor(np.asarray(ids), dtype=torch.long), cache=cache, use_cache=True)
    return out.logits.numpy(), cache


def hf_logits(model, ids: list[int]) -> np.ndarray:
    """Reference logits ``[T, V]`` for one sequence, no cache."""
    with torch.no_grad():
        return model(torch.tensor([ids]), use_cache=False).logits[0].numpy()


def hf_gdn_states(cache, layer: int) -> tuple[np.ndarray, np.ndarray]:
    """``(conv [B, Kc-1, C] oldest first, recurrent [B, Hv, dk, dv])`` of HF GDN layer ``layer`` in our layout
    (HF keeps ``Kc`` conv columns ``[B, C, Kc]``; only the last ``Kc-1`` feed the next step)."""
    lay = cache.layers[layer]
    conv = lay.conv_states[0].detach().float().numpy()
    return np.swapaxes(conv[:, :, 1:], 1, 2), lay.recurrent_states[0].detach().float().numpy()


def save_hybrid_pair(root, kind: str = "qwen3_5"):
    """A tiny hybrid target of ``kind`` (seed 5) in ``root/target`` and a random Domino drafter declared for it
    (``tests.oracles.save_pair``); returns the HF target."""
    from tests.oracles import save_pair

    hf, _ = tiny_hybrid(kind, seed=5)
    return save_pair(root, hf)
