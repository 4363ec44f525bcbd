"""The whole jitted generation (prefill + the while_loop of rounds) cross-lowered on CPU for TPU and CUDA with
the Pallas kernels selected: methods ar / dflash / dominotree, the dense and the hybrid target, bf16 and fp32.

Each case counts the kernels in the lowered program (``tpu_custom_call`` for Mosaic, the Triton custom call for
GPU) against the call sites the configs imply, and checks which kernels the traced program holds: the tree-GDN
verify has no GPU kernel, so on GPU the dispatch (``dtree_jax.models.kernels``) picks its XLA path on purpose.
Params are abstract (nothing is run); tiny random configs, no torch.
"""

import collections
import dataclasses

import jax
import jax.extend as jex
import jax.numpy as jnp
import pytest

from dtree_jax import aot, api
from dtree_jax.api import Model, trace_generation, with_kernels
from dtree_jax.cli import SHIPPED_TINY, shipped
from dtree_jax.models import decoder, drafter, kernels, qwen3_5

LOWERING = {"tpu": "tpu", "gpu": "cuda"}  # kernel platform -> lowering platform
KIND = {"tpu": "mosaic", "gpu": "triton"}  # kernel platform -> kernel kind (aot.lowered_kernel_calls)
KERNEL_BODIES = {"tpu": "_tpu_kernel", "gpu": "_gpu_kernel"}  # tree attention's kernel functions
GDN_BODY = "_tree_gdn_kernel"

BACKBONE = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6, rope_theta=10000.0,
                max_position_embeddings=512, tie_word_embeddings=False)
DRAFTER = dict(
    BACKBONE, num_hidden_layers=2, block_size=4,
    # one full and one sliding-window draft layer, so the windowed kernel is lowered too
    use_sliding_window=True, sliding_window=8, layer_types=["full_attention", "sliding_attention"],
    dflash_config=dict(mask_token_id=127, target_layer_ids=[0, 2], projector_type="domino", emb_dim=16,
                       gru_hidden_dim=24, pure_draft_prefix_len=1, shift_label=False),
)
DENSE = dict(BACKBONE, model_type="qwen3", num_hidden_layers=3)
HYBRID = dict(  # layers 0-2 GDN, layer 3 full attention
    BACKBONE, model_type="qwen3_5_text", num_hidden_layers=4, linear_num_key_heads=2, linear_num_value_heads=4,
    linear_key_head_dim=16, linear_value_head_dim=8, linear_conv_kernel_dim=4,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
)
METHODS = ("ar", "dflash", "dominotree")


def _models(target_kind: str, dtype: str) -> tuple[Model, Model]:
    if target_kind == "qwen3":
        cfg = decoder.config_from_hf(DENSE, dtype=dtype)
        target = Model("qwen3", cfg, decoder.abstract_params(cfg, dtype))
    else:
        cfg = qwen3_5.config_from_hf(HYBRID, dtype=dtype)
        target = Model("qwen3_5", cfg, qwen3_5.abstract_params(cfg, dtype))
    dcfg = drafter.config_from_hf(DRAFTER, dtype=dtype)
    return target, Model("drafter", dcfg, drafter.abstract_params(dcfg, dtype))


def _pallas_bodies(jaxpr) -> collections.Counter:
    """Kernel function names of every ``pallas_call`` in a jaxpr, sub-jaxprs (while body, jit, ...) included."""
    found = collections.Counter()
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            found[eqn.params["jaxpr"].debug_info.func_name] += 1
        for sub in jex.core.jaxprs_in_params(eqn.params):
            found += _pallas_bodies(sub)
    return found


def expected_kernels(target: Model, draft: Model, method: str, platform: str) -> dict[str, int]:
    """Kernel call sites in the program: target attention in the prefill and in the loop's verify, the draft
    layers once in the loop (the drafter's context append has no attention), the tree-GDN verify once per GDN
    layer where the platform has that kernel."""
    attn = len(target.cfg.attn_layers) if target.kind == "qwen3_5" else target.cfg.num_layers
    want = {KERNEL_BODIES[platform]: 2 * attn + (0 if method == "ar" else draft.cfg.model.num_layers)}
    if target.kind == "qwen3_5" and kernels.KERNELS["tree_gdn"][platform] == "mosaic":
        want[GDN_BODY] = len(target.cfg.gdn_layers)
    return want


@pytest.fixture(scope="module")
def model_pairs():
    return {(kind, dtype): _models(kind, dtype) for kind in ("qwen3", "qwen3_5") for dtype in ("bfloat16", "float32")}


def lower_generation(target, draft, method, platform):
    target, draft = (with_kernels(m, "pallas", platform) for m in (target, draft))
    traced = trace_generation(target, draft, method, batch=2, budget=6, max_new_tokens=8)
    return traced, traced.lower(lowering_platforms=(LOWERING[platform],)).as_text()


