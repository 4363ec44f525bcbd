"""Tiny random reference models shared by tests: HF ``Qwen3ForCausalLM`` (transformers), the ``dflash``
package's ``DFlashDraftModel`` and specforge's ``DominoDraftModel``, all fp32 on CPU with every norm weight
randomised (so ``w`` vs ``1 + w`` and missing-norm mistakes show)."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
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


LLAMA3_ROPE = dict(rope_type="llama3", factor=4.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=16)  # short: most frequencies are scaled or smoothed


# Qwen3-MoE: layer 1 dense (mlp_only_layers), the others 8 experts, top 3, renormalised
TINY_QWEN3_MOE = dict(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=24, decoder_sparse_step=1,
                      mlp_only_layers=[1], norm_topk_prob=True)


def tiny_dense(model_type: str, tie: bool, seed: int = 0, llama3_rope: bool = False):
    """``(model, config_dict)``: a tiny HF ``LlamaForCausalLM`` (``model_type="llama"``, optionally with
    Llama 3.1 RoPE scaling), ``Qwen2ForCausalLM`` (``"qwen2"``) or ``Qwen3MoeForCausalLM`` (``"qwen3_moe"``,
    ``TINY_QWEN3_MOE``), eager, fp32, eval mode, with every norm and bias randomised (HF initialises biases to
    zero) and the MoE routers drawn N(0, 1) (so routing has clear winners)."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    config_cls, model_cls = {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
        "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM),
    }[model_type]
    fields = dict(TINY_TARGET, tie_word_embeddings=tie, attn_implementation="eager")
    if model_type == "qwen3_moe":
        fields.update(TINY_QWEN3_MOE)
    if llama3_rope:
        fields["rope_parameters"] = dict(LLAMA3_ROPE, rope_theta=fields.pop("rope_theta"))
    torch.manual_seed(seed)
    model = model_cls(config_cls(**fields)).eval()
    randomize_norms(model, seed + 1)
    gen = torch.Generator().manual_seed(seed + 2)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
            elif name.endswith("mlp.gate.weight"):
                p.copy_(torch.randn(p.shape, generator=gen))
    return model, model.config.to_dict()


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


def checkpoint_state(model: torch.nn.Module) -> dict[str, np.ndarray]:
    """The model's tensors under checkpoint keys (fp32 numpy): HF's fused in-memory MoE experts
    (``experts.gate_up_proj [E, 2I, H]``, ``experts.down_proj [E, H, I]``) split per expert as
    ``save_pretrained`` writes them."""
    out = {}
    for key, t in model.state_dict().items():
        x = t.detach().float().numpy()
        if key.endswith("experts.gate_up_proj"):
            base, half = key.removesuffix("gate_up_proj"), x.shape[1] // 2
            for e in range(x.shape[0]):
                out[f"{base}{e}.gate_proj.weight"] = x[e, :half]
                out[f"{base}{e}.up_proj.weight"] = x[e, half:]
        elif key.endswith("experts.down_proj"):
            for e in range(x.shape[0]):
                out[f"{key.removesuffix('down_proj')}{e}.down_proj.weight"] = x[e]
        else:
            out[key] = x
    return out


def save_pair(root, hf):
    """The HF target ``hf`` saved in ``root/target`` (``save_pretrained``) and a random Domino drafter (seed 6)
    declared for its layer count in ``root/drafter``, both in HF layout; returns ``hf``."""
    import json

    hf.save_pretrained(root / "target")
    dom, _, _ = tiny_domino(shift_label=False, seed=6)
    dom.save_pretrained(root / "drafter")
    cfg = json.loads((root / "drafter" / "config.json").read_text())
    cfg["num_target_layers"] = hf.config.num_hidden_layers
    (root / "drafter" / "config.json").write_text(json.dumps(cfg))
    return hf


class StateGetter:
    """``get(key) -> np.ndarray`` (fp32) over a torch model's checkpoint tensors (``checkpoint_state``),
    recording every key read."""

    def __init__(self, module: torch.nn.Module):
        self.state = checkpoint_state(module)
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
    stacked = {re.sub(r"\.experts\.\d+\.", ".experts.*.", k) for k in shapes}  # an MoE layer stacks its experts
    assert len(jax.tree.leaves(abstract)) == len(stacked)
    return len(shapes)


def dflash_draft_rounds(draft, target, prompt: list[int], max_new_tokens: int):
    """Greedy ``dflash.model.dflash_generate`` with every round's draft recorded.

    Returns ``(output ids, {start: [root, drafts...]})`` for the full rounds (those that drafted a whole
    block): ``start`` is the committed length when the round began, ``root`` the token at ``start``.
    """
    from dflash.model import dflash_generate

    drafts, starts = [], []
    forward, logits = draft.forward, draft.compute_logits

    def recording_forward(*args, **kw):
        width = kw["noise_embedding"].shape[1]
        starts.append((int(kw["position_ids"][0, -width]), width))
        return forward(*args, **kw)

    def recording_logits(hidden, head):
        out = logits(hidden, head)
        drafts.append(out.argmax(-1)[0].tolist())
        return out

    draft.forward, draft.compute_logits = recording_forward, recording_logits
    try:
        ids = dflash_generate(draft, target, torch.tensor([prompt]), max_new_tokens, None, temperature=0.0)
    finally:
        del draft.forward, draft.compute_logits
    ids = ids[0].tolist()
    return ids, {s: [ids[s]] + d for (s, w), d in zip(starts, drafts) if w == draft.block_size}


