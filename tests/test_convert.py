"""HF/PyTorch checkpoint conversion (dtree_jax.convert): readers, key normalisation, validation, orbax, CLI.

Most tests use small fake model modules that follow the model-module contract (``config_from_hf``,
``hf_shapes``, ``params_from_hf``, ``abstract_params``), so the converter is tested independently of the
real models; the last tests use the real modules on checkpoints written by transformers / specforge.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from dtree_jax import convert as cv
from dtree_jax.models import families
from tests import oracles

# ----------------------------------------------------------------------------------------------------------
# Fake model modules


@dataclasses.dataclass(frozen=True)
class FakeConfig:
    drafter: bool
    vocab: int
    dim: int
    inter: int
    layers: int
    tied: bool


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class FakeLayer:
    up: jax.Array  # [D, I]
    down: jax.Array  # [I, D]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class FakeParams:
    first: jax.Array  # target: embedding [V, D]; drafter: fc [2D, D]
    layers: tuple[FakeLayer, ...]
    norm: jax.Array  # [D]
    head: jax.Array  # [D, V] (the embedding's transpose when tied); drafter: [D]


def _fake_module(name: str, drafter: bool) -> types.ModuleType:
    prefix = "" if drafter else "model."

    def config_from_hf(d, **overrides):  # overrides: dtype (unused by the fake)
        projector = d.get("dflash_config", {}).get("projector_type", "domino")
        if projector not in ("domino", "causal_v5"):
            raise ValueError(f"unknown projector_type {projector!r}")
        d = d.get("text_config", d)
        return FakeConfig(
            drafter, d["vocab_size"], d["hidden_size"], d["intermediate_size"], d["num_hidden_layers"],
            d.get("tie_word_embeddings", False),
        )

    def hf_shapes(cfg):
        if drafter:
            shapes = {"fc.weight": (cfg.dim, 2 * cfg.dim)}
        else:
            shapes = {"model.embed_tokens.weight": (cfg.vocab, cfg.dim)}
        for i in range(cfg.layers):
            shapes[f"{prefix}layers.{i}.mlp.up_proj.weight"] = (cfg.inter, cfg.dim)
            shapes[f"{prefix}layers.{i}.mlp.down_proj.weight"] = (cfg.dim, cfg.inter)
        shapes[f"{prefix}norm.weight"] = (cfg.dim,)
        if not drafter and not cfg.tied:
            shapes["lm_head.weight"] = (cfg.vocab, cfg.dim)
        return shapes

    def params_from_hf(cfg, get, dtype):
        # Deliberately reads in a scrambled order (the contract allows any order).
        layers = tuple(
            FakeLayer(
                jnp.asarray(get(f"{prefix}layers.{i}.mlp.up_proj.weight").T, dtype),
                jnp.asarray(get(f"{prefix}layers.{i}.mlp.down_proj.weight").T, dtype),
            )
            for i in reversed(range(cfg.layers))
        )[::-1]
        norm = jnp.asarray(get(f"{prefix}norm.weight"), dtype)
        if drafter:
            return FakeParams(jnp.asarray(get("fc.weight").T, dtype), layers, norm, norm + 1)
        embed = jnp.asarray(get("model.embed_tokens.weight"), dtype)
        head = embed.T if cfg.tied else jnp.asarray(get("lm_head.weight").T, dtype)
        return FakeParams(embed, layers, norm, head)

    def abstract_params(cfg, dtype):
        shapes = hf_shapes(cfg)
        return jax.eval_shape(lambda: params_from_hf(cfg, lambda k: np.zeros(shapes[k], np.float32), dtype))

    module = types.ModuleType(name)
    module.config_from_hf, module.hf_shapes = config_from_hf, hf_shapes
    module.params_from_hf, module.abstract_params = params_from_hf, abstract_params
    return module


@pytest.fixture
def real_models():
    """Requested by tests that use the real model modules instead of the fakes."""


@pytest.fixture(autouse=True)
def fake_models(request, monkeypatch):
    if "real_models" in request.fixturenames:
        return
    for family in list(families.FAMILIES.values()):
        name = f"_fake_dtree_{family.name}"
        monkeypatch.setitem(sys.modules, name, _fake_module(name, drafter=family.drafter))
        monkeypatch.setitem(families.FAMILIES, family.name, dataclasses.replace(family, module=name))


TARGET_CONFIG = {
    "model_type": "qwen3",
    "architectures": ["Qwen3ForCausalLM"],
    "vocab_size": 11,
    "hidden_size": 4,
    "intermediate_size": 6,
    "num_hidden_layers": 2,
    "tie_word_embeddings": False,
    "dtype": "bfloat16",
}
DRAFTER_CONFIG = {
    **TARGET_CONFIG,
    "architectures": ["DFlashDraftModel"],
    "num_hidden_layers": 1,
    "dflash_config": {"projector_type": "domino", "mask_token_id": 10},
}


def _tensors(config: dict, dtype=np.float32, seed: int = 0) -> dict[str, np.ndarray]:
    """Random tensors for every key of the fake model of ``config`` (values exact in bf16)."""
    kind = cv.model_kind(config)
    module = families.module(kind)
    rng = np.random.default_rng(seed)
    shapes = module.hf_shapes(module.config_from_hf(config))
    return {k: (rng.integers(-64, 64, s) / 8).astype(dtype) for k, s in shapes.items()}


def _save(path: Path, tensors: dict[str, np.ndarray], config: dict, fmt: str = "single") -> Path:
    """Writes an HF-style directory: ``single``, ``sharded`` (index), ``glob`` (two unindexed), ``bin``."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    keys = sorted(tensors)
    halves = {"a": {k: tensors[k] for k in keys[::2]}, "b": {k: tensors[k] for k in keys[1::2]}}
    if fmt == "single":
        save_file(tensors, str(path / "model.safetensors"))
    elif fmt == "sharded":
        names = {h: f"model-0000{i + 1}-of-00002.safetensors" for i, h in enumerate(halves)}
        weight_map = {}
        for h, part in halves.items():
            save_file(part, str(path / names[h]))
            weight_map.update({k: names[h] for k in part})
        index = {"metadata": {}, "weight_map": weight_map}
        (path / "model.safetensors.index.json").write_text(json.dumps(index))
    elif fmt == "glob":
        for h, part in halves.items():
            save_file(part, str(path / f"weights-{h}.safetensors"))
    elif fmt in ("bin", "legacy-bin"):
        import torch

        def to_torch(x):
            if x.dtype == ml_dtypes.bfloat16:
                return torch.from_numpy(x.view(np.uint16)).view(torch.bfloat16)
            return torch.from_numpy(x)

        for h, part in halves.items():
            torch.save({k: to_torch(v) for k, v in part.items()}, path / f"pytorch_model-{h}.bin",
                       _use_new_zipfile_serialization=fmt == "bin")
    else:
        raise AssertionError(fmt)
    return path


