"""Hostile HF ``config.json`` files (issue 28): every malformed field is refused at once by the typed readers
of ``models.config`` with a ValueError naming it, before anything is built from it, and the same field with a
valid value loads (so each refusal is the value's doing).  Through ``convert.abstract_model`` (the config path
every loader takes) and the CLI."""

from __future__ import annotations

import copy
import json
import time

import pytest

from dtree_jax import convert
from dtree_jax.cli import main
from dtree_jax.models import config as hf_config
from dtree_jax.models import decoder
from tests import oracles, oracles_hybrid

DENSE = dict(oracles.TINY_TARGET, model_type="qwen3", architectures=["Qwen3ForCausalLM"],
             tie_word_embeddings=False)
BASES = {
    "dense": DENSE,
    "llama": dict(DENSE, model_type="llama", architectures=["LlamaForCausalLM"],
                  rope_scaling=oracles.LLAMA3_ROPE),
    "moe": dict(DENSE, model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"],
                **oracles.TINY_QWEN3_MOE),
    "drafter": dict(oracles.tiny_drafter_config_dict(shift_label=False), architectures=["DFlashDraftModel"]),
    "hybrid": dict(oracles_hybrid.TINY_HYBRID, model_type="qwen3_5_text"),
    "hybrid_moe": dict(oracles_hybrid.TINY_HYBRID, model_type="qwen3_5_moe_text", **oracles_hybrid.TINY_MOE),
}
INF, NAN = float("inf"), float("nan")
LAYERS = "num_hidden_layers"

# (base, hostile fields, the same fields valid, the name the error must show); "a.b" is field b of object a
CASES = [
    ("dense", {LAYERS: 2.7}, {LAYERS: 2.0}, LAYERS),
    ("dense", {LAYERS: True}, {LAYERS: 1}, LAYERS),
    ("dense", {LAYERS: 10**6}, {LAYERS: 3}, LAYERS),
    ("dense", {LAYERS: 10**9}, {LAYERS: 3}, LAYERS),
    ("dense", {LAYERS: INF}, {LAYERS: 3}, LAYERS),
    ("dense", {LAYERS: NAN}, {LAYERS: 3}, LAYERS),
    ("dense", {LAYERS: "2"}, {LAYERS: 2}, LAYERS),
    ("dense", {LAYERS: [2]}, {LAYERS: 2}, LAYERS),
    ("dense", {"num_attention_heads": 0}, {"num_attention_heads": 2}, "num_attention_heads"),
    ("dense", {"num_key_value_heads": 3}, {"num_key_value_heads": 1}, "num_key_value_heads"),
    ("dense", {"head_dim": None, "hidden_size": 66}, {"head_dim": None, "hidden_size": 64}, "hidden_size"),
    ("dense", {"vocab_size": 2**25}, {"vocab_size": 64}, "vocab_size"),
    ("dense", {"intermediate_size": -1}, {"intermediate_size": 8}, "intermediate_size"),
    ("dense", {"head_dim": 2**21}, {"head_dim": 16}, "head_dim"),
    ("dense", {"rms_norm_eps": 0}, {"rms_norm_eps": 1e-5}, "rms_norm_eps"),
    ("dense", {"rms_norm_eps": "1e-6"}, {"rms_norm_eps": 1e-6}, "rms_norm_eps"),
    ("dense", {"rope_theta": INF}, {"rope_theta": 10**6}, "rope_theta"),
    ("dense", {"rope_theta": -1.0}, {"rope_theta": 5e5}, "rope_theta"),
    ("dense", {"max_position_embeddings": 0}, {"max_position_embeddings": None}, "max_position_embeddings"),
    ("dense", {"max_position_embeddings": -5}, {"max_position_embeddings": 4096}, "max_position_embeddings"),
    ("dense", {"tie_word_embeddings": "false"}, {"tie_word_embeddings": True}, "tie_word_embeddings"),
    ("dense", {"attention_bias": 0}, {"attention_bias": False}, "attention_bias"),
    ("dense", {"architectures": 5}, {"architectures": None}, "architectures"),
    ("dense", {"architectures": [5]}, {"architectures": []}, "architectures"),
    ("dense", {"rope_parameters": 5}, {"rope_parameters": {"rope_theta": 1e4}}, "rope_parameters"),
    ("llama", {"rope_scaling.factor": INF}, {"rope_scaling.factor": 8}, "factor"),
    ("llama", {"rope_scaling.original_max_position_embeddings": 0.5},
     {"rope_scaling.original_max_position_embeddings": 8.0}, "original_max_position_embeddings"),
    ("moe", {"num_experts": 10**6}, {"num_experts": 4}, "num_experts"),
    ("moe", {"num_experts_per_tok": 9}, {"num_experts_per_tok": 8}, "num_experts_per_tok"),
    ("moe", {"mlp_only_layers": [99]}, {"mlp_only_layers": [4]}, "mlp_only_layers[0]"),
    ("moe", {"mlp_only_layers": "1"}, {"mlp_only_layers": [1]}, "mlp_only_layers"),
    ("moe", {"decoder_sparse_step": 0}, {"decoder_sparse_step": 2}, "decoder_sparse_step"),
    ("moe", {"norm_topk_prob": "yes"}, {"norm_topk_prob": False}, "norm_topk_prob"),
    ("drafter", {"dflash_config": 5}, {"dflash_config": {"mask_token_id": 1}}, "dflash_config"),
    ("drafter", {"dflash_config.target_layer_ids": [0, 2.5]}, {"dflash_config.target_layer_ids": [0, 2]},
     "target_layer_ids[1]"),
    ("drafter", {"dflash_config.target_layer_ids": [0, 5]}, {"dflash_config.target_layer_ids": [0, 4]},
     "target_layer_ids[1]"),
    ("drafter", {"dflash_config.target_layer_ids": "0,2"}, {"dflash_config.target_layer_ids": [0, 2]},
     "target_layer_ids"),
    ("drafter", {"dflash_config.mask_token_id": 128}, {"dflash_config.mask_token_id": 0}, "mask_token_id"),
    ("drafter", {"dflash_config.mask_token_id": -1}, {"dflash_config.mask_token_id": 127.0}, "mask_token_id"),
    ("drafter", {"block_size": 10**9}, {"block_size": 4}, "block_size"),
    ("drafter", {"layer_types": "full_attention"}, {"layer_types": ["full_attention"] * 2}, "layer_types"),
    ("drafter", {"use_sliding_window": True, "sliding_window": INF},
     {"use_sliding_window": True, "sliding_window": 8}, "sliding_window"),
    ("drafter", {"dflash_config.shift_label": 1}, {"dflash_config.shift_label": True}, "shift_label"),
    ("drafter", {"dflash_config.input_embedding_scale": NAN}, {"dflash_config.input_embedding_scale": 2},
     "input_embedding_scale"),
    ("hybrid", {"layer_types": 5}, {"layer_types": None}, "layer_types"),
    ("hybrid", {"layer_types": None, "full_attention_interval": 0},
     {"layer_types": None, "full_attention_interval": 2}, "full_attention_interval"),
    ("hybrid", {"linear_num_key_heads": 0}, {"linear_num_key_heads": 4}, "linear_num_key_heads"),
    ("hybrid", {"linear_conv_kernel_dim": 10**6}, {"linear_conv_kernel_dim": 2}, "linear_conv_kernel_dim"),
    ("hybrid", {"rope_parameters.partial_rotary_factor": INF}, {"rope_parameters.partial_rotary_factor": 0.5},
     "partial_rotary_factor"),
    ("hybrid", {"attn_output_gate": "no"}, {"attn_output_gate": True}, "attn_output_gate"),
    ("hybrid", {"text_config": []}, {"text_config": None}, "text_config"),
    ("hybrid_moe", {"shared_expert_intermediate_size": 2.5}, {"shared_expert_intermediate_size": 0},
     "shared_expert_intermediate_size"),
]