@pytest.mark.parametrize("platform", ["tpu", "gpu"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("target_kind", ["qwen3", "qwen3_5"])
@pytest.mark.parametrize("method", METHODS)
def test_generation_lowers_with_kernels(model_pairs, method, target_kind, dtype, platform):
    target, draft = model_pairs[target_kind, dtype]
    traced, text = lower_generation(target, draft, method, platform)
    want = expected_kernels(target, draft, method, platform)
    assert dict(_pallas_bodies(traced.jaxpr.jaxpr)) == want
    calls = aot.lowered_kernel_calls(text)
    assert calls == {"mosaic": 0, "triton": 0, "mosaic_gpu": 0, KIND[platform]: sum(want.values())}


def test_gdn_verify_takes_the_xla_path_on_gpu_on_purpose():
    """The dispatch table, not an accident of tracing: GPU has no tree-GDN kernel, TPU and CPU do."""
    cfg = qwen3_5.config_from_hf(HYBRID, attention_impl="pallas")
    impls = {p: dataclasses.replace(cfg, kernel_platform=p).gdn_impl for p in ("tpu", "gpu", "cpu")}
    assert impls == {"tpu": "mosaic", "gpu": "xla", "cpu": "interpret"}
    assert dataclasses.replace(cfg, attention_impl="xla", kernel_platform="tpu").gdn_impl == "xla"
    dense = decoder.config_from_hf(DENSE, attention_impl="pallas")
    attn = {p: kernels.attention_kwargs(dataclasses.replace(dense, kernel_platform=p)) for p in ("tpu", "gpu", "cpu")}
    assert attn == {"tpu": dict(backend="tpu", interpret=False), "gpu": dict(backend="gpu", interpret=False),
                    "cpu": dict(backend="tpu", interpret=True)}
    xla = dataclasses.replace(dense, attention_impl="xla", kernel_platform="gpu")
    assert kernels.attention_kwargs(xla) == dict(backend="xla", interpret=False)
    with pytest.raises(ValueError, match="kernel_platform"):
        dataclasses.replace(dense, kernel_platform="cuda")


def test_kernel_platform_none_is_the_runtime_platform(monkeypatch):
    """None resolves to the process's backend at trace time (CPU here: interpret mode), in one place."""
    cfg = decoder.config_from_hf(DENSE, attention_impl="pallas")
    assert kernels.kernel_platform(cfg) == kernels.runtime_platform() == "cpu"
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert kernels.attention_kwargs(cfg) == dict(backend="gpu", interpret=False)
    assert kernels.kernel_platform(dataclasses.replace(cfg, kernel_platform="tpu")) == "tpu"


def test_shipped_pair_bf16_dominotree_lowers_for_cuda():
    """The issue's case: the shipped (fp32) checkpoints run in bf16 put fp32 queries over a bf16 cache; the
    kernel boundary casts them, so the Triton dots see one dtype and the CUDA lowering succeeds."""
    pair = []
    for name in SHIPPED_TINY:
        m = api.load_model(shipped(name))
        cfg = m.cfg
        if m.kind == "drafter":
            cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, dtype="bfloat16"))
        else:
            cfg = dataclasses.replace(cfg, dtype="bfloat16")
        pair.append(dataclasses.replace(m, cfg=cfg))
    target, draft = pair
    assert jax.tree.leaves(target.params)[0].dtype == jnp.float32  # fp32 weights, bf16 activations and cache
    for platform in ("gpu", "tpu"):
        traced, text = lower_generation(target, draft, "dominotree", platform)
        want = expected_kernels(target, draft, "dominotree", platform)
        assert aot.lowered_kernel_calls(text)[KIND[platform]] == sum(want.values()) == 9


def test_with_kernels_sets_target_and_drafter_backbone(model_pairs):
    target, draft = model_pairs["qwen3", "float32"]
    t, d = (with_kernels(m, "pallas", "gpu") for m in (target, draft))
    assert (t.cfg.attention_impl, t.cfg.kernel_platform) == ("pallas", "gpu")
    assert (d.cfg.model.attention_impl, d.cfg.model.kernel_platform) == ("pallas", "gpu")
    assert with_kernels(target) is target and with_kernels(None, "pallas") is None
    assert with_kernels(t, kernel_platform="tpu").cfg.attention_impl == "pallas"  # None keeps the config's
    with pytest.raises(ValueError, match="attention_impl"):
        with_kernels(target, "triton")


def test_cli_attention_impl_flag(monkeypatch, capsys):
    seen = []

    def fake_generate(target, prompts, method, drafter=None, **kw):
        seen.append(kw)
        stats = dict(generated=1, rounds=1, tau=0.0, seconds=1.0, tokens_per_second=1.0, stop_reason="eos",
                     budget=None)
        return api.Generation([[65]], [stats], 0.0, 1.0)

    monkeypatch.setattr(api, "generate", fake_generate)
    from dtree_jax.cli import main

    args = ["generate", "--method", "ar", "--prompt-ids", "1,2", "--no-compare-ar", "--json"]
    assert main(args + ["--attention-impl", "pallas", "--kernel-platform", "gpu"]) == 0
    assert main(args) == 0
    assert [(kw["attention_impl"], kw["kernel_platform"]) for kw in seen] == [("pallas", "gpu"), (None, None)]
    with pytest.raises(SystemExit):
        main(args + ["--attention-impl", "cuda"])