def _expected(tensors: dict[str, np.ndarray], drafter: bool = False) -> list[np.ndarray]:
    """The fake model's params leaves (in tree order), computed directly in float32."""
    t = {k.removeprefix("model."): np.asarray(v, np.float32) for k, v in tensors.items()}
    n = sum(k.endswith("up_proj.weight") for k in t)
    layers = [t[f"layers.{i}.mlp.{w}_proj.weight"].T for i in range(n) for w in ("up", "down")]
    if drafter:
        return [t["fc.weight"].T, *layers, t["norm.weight"], t["norm.weight"] + 1]
    head = t["lm_head.weight"].T if "lm_head.weight" in t else t["embed_tokens.weight"].T
    return [t["embed_tokens.weight"], *layers, t["norm.weight"], head]


def _assert_leaves(params, expected, dtype=jnp.float32):
    leaves = jax.tree.leaves(params)
    assert len(leaves) == len(expected)
    for got, want in zip(leaves, expected):
        assert got.dtype == dtype
        np.testing.assert_array_equal(np.asarray(got, np.float32), want)


def _assert_same(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))


# ----------------------------------------------------------------------------------------------------------
# Readers, dtypes, key normalisation


@pytest.mark.parametrize("fmt", ["single", "sharded", "glob", "bin", "legacy-bin"])
def test_formats_give_identical_params(tmp_path, fmt):
    tensors = _tensors(TARGET_CONFIG, ml_dtypes.bfloat16)
    kind, cfg, params = cv.load_hf(_save(tmp_path / fmt, tensors, TARGET_CONFIG, fmt), "float32")
    assert kind == "qwen3" and cfg.layers == 2 and isinstance(params, FakeParams)
    _assert_leaves(params, _expected(tensors))