def _with(config: dict, fields: dict) -> dict:
    """A deep copy of ``config`` with ``fields`` set (``"a.b"``: field ``b`` of object ``a``)."""
    out = copy.deepcopy(config)
    for path, value in fields.items():
        *parents, key = path.split(".")
        target = out
        for parent in parents:
            target = target[parent]
        target[key] = value
    return out


def _model_dir(tmp_path, config: dict, name: str = "model"):
    path = tmp_path / name
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))  # Infinity / NaN as Python's json writes them
    return path


@pytest.mark.parametrize("base", sorted(BASES))
def test_the_tiny_configs_load(base, tmp_path):
    kind, _, params = convert.abstract_model(_model_dir(tmp_path, BASES[base]))
    assert kind and params is not None


@pytest.mark.parametrize("base, bad, good, name", CASES,
                         ids=[f"{i}-{base}-{name}" for i, (base, _, _, name) in enumerate(CASES)])
def test_a_hostile_field_is_refused_by_name(base, bad, good, name, tmp_path):
    convert.abstract_model(_model_dir(tmp_path, _with(BASES[base], good), "good"))  # control: it can load
    start = time.perf_counter()
    with pytest.raises(ValueError) as refused:
        convert.abstract_model(_model_dir(tmp_path, _with(BASES[base], bad), "bad"))
    assert time.perf_counter() - start < 2.0
    message = str(refused.value)
    assert name in message and "config.json" in message, message


def test_a_billion_layers_are_refused_at_once():
    """Before anything is built per layer; the largest sane depth still reads (instantly, config only)."""
    start = time.perf_counter()
    refusal = r"num_hidden_layers: expected an integer in \[1, 1024\], got 1000000000"
    with pytest.raises(ValueError, match=refusal):
        decoder.config_from_hf(dict(DENSE, num_hidden_layers=10**9))
    assert decoder.config_from_hf(dict(DENSE, num_hidden_layers=1024)).num_layers == 1024
    assert time.perf_counter() - start < 1.0


def test_the_typed_reader_is_what_stops_truncation():
    """Control: the bare ``int()`` the readers used took 2.7 and true as 2 and 1; the typed reader refuses
    them and takes an integral float as the integer it is."""
    assert (int(2.7), int(True)) == (2, 1)
    for value in (2.7, True, "2", INF, NAN, [2]):
        with pytest.raises(ValueError, match="^n: "):
            hf_config.config_int({"n": value}, "n")
    assert hf_config.config_int({"n": 2.0}, "n") == 2 and hf_config.config_int({}, "n", default=None) is None
    with pytest.raises(ValueError, match="f: expected a finite number"):
        hf_config.config_float({"f": 10**400}, "f")
    assert hf_config.config_float({"f": 10**6}, "f", positive=True) == 1e6


def test_the_cli_reports_a_hostile_config_in_one_line(tmp_path, capsys):
    target = _model_dir(tmp_path, dict(DENSE, num_attention_heads=0))
    assert main(["generate", "--target", str(target), "--method", "ar", "--prompt-ids", "1,2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dtree-jax: error: ") and len(err.strip().splitlines()) == 1, err
    assert "config.json" in err and "num_attention_heads: expected an integer in [1, 1024], got 0" in err, err