def specforge_draft_rounds(domino, target, prompt: list[int], max_new_tokens: int):
    """specforge's greedy ``spec_generate`` (the Domino chain at full vocabulary) with every round's draft
    recorded: ``(output ids, {start: [root, drafts...]})``.

    ``spec_generate`` builds plain ``DynamicCache()``s and crops them to an absolute length; hybrid targets
    need a cache built from their config that records past states and is cropped by a (negative) count, so
    the caches it builds are swapped for such ones (nothing else of the loop changes).
    """
    from transformers import DynamicCache
    from specforge.modeling.draft import dflash as specforge_dflash

    class CroppableCache(DynamicCache):
        def crop(self, max_length):
            super().crop(max_length - self.get_seq_length())

    configs = iter((target.config, domino.config))  # spec_generate builds the target's cache first

    def make_cache():
        cache = CroppableCache(config=next(configs))
        cache.activate_past_recording()
        return cache

    rounds, starts = [], []
    sample, forward = domino._sample_draft_tokens, domino.forward

    def recording_forward(*args, **kw):
        starts.append(int(kw["position_ids"][0, -domino.block_size]))
        return forward(*args, **kw)

    def recording(target_model, draft_hidden, block_output_ids):
        out = sample(target_model, draft_hidden, block_output_ids)
        rounds.append([int(block_output_ids[0, 0])] + out[0].tolist())
        return out

    domino._sample_draft_tokens, domino.forward = recording, recording_forward
    specforge_dflash.DynamicCache = make_cache
    try:
        ids = domino.spec_generate(target, torch.tensor([prompt]), max_new_tokens, None, temperature=0.0)[0].tolist()
    finally:
        del domino._sample_draft_tokens, domino.forward
        specforge_dflash.DynamicCache = DynamicCache
    return ids, dict(zip(starts, rounds))


def context_drafts(draft, target, seq: list[int], starts, domino=None) -> dict[int, list[int]]:
    """Reference drafts without any cache: for each ``start``, the target's hidden states of ``seq[:start]``
    (``output_hidden_states``, no cache), the reference drafter's block ``[seq[start], MASK, ...]`` over that
    context, and its greedy draft: ``draft.compute_logits`` (the ``dflash`` package) or, given specforge's
    ``domino``, its ``_sample_draft_tokens`` (the Domino chain).  For targets whose caches the reference
    loops cannot roll back (hybrid GDN).  Returns ``{start: [root, drafts...]}``."""
    from dflash.model import extract_context_feature

    model = domino if domino is not None else draft
    bs, out = model.block_size, {}
    for start in starts:
        with torch.no_grad():
            hidden = target(torch.tensor([seq[:start]]), output_hidden_states=True, use_cache=False).hidden_states
            feats = extract_context_feature(hidden, model.target_layer_ids)
            block = torch.tensor([[seq[start]] + [model.mask_token_id] * (bs - 1)])
            noise = target.get_input_embeddings()(block)
            ph = model(target_hidden=feats, noise_embedding=noise, position_ids=torch.arange(start + bs)[None])
            if domino is not None:
                drafts = domino._sample_draft_tokens(target, ph, block)[0].tolist()
            else:
                drafts = draft.compute_logits(ph[:, 1:], target.lm_head).argmax(-1)[0].tolist()
        out[start] = [seq[start]] + drafts
    return out


def oracle_draft(reference: np.ndarray, original, decoy: bool = False):
    """A drafter that knows the target's continuation at 4 of every 5 positions (noise at the 5th).  With
    ``decoy``, at every 3rd position a wrong token outranks the truth, so accepted paths take second-rank
    branches and are not contiguous in node order."""
    ref = jnp.asarray(reference)

    def draft(spec, tparams, dparams, state):
        rnd = original(spec, tparams, dparams, state)
        b, k, v = rnd.base.shape
        pos = state.out_len[:, None] + jnp.arange(k)[None, :]  # output index of the token at depth d + 1
        known = (pos % 5) != 4
        truth = jnp.take_along_axis(ref, jnp.clip(pos, 0, ref.shape[1] - 1), axis=1)
        boost = 30.0 * jax.nn.one_hot(truth, v) * known[..., None]
        if decoy:
            boost += 31.0 * jax.nn.one_hot((truth + 1) % v, v) * ((pos % 3) == 1)[..., None]
        return rnd.__class__(ph=rnd.ph, base=rnd.base + boost, root_state=rnd.root_state, root=rnd.root)

    return draft


DENSE = {  # dense test cases: name -> (model_type, tie_word_embeddings, Llama 3.1 RoPE scaling)
    "qwen3": ("qwen3", False, False),
    "qwen3-tied": ("qwen3", True, False),
    "llama": ("llama", True, False),
    "llama3-rope": ("llama", False, True),
    "qwen2": ("qwen2", True, False),
    "qwen3-moe": ("qwen3_moe", False, False),
}


@functools.lru_cache(maxsize=None)
def dense_case(name: str):
    """``(HF model, our fp32 cfg, our fp32 params, keys read)`` for the ``DENSE`` case ``name``."""
    from dtree_jax.models import decoder

    model_type, tie, llama3 = DENSE[name]
    if model_type == "qwen3":
        model, d = tiny_qwen3(tie, seed=3 if tie else 4)
    else:
        model, d = tiny_dense(model_type, tie, seed=7 + len(name), llama3_rope=llama3)
    cfg = decoder.config_from_hf(d, dtype="float32")
    getter = StateGetter(model)
    return model, cfg, decoder.params_from_hf(cfg, getter, jnp.float32), getter.reads