@pytest.mark.parametrize("in_dtype", [ml_dtypes.bfloat16, np.float16, np.float32])
@pytest.mark.parametrize("fmt", ["single", "bin"])
def test_input_dtypes(tmp_path, in_dtype, fmt):
    tensors = _tensors(TARGET_CONFIG, in_dtype, seed=1)
    path = _save(tmp_path, tensors, TARGET_CONFIG, fmt)
    _, _, params = cv.load_hf(path, jnp.float32)
    _assert_leaves(params, _expected(tensors))
    _, _, params = cv.load_hf(path)  # the config's dtype
    _assert_leaves(params, _expected(tensors), jnp.bfloat16)


def test_safetensors_need_no_torch_and_bin_needs_it(tmp_path, monkeypatch):
    tensors = _tensors(TARGET_CONFIG)
    single = _save(tmp_path / "st", tensors, TARGET_CONFIG)
    binary = _save(tmp_path / "bin", tensors, TARGET_CONFIG, "bin")
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` now raises ImportError
    _assert_leaves(cv.load_hf(single, "float32")[2], _expected(tensors))
    with pytest.raises(ValueError, match="needs torch") as e:
        cv.load_hf(binary)
    assert str(binary / "pytorch_model-a.bin") in str(e.value)


def test_drafter_accepts_prefixed_and_bare_keys(tmp_path):
    tensors = _tensors(DRAFTER_CONFIG)
    bare = _save(tmp_path / "bare", tensors, DRAFTER_CONFIG)
    prefixed = _save(tmp_path / "prefixed", {f"model.{k}": v for k, v in tensors.items()}, DRAFTER_CONFIG)
    for path in (bare, prefixed):
        kind, _, params = cv.load_hf(path, "float32")
        assert kind == "drafter"
        _assert_leaves(params, _expected(tensors, drafter=True))


def test_hybrid_language_model_prefix_and_skipped_keys(tmp_path):
    text = {**TARGET_CONFIG, "model_type": "qwen3_5_text"}
    config = {"model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"]}
    config["text_config"] = text
    tensors = _tensors(text, seed=2)
    vl = {k.replace("model.", "model.language_model.", 1): v for k, v in tensors.items()}
    vl["model.visual.blocks.0.attn.qkv.weight"] = np.ones((3, 2), np.float32)
    vl["mtp.fc.weight"] = np.ones((4, 8), np.float32)
    for name, cfg_dict, ckpt in (("plain", text, tensors), ("vl", config, vl)):
        kind, _, params = cv.load_hf(_save(tmp_path / name, ckpt, cfg_dict), "float32")
        assert kind == "qwen3_5"
        _assert_leaves(params, _expected(tensors))


def test_tied_checkpoint_with_equal_lm_head_is_accepted(tmp_path):
    config = {**TARGET_CONFIG, "tie_word_embeddings": True}
    tensors = _tensors(config)
    stored = {**tensors, "lm_head.weight": tensors["model.embed_tokens.weight"].copy()}
    _, cfg, params = cv.load_hf(_save(tmp_path, stored, config), "float32")
    assert cfg.tied
    _assert_leaves(params, _expected(tensors))


# ----------------------------------------------------------------------------------------------------------
# Bad inputs: ValueError naming the file and the key


def _corrupt(what):
    """Mutators ``(path) -> (file, key)`` applied to a saved single-file target checkpoint."""

    def apply(path: Path):
        st = path / "model.safetensors"
        tensors = _tensors(TARGET_CONFIG)
        if what == "missing":
            del tensors["model.layers.1.mlp.up_proj.weight"]
            save_file(tensors, str(st))
            return path, "model.layers.1.mlp.up_proj.weight"
        if what == "unexpected":
            save_file({**tensors, "model.layers.7.mlp.up_proj.weight": np.ones(3, np.float32)}, str(st))
            return st, "model.layers.7.mlp.up_proj.weight"
        if what == "shape":
            save_file({**tensors, "model.norm.weight": np.ones(5, np.float32)}, str(st))
            return st, "model.norm.weight"
        if what == "int_dtype":
            save_file({**tensors, "model.norm.weight": np.ones(4, np.int32)}, str(st))
            return st, "model.norm.weight"
        if what == "tied_mismatch":
            config = {**TARGET_CONFIG, "tie_word_embeddings": True}
            (path / "config.json").write_text(json.dumps(config))
            return st, "lm_head.weight"
        if what == "truncated":
            st.write_bytes(st.read_bytes()[:-10])
            return st, "truncated or corrupt"
        if what == "corrupt_header":
            st.write_bytes(b"\xff" * 8 + st.read_bytes()[8:])
            return st, "truncated or corrupt"
        if what == "truncated_bin":
            st.unlink()
            _save(path, tensors, TARGET_CONFIG, "bin")
            binary = path / "pytorch_model-a.bin"
            binary.write_bytes(binary.read_bytes()[:200])
            return binary, "truncated or corrupt"
        if what == "missing_shard":
            st.unlink()
            _save(path, tensors, TARGET_CONFIG, "sharded")
            (path / "model-00002-of-00002.safetensors").unlink()
            return path / "model.safetensors.index.json", "model-00002-of-00002.safetensors"
        if what == "model_type":
            (path / "config.json").write_text(json.dumps({**TARGET_CONFIG, "model_type": "mistral"}))
            return path / "config.json", "'mistral'"
        if what == "projector_type":
            config = {**DRAFTER_CONFIG, "dflash_config": {"projector_type": "x"}}
            (path / "config.json").write_text(json.dumps(config))
            return path / "config.json", "projector_type 'x'"
        if what == "no_weights":
            st.unlink()
            return path, "no checkpoint weights"
        raise AssertionError(what)

    return apply


BAD = [
    "missing", "unexpected", "shape", "int_dtype", "tied_mismatch", "truncated", "corrupt_header",
    "truncated_bin", "missing_shard", "model_type", "projector_type", "no_weights",
]


@pytest.mark.parametrize("what", BAD)
def test_bad_input_names_file_and_key(tmp_path, what):
    path = _save(tmp_path / "ckpt", _tensors(TARGET_CONFIG), TARGET_CONFIG)
    file, key = _corrupt(what)(path)
    with pytest.raises(ValueError) as e:
        cv.load_hf(path)
    assert str(file) in str(e.value) and key in str(e.value), str(e.value)


def test_missing_model_module_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setitem(families.FAMILIES, "decoder",
                        dataclasses.replace(families.DENSE, module="dtree_jax.models.not_written_yet"))
    with pytest.raises(ValueError, match="needs dtree_jax.models.not_written_yet"):
        cv.load_hf(_save(tmp_path, _tensors(TARGET_CONFIG), TARGET_CONFIG))


def test_model_kind_detection():
    for t in ("qwen3", "qwen2", "llama"):  # dense: the kind is the model_type, all in one module
        assert cv.model_kind({"model_type": t}) == t
    assert cv.model_kind({"model_type": "qwen3", "architectures": ["DFlashDraftModel"]}) == "drafter"
    assert cv.model_kind({"model_type": "qwen3", "dflash_config": {}}) == "drafter"
    for t in ("qwen3_5", "qwen3_5_text", "qwen3_next"):
        assert cv.model_kind({"model_type": t}) == "qwen3_5"
    with pytest.raises(ValueError, match="cfg.json: unknown model_type 'gpt2'"):
        cv.model_kind({"model_type": "gpt2"}, "cfg.json")


# ----------------------------------------------------------------------------------------------------------
# Conversion to orbax and back


@pytest.fixture
def hf_dirs(tmp_path):
    target = _save(tmp_path / "target", _tensors(TARGET_CONFIG, ml_dtypes.bfloat16), TARGET_CONFIG, "sharded")
    (target / "tokenizer.json").write_text('{"fake": true}')
    (target / "tokenizer_config.json").write_text("{}")
    drafter = _save(tmp_path / "drafter", _tensors(DRAFTER_CONFIG, seed=3), DRAFTER_CONFIG)
    return target, drafter


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_orbax_round_trip_equals_load_hf(tmp_path, hf_dirs, dtype):
    target, drafter = hf_dirs
    out = tmp_path / "out"
    summary = cv.convert(target, drafter, out_dir=out, dtype=dtype, progress=False)
    assert summary["models"] == {"target": "qwen3", "drafter": "drafter"}
    assert summary["keys"] == 7 + 4 and summary["bytes"] > 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["drafter", "out", "target"]  # no temporaries left
    assert (out / "target" / "tokenizer.json").read_text() == '{"fake": true}'
    assert (out / "target" / "config.json").read_text() == (target / "config.json").read_text()
    for role, src in (("target", target), ("drafter", drafter)):
        kind, cfg, params = cv.load_converted(out / role)
        want_kind, want_cfg, want = cv.load_hf(src, dtype)
        assert (kind, cfg) == (want_kind, want_cfg)
        assert isinstance(params, FakeParams)
        _assert_same(params, want)
    # Explicit shardings: one for all leaves, or a matching pytree.
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    _, target_cfg, one = cv.load_converted(out / "target", device)
    abstract = families.module("qwen3").abstract_params(target_cfg, jnp.dtype(dtype))
    _, _, tree = cv.load_converted(out / "target", jax.tree.map(lambda _: device, abstract))
    _assert_same(one, tree)
    assert all(x.sharding == device for x in jax.tree.leaves(tree))


def test_load_model_accepts_converted_and_hf_dirs(tmp_path, hf_dirs):
    target, _ = hf_dirs
    out = tmp_path / "out"
    cv.convert(target, out_dir=out, progress=False)
    assert not (out / "drafter").exists()
    _, _, converted = cv.load_model(out / "target")
    _, _, direct = cv.load_model(target)  # config dtype: bfloat16
    _assert_same(converted, direct)
    _, _, cast = cv.load_model(out / "target", "float32")
    _assert_leaves(cast, [np.asarray(x, np.float32) for x in jax.tree.leaves(direct)])
    with pytest.raises(ValueError, match="a conversion output; pass"):
        cv.load_model(out)
    with pytest.raises(ValueError, match="neither a converted model"):
        cv.load_model(tmp_path)


def test_failed_conversion_leaves_out_dir_untouched(tmp_path, hf_dirs):
    target, drafter = hf_dirs
    (drafter / "model.safetensors").write_bytes((drafter / "model.safetensors").read_bytes()[:-10])
    fresh = tmp_path / "fresh"
    with pytest.raises(ValueError, match="truncated"):
        cv.convert(target, drafter, out_dir=fresh, progress=False)
    assert not fresh.exists()

    existing = tmp_path / "existing"
    existing.mkdir()
    (existing / "keep.txt").write_text("old")
    with pytest.raises(ValueError, match="overwrite"):
        cv.convert(target, out_dir=existing, progress=False)
    with pytest.raises(ValueError, match="truncated"):
        cv.convert(target, drafter, out_dir=existing, overwrite=True, progress=False)
    with pytest.raises(ValueError, match="cannot be the drafter"):
        cv.convert(target, target, out_dir=existing, overwrite=True, progress=False)
    assert [p.name for p in existing.iterdir()] == ["keep.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["drafter", "existing", "target"]

    cv.convert(target, out_dir=existing, overwrite=True, progress=False)
    assert sorted(p.name for p in existing.iterdir()) == ["target"]


def test_cli_end_to_end(tmp_path, hf_dirs, capsys):
    from dtree_jax.cli import main

    target, drafter = hf_dirs
    out = tmp_path / "out"
    argv = ["convert", "--target", str(target), "--drafter", str(drafter), "--out", str(out), "--no-progress"]
    assert main([*argv, "--dtype", "float32"]) == 0
    line = capsys.readouterr().out.strip()
    assert "\n" not in line and "11 keys" in line and "target (qwen3) + drafter to" in line, line
    _, _, params = cv.load_converted(out / "drafter")
    assert jax.tree.leaves(params)[0].dtype == jnp.float32
    assert main(argv) == 2  # one line, no traceback
    assert "overwrite" in capsys.readouterr().err
    assert main([*argv, "--overwrite"]) == 0
    _, _, params = cv.load_converted(out / "drafter")
    assert jax.tree.leaves(params)[0].dtype == jnp.bfloat16


# ----------------------------------------------------------------------------------------------------------
# Real model modules on checkpoints written by transformers / the reference drafter packages


@pytest.mark.parametrize("tie", [False, True])
def test_real_qwen3_checkpoints(tmp_path, tie, real_models):
    import torch

    from dtree_jax.models import decoder

    model, _ = oracles.tiny_qwen3(tie, seed=5)
    single, sharded, binary = tmp_path / "single", tmp_path / "sharded", tmp_path / "bin"
    model.save_pretrained(single)
    model.save_pretrained(sharded, max_shard_size="100KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    binary.mkdir()
    shutil.copy(single / "config.json", binary / "config.json")
    torch.save(model.state_dict(), binary / "pytorch_model.bin")  # tied: also stores lm_head.weight
    cfg = decoder.config_from_hf(cv.read_config(single), dtype="float32")
    want = decoder.params_from_hf(cfg, oracles.StateGetter(model), jnp.float32)
    for path in (single, sharded, binary):
        kind, got_cfg, params = cv.load_hf(path, "float32")
        assert (kind, got_cfg) == ("qwen3", cfg)
        _assert_same(params, want)
    cv.convert(sharded, out_dir=tmp_path / "out", progress=False)
    kind, got_cfg, restored = cv.load_converted(tmp_path / "out" / "target")
    assert (kind, got_cfg) == ("qwen3", dataclasses.replace(cfg, dtype="bfloat16")) and isinstance(restored, decoder.DecoderParams)
    _assert_same(restored, cv.load_hf(single, "bfloat16")[2])


def test_real_domino_drafter_checkpoint(tmp_path, real_models):
    from dtree_jax.models import drafter

    domino, _, _ = oracles.tiny_domino(shift_label=True, seed=6)
    target, _ = oracles.tiny_qwen3(False, seed=7)
    domino.save_pretrained(tmp_path / "drafter")
    target.save_pretrained(tmp_path / "target")
    cfg = drafter.config_from_hf(cv.read_config(tmp_path / "drafter"), dtype="float32")
    want = drafter.params_from_hf(cfg, oracles.StateGetter(domino), jnp.float32)
    kind, got_cfg, params = cv.load_hf(tmp_path / "drafter", "float32")
    assert (kind, got_cfg) == ("drafter", cfg) and cfg.has_head
    _assert_same(params, want)
    summary = cv.convert(tmp_path / "target", tmp_path / "drafter", out_dir=tmp_path / "out", dtype="float32")
    assert summary["models"] == {"target": "qwen3", "drafter": "drafter"}
    _assert_same(cv.load_converted(tmp_path / "out" / "drafter")[2], want)


# ----------------------------------------------------------------------------------------------------------
# Hostile and careless input: nothing lost, nothing read from outside the checkpoint


def _listing(root):
    return sorted((str(p.relative_to(root)), p.stat().st_size) for p in root.rglob("*"))


@pytest.mark.parametrize("where", ["same", "parent"])
def test_overwrite_never_deletes_the_inputs(tmp_path, hf_dirs, where):
    target, drafter = hf_dirs
    before = _listing(tmp_path)
    out = target if where == "same" else tmp_path
    with pytest.raises(ValueError, match="holds the input"):
        cv.convert(target, drafter, out_dir=out, overwrite=True, progress=False)
    assert _listing(tmp_path) == before


def test_an_index_entry_leading_out_of_the_checkpoint_is_refused(tmp_path, hf_dirs):
    target, drafter = hf_dirs
    index = target / "model.safetensors.index.json"
    d = json.loads(index.read_text())
    key = next(iter(d["weight_map"]))
    for name in ("../drafter/model.safetensors", str((drafter / "model.safetensors").resolve())):
        d["weight_map"][key] = name
        index.write_text(json.dumps(d))
        with pytest.raises(ValueError, match="outside the checkpoint"):
            cv.convert(target, out_dir=tmp_path / "out", progress=False)
        assert not (tmp_path / "out").exists()


def test_a_symlink_leading_out_is_not_copied(tmp_path, hf_dirs):
    target, _ = hf_dirs
    secret = tmp_path / "secret.txt"
    secret.write_text("not yours")
    (target / "tokenizer_config.json").unlink()
    (target / "tokenizer_config.json").symlink_to(secret)
    with pytest.raises(ValueError, match="outside the checkpoint"):
        cv.convert(target, out_dir=tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()
    assert not any("not yours" in p.read_text(errors="ignore") for p in tmp_path.rglob("*") if p.is_file()
                   and not p.is_symlink() and p != secret)


def test_a_fifo_instead_of_weights_is_refused_without_hanging(tmp_path, hf_dirs):
    import os

    _, drafter = hf_dirs
    (drafter / "model.safetensors").unlink()
    os.mkfifo(drafter / "model.safetensors")
    with pytest.raises(ValueError, match="not a regular file"):
        cv.load_hf(drafter, progress=False)


def test_output_honours_the_umask_and_keeps_the_calibration(tmp_path, hf_dirs):
    import os
    import stat

    target, drafter = hf_dirs
    (drafter / "calibration.json").write_text('{"tau_by_budget": {}}')
    old = os.umask(0o022)
    try:
        cv.convert(target, drafter, out_dir=tmp_path / "out", progress=False)
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "out").stat().st_mode) == 0o755
    assert (tmp_path / "out" / "drafter" / "calibration.json").read_text() == '{"tau_by_budget": {}}'


def test_an_interrupted_conversion_leaves_nothing(tmp_path, hf_dirs, monkeypatch):
    target, drafter = hf_dirs
    real = cv.read_params
    calls = []

    def interrupted(*a, **k):
        calls.append(1)
        if len(calls) == 2:  # the drafter, after the target was written into the temporary directory
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(cv, "read_params", interrupted)
    with pytest.raises(KeyboardInterrupt):
        cv.convert(target, drafter, out_dir=tmp_path / "out", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["drafter", "target"]  # no .partial-*, no out


def test_stale_partials_of_dead_conversions_are_removed(tmp_path, hf_dirs):
    import os

    target, _ = hf_dirs
    dead = tmp_path / ".out.partial-999999999-abc"  # no such process
    (dead / "target").mkdir(parents=True)
    alive = tmp_path / f".out.partial-{os.getpid()}-def"  # a conversion still running (this process)
    alive.mkdir()
    cv.convert(target, out_dir=tmp_path / "out", progress=False)
    assert not dead.exists() and alive.exists()
