"""Llama (with and without Llama 3.1 RoPE scaling) and Qwen2 as switches of the dense model, vs HF transformers
``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` (eager, fp32) on tiny random configs with every norm and bias
randomised: config switches and refusals, llama3 RoPE tables.  Checkpoint keys, prefill, decode and tree verify
of every node run for these families in ``tests/test_qwen3.py`` (``DENSE``)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from dtree_jax.models import decoder
from dtree_jax.models.config import Llama3RoPE
from dtree_jax.models.layers import rope_tables
from tests import oracles


def test_config_switches_and_refusals():
    base = dict(oracles.TINY_TARGET)
    llama, qwen2, qwen3_ = (
        decoder.config_from_hf(dict(base, model_type=t)) for t in ("llama", "qwen2", "qwen3")
    )
    assert (llama.qk_norm, llama.qkv_bias, llama.rope_scaling) == (False, False, None)
    assert (qwen2.qk_norm, qwen2.qkv_bias) == (False, True)
    assert (qwen3_.qk_norm, qwen3_.qkv_bias) == (True, False)
    assert decoder.config_from_hf(base).qk_norm  # no model_type: Qwen3 (the DFlash drafters' backbone)
    spec = {k: v for k, v in oracles.LLAMA3_ROPE.items() if k != "rope_type"}
    want = Llama3RoPE(**spec)
    theta = base.pop("rope_theta")
    new = decoder.config_from_hf(
        dict(base, model_type="llama", rope_parameters=dict(oracles.LLAMA3_ROPE, rope_theta=theta))
    )
    hub = decoder.config_from_hf(
        dict(base, model_type="llama", rope_theta=theta, rope_scaling=dict(spec, type="llama3"))
    )
    assert new.rope_scaling == hub.rope_scaling == want and new.rope_theta == hub.rope_theta == theta
    assert hash(new)
    llama_d = dict(base, model_type="llama", rope_theta=theta)
    for bad, match in [
        (dict(mlp_bias=True), "mlp_bias"),
        (dict(attention_bias=True), "attention_bias"),
        (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope_type"),
        (dict(rope_scaling={"rope_type": "linear", "factor": 2.0}), "rope_type"),
        (
            dict(rope_scaling={k: v for k, v in oracles.LLAMA3_ROPE.items() if k != "low_freq_factor"}),
            "low_freq",
        ),
        (dict(hidden_act="gelu"), "silu"),
        (
            dict(rope_parameters={"rope_type": "default", "rope_theta": theta, "partial_rotary_factor": 0.5}),
            "partial",
        ),
    ]:
        with pytest.raises(ValueError, match=match):
            decoder.config_from_hf(dict(llama_d, **bad))


def test_llama3_rope_tables_match_hf():
    """Our scaled cos/sin == HF's rotary embedding at positions far past the original context, and differ
    from the unscaled tables (so the scaling is exercised)."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    model, cfg, _, _ = oracles.dense_case("llama3-rope")
    pos = np.array([[0, 1, 5, 17, 100, 1000, 4095]], np.int64)
    ref_cos, ref_sin = LlamaRotaryEmbedding(model.config)(
        torch.zeros(1, dtype=torch.float32), torch.tensor(pos)
    )
    cos, sin = rope_tables(jnp.asarray(pos, jnp.int32), cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    # fp32 angles: at position 4095 one ulp is 2.4e-4 rad, so allow 1e-3 (the scaling moves them by > 0.1)
    np.testing.assert_allclose(cos, ref_cos.numpy(), atol=1e-3)
    np.testing.assert_allclose(sin, ref_sin.numpy(), atol=1e-3)
    np.testing.assert_allclose(cos[:, :5], ref_cos.numpy()[:, :5], atol=2e-5)  # positions <= 100
    plain_cos, _ = rope_tables(jnp.asarray(pos, jnp.int32), cfg.head_dim, cfg.rope_theta)
    assert np.abs(np.asarray(plain_cos) - ref_cos.numpy()).max() > 0.1
