"""Tiny random reference models shared by tests: HF ``Qwen3ForCausalLM`` (transformers), the ``dflash``
package's ``DFlashDraftModel`` and specforge's ``DominoDraftModel``, all fp32 on CPU with every norm weight
randomised (so ``w`` vs ``1 + w`` and missing-norm mistakes show)."""

from __future__ import annotations

import numpy as np
import torch

TINY_TARGET = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=5,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,  # != hidden / heads, as in Qwen3-4B
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    max_position_embeddings=512,
    initializer_range=0.1,
)


def randomize_norms(model: torch.nn.Module, seed: int) -> None:
    """Sets every ``*norm*.weight`` to U(0.5, 1.5), reproducibly."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.copy_(torch.rand(p.shape, generator=gen) + 0.5)


def tiny_qwen3(tie: bool, seed: int = 0):
    """``(model, config_dict)``: a tiny HF Qwen3ForCausalLM (eager attention, fp32, eval mode)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3Config(**TINY_TARGET, tie_word_embeddings=tie, attn_implementation="eager")
    model = Qwen3ForCausalLM(cfg).eval()
    randomize_norms(model, seed + 1)
    return model, cfg.to_dict()


def tiny_drafter_config_dict(shift_label: bool, head: bool = True) -> dict:
    """A drafter config dict in the released checkpoints' layout (Qwen3Config fields + ``dflash_config``)."""
    dc = dict(mask_token_id=127, target_layer_ids=[0, 2, 3])
    if head:
        dc.update(
            projector_type="domino",
            emb_dim=16,
            gru_hidden_dim=24,
            pure_draft_prefix_len=1,
            shift_label=shift_label,
        )
    return dict(
        {k: v for k, v in TINY_TARGET.items()},
        num_hidden_layers=2,
        block_size=6,
        num_target_layers=TINY_TARGET["num_hidden_layers"],
        tie_word_embeddings=False,
        dflash_config=dc,
    )


def tiny_domino(shift_label: bool, seed: int = 0):
    """``(specforge DominoDraftModel, dflash DFlashDraftModel with the same backbone, config_dict)``."""
    from dflash.model import DFlashDraftModel
    from specforge.modeling.draft.domino import DominoDraftModel
    from transformers import Qwen3Config

    d = tiny_drafter_config_dict(shift_label)
    torch.manual_seed(seed)
    cfg = Qwen3Config(**{k: v for k, v in d.items()})
    cfg._attn_implementation = "eager"
    domino = DominoDraftModel(cfg).eval()
    randomize_norms(domino, seed + 1)
    dflash = DFlashDraftModel(cfg).eval()
    missing, unexpected = dflash.load_state_dict(domino.state_dict(), strict=False)
    assert not missing and all(k.startswith(("prefix_gru.", "embed_proj.")) for k in unexpected)
    return domino, dflash, d


class StateGetter:
    """``get(key) -> np.ndarray`` (fp32) over a torch state dict, recording every key read."""

    def __init__(self, module: torch.nn.Module):
        self.state = {k: v.detach().float().numpy() for k, v in module.state_dict().items()}
        self.reads: list[str] = []

    def __call__(self, key: str) -> np.ndarray:
        self.reads.append(key)
        return self.state[key]


def hf_hidden_and_logits(model, ids: list[int]):
    """Reference ``(logits [T, V], hidden_states tuple of [T, H])`` for one sequence, no cache."""
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_hidden_states=True, use_cache=False)
    return out.logits[0].numpy(), tuple(h[0].numpy() for h in out.hidden_states)


def check_hf_contract(module, cfg, dtype) -> int:
    """Asserts that ``module.params_from_hf`` reads every ``hf_shapes`` key exactly once and yields exactly
    ``module.abstract_params`` (structure, shapes, dtypes) without materialising weights; returns the key
    count.
    """
    import jax
    import jax.numpy as jnp

    shapes = module.hf_shapes(cfg)
    reads = []

    def get(key):
        reads.append(key)
        return jnp.zeros(shapes[key], jnp.bfloat16)  # traced under eval_shape: no memory

    built = jax.eval_shape(lambda: module.params_from_hf(cfg, get, dtype))
    assert sorted(reads) == sorted(shapes) and len(reads) == len(set(reads))
    abstract = module.abstract_params(cfg, dtype)
    assert jax.tree.structure(built) == jax.tree.structure(abstract)
    for a, b in zip(jax.tree.leaves(built), jax.tree.leaves(abstract)):
        assert (a.shape, a.dtype) == (b.shape, b.dtype)
    assert len(jax.tree.leaves(abstract)) == len(shapes)
    return len(shapes)
