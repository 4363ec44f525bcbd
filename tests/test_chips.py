"""Compiled for the chips: the whole generation and every claimed kernel configuration compiled on this CPU by a
TPU's compiler (XLA:TPU + Mosaic, libtpu's compile-only topologies) and an H200's (XLA:GPU + Triton + ptxas, a
deviceless target config), through ``dtree_jax.aot`` and ``dtree-jax compile``.

Compiling is what catches what lowering (tests/test_lowering.py) does not: tiling, VMEM / shared-memory budgets,
layouts, HBM fit.  The controls show these tests can fail: a kernel over its on-chip limit and a generation over
the chip's HBM are refused.  Tiny random configs, abstract params (nothing runs)."""

import dataclasses
import json
import re

import jax
import pytest

from dtree_jax import aot, builders, chips
from dtree_jax.cli import main
from tests.test_lowering import DENSE, DRAFTER, HYBRID, _models, expected_kernels

GIB = 2**30
CHIPS = {"tpu": "v5e-1", "gpu": "h200"}  # a TPU generation and an sm_90 GPU
KIND = {"tpu": "mosaic", "gpu": "triton"}


@pytest.mark.parametrize("name, platform, devices, topology, memory", [
    ("v5e-1", "tpu", 1, "v5e:1x1", 16 * GIB), ("v5e-4", "tpu", 4, "v5e:2x2", 16 * GIB),
    ("v6e-8", "tpu", 8, "v6e:2x4", 32 * GIB), ("v5p-8", "tpu", 4, "v5p:2x2x1", 95 * GIB),
    ("v4-8", "tpu", 4, "v4:2x2x1", 32 * GIB), ("h200", "gpu", 1, "1x1x1", 151397597184),
    ("H100-8", "gpu", 8, "1x1x8", 84942979072),
])
def test_chip_names(name, platform, devices, topology, memory):
    chip = chips.get(name)
    assert (chip.platform, chip.num_devices, chip.topology, chip.memory_bytes) == (platform, devices, topology, memory)
    assert len(chips.devices(chip)) == devices


def test_gpu_devices_are_the_spec_files_gpus():
    kinds = {name: chips.devices(chips.get(name))[0].device_kind for name in ("h100", "h200")}
    assert kinds == {"h100": "NVIDIA H100 80GB HBM3", "h200": "NVIDIA H200"}


@pytest.mark.parametrize("name, words", [("v5e-3", "v5e slices are v5e-1, v5e-4"), ("v5p-4", "v5p slices"),
                                         ("v7x-4", "known forms"), ("h300", "known forms"),
                                         ("h200-9", "1 to 8 GPUs"), ("", "known forms")])
def test_unknown_chip_is_one_clear_line(name, words):
    with pytest.raises(ValueError, match=words) as e:
        chips.get(name)
    assert "\n" not in str(e.value)


def _report_matches(report, target, draft, method, platform):
    want = sum(expected_kernels(target, draft, method, platform).values())
    assert report.fits, report.summary()
    assert report.kernel_calls == {KIND[platform]: want}
    assert report.memory["argument"] > 0 and report.needed <= report.memory_limit
    assert set(report.seconds) == {"trace", "lower", "compile"}


@pytest.mark.parametrize("platform", ["tpu", "gpu"])
@pytest.mark.parametrize("target_kind", ["qwen3", "qwen3_5"])
@pytest.mark.parametrize("method", tuple(builders.REGISTRY))
def test_every_method_compiles_for_the_chip(method, target_kind, platform):
    """Every method's whole generation (prefill + while_loop) with the chip's kernels, dense and hybrid, bf16."""
    target, draft = _models(target_kind, "bfloat16")
    report = aot.compile_for(target, draft, method, CHIPS[platform], batch=2, budget=6, max_new_tokens=8)
    _report_matches(report, target, draft, method, platform)


@pytest.mark.parametrize("platform", ["tpu", "gpu"])
@pytest.mark.parametrize("target_kind", ["qwen3", "qwen3_5"])
def test_fp32_dominotree_compiles(target_kind, platform):
    target, draft = _models(target_kind, "float32")
    report = aot.compile_for(target, draft, "dominotree", CHIPS[platform], batch=2, budget=6, max_new_tokens=8)
    _report_matches(report, target, draft, "dominotree", platform)
    assert report.dtype == "float32"


@pytest.mark.parametrize("target_kind", ["qwen3", "qwen3_5"])
def test_slice_with_the_model_axis_over_four_chips(target_kind):
    """A v5e-4 slice, heads split over 4 chips: the kernels run per shard (shard_map) and still compile."""
    target, draft = _models(target_kind, "bfloat16")
    report = aot.compile_for(target, draft, "dominotree", "v5e-4", batch=2, budget=6, max_new_tokens=8)
    assert report.mesh == {"data": 1, "model": 4}
    _report_matches(report, target, draft, "dominotree", "tpu")


@pytest.mark.parametrize("platform", ["tpu", "gpu"])
def test_a_generation_over_the_chips_memory_is_refused_in_one_line(platform):
    """The control for fit: the tiny target's KV cache is 768 B per row and request; 64 requests x 512K rows
    (24 GiB) on one v5e (16 GiB: the TPU compiler refuses it), x 2M rows (96 GiB) against an H100's 79 GiB (our
    check of the compiled sizes)."""
    target, draft = _models("qwen3", "bfloat16")
    chip, rows = ("v5e-1", 2**19) if platform == "tpu" else ("h100", 2**21)
    report = aot.compile_for(target, None, "ar", chip, batch=64, cache_len=rows, max_new_tokens=8)
    assert not report.fits
    assert "\n" not in report.error and "memory" in report.error.lower()
    assert "batch" in report.hint and "cache_len" in report.hint
    assert "does not fit" in report.summary().splitlines()[-1]


# ----------------------------------------------------------------------------------------------------------
# Kernels


def _each_value_once(configs):
    """Per kernel, head size and dtype: every budget once, the (context, batch) pairs taken in turn, so every
    value of the matrix is compiled and the largest budget meets the largest context and batch."""
    m = aot.KERNEL_MATRIX
    pairs = [(c, b) for c in m["contexts"] for b in m["batches"]]
    keep = []
    for c in configs:
        i = m["budgets"].index(c.nodes - 1)
        want = (0, m["batches"][i % len(m["batches"])]) if c.kernel == "tree_gdn" else pairs[i % len(pairs)]
        if (c.context, c.batch) == want:
            keep.append(c)
    return keep


@pytest.mark.parametrize("platform", ["tpu", "gpu"])
@pytest.mark.parametrize("whole", [pytest.param(False, id="each-value"),
                                   pytest.param(True, id="whole-matrix", marks=pytest.mark.slow)])
def test_every_claimed_kernel_configuration_compiles(platform, whole):
    """The README's kernel matrix (experiments/compile_kernels.py: head sizes, dtypes, contexts 4K / 32K, budgets
    4-128, batch 1 and 8) for one TPU generation and sm_90, each configuration compiled on its own: every value
    of every axis by default (a quarter of the matrix), the whole matrix with ``-m slow``."""
    configs = aot.kernel_configs(platform)
    assert len(configs) == (112 if platform == "tpu" else 96)
    if not whole:
        configs = _each_value_once(configs)
        assert len(configs) == (32 if platform == "tpu" else 24)
        assert (129, 32768, 8) in {(c.nodes, c.context, c.batch) for c in configs}
    groups = {}  # one program per kernel, head size and dtype
    for c in configs:
        groups.setdefault((c.kernel, c.head_dim, c.dtype), []).append(c)
    refused = [(c, row["error"]) for group in groups.values()
               for c, row in zip(group, aot.compile_kernels(group, CHIPS[platform])) if not row["compiles"]]
    assert not refused


@pytest.mark.parametrize("platform", ["tpu", "gpu"])
def test_a_kernel_over_its_onchip_limit_is_refused(platform):
    """The control for the kernel compiles: the same tree-attention call under a 1 KiB VMEM / shared-memory
    limit fails to compile, and ``compile_kernel`` reads its real on-chip need from those refusals."""
    config = aot.KernelConfig("tree_attention", "bfloat16", 17, 1, 128, 4096)
    chip = chips.get(CHIPS[platform])
    options = dict(shared_memory_limit=1024) if platform == "gpu" else {}
    rep = jax.sharding.NamedSharding(chips.mesh(chip, 1, 1, **options), jax.sharding.PartitionSpec())
    fn = jax.jit(config.function(platform, 1024 if platform == "tpu" else None))
    with pytest.raises(jax.errors.JaxRuntimeError, match="(?i)vmem|shared memory"):
        fn.lower(*config.abstract_args(rep)).compile()
    row = aot.compile_kernel(config, chip)
    assert row["compiles"] and 16 * 1024 < row["onchip_bytes"] < 16 * 2**20


def test_a_refused_kernel_in_a_group_is_named(monkeypatch):
    """``compile_kernels`` (the matrix test's grouped compile) reports exactly the configuration refused."""
    group = [aot.KernelConfig("tree_attention", "bfloat16", n, 1, 128, 4096) for n in (5, 17, 33)]
    real = aot.KernelConfig.function
    monkeypatch.setattr(aot.KernelConfig, "function",
                        lambda self, platform, limit=None: real(self, platform, 1024 if self.nodes == 17 else limit))
    rows = aot.compile_kernels(group, "v5e-1")
    assert [r["compiles"] for r in rows] == [True, False, True]
    assert "vmem" in rows[1]["error"].lower()


# ----------------------------------------------------------------------------------------------------------
# The command line, from config.json files alone


@pytest.fixture(scope="module")
def configs(tmp_path_factory):
    root = tmp_path_factory.mktemp("configs")
    paths = {}
    for name, cfg in (("dense", dict(DENSE, torch_dtype="bfloat16")), ("hybrid", dict(HYBRID, dtype="bfloat16")),
                      ("drafter", dict(DRAFTER, torch_dtype="bfloat16"))):
        (root / name).mkdir()
        (root / name / "config.json").write_text(json.dumps(cfg))
        paths[name] = root / name
    return paths


def test_cli_compiles_from_config_files(configs, capsys):
    args = ["compile", "--chip", "v5e-4", "--target", str(configs["dense"] / "config.json"), "--drafter",
            str(configs["drafter"]), "--prompt-bucket", "16", "--max-new-tokens", "16", "--budget", "6", "--json"]
    assert main(args) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["fits"] and report["method"] == "dominotree" and report["dtype"] == "bfloat16"
    assert report["mesh"] == {"data": 1, "model": 4} and report["kernel_calls"] == {"mosaic": 2 * 3 + 2}
    assert main(["compile", "--chip", "h200", "--target", str(configs["hybrid"]), "--prompt-bucket", "16",
                 "--max-new-tokens", "16"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"ar on h200 .*\n.*compile [\d.]+ s\n  kernel calls: triton 2\n.*GiB\n  fits", out), out


@pytest.mark.parametrize("extra, words", [
    (["--chip", "v5e-5"], "unknown chip 'v5e-5'"),
    (["--chip", "v5e-4", "--mesh", "data=2,model=4"], "needs 8 devices; v5e-4 has 4"),
    (["--chip", "v5e-4", "--mesh", "pipe=2"], "bad mesh"),
    (["--chip", "h200", "--target", "{drafter}"], "is a DFlash/Domino drafter, not a target model"),
    (["--chip", "h200", "--target", "{readme}"], "expected a config.json file, a model directory or a .gguf file"),
    (["--chip", "h200", "--target", "{mamba}"], "unknown model_type 'mamba'"),
    (["--chip", "h200", "--budget", "0"], "budget must be a positive integer"),
])
def test_cli_bad_input_is_one_line(configs, tmp_path, capsys, extra, words):
    (tmp_path / "mamba").mkdir()
    (tmp_path / "mamba" / "config.json").write_text(json.dumps(dict(model_type="mamba")))
    (tmp_path / "README.md").write_text("not a model")
    names = dict(drafter=configs["drafter"], readme=tmp_path / "README.md", mamba=tmp_path / "mamba")
    args = ["compile", "--target", str(configs["dense"])] + [a.format(**names) for a in extra]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("dtree-jax: error: ") and words in err[-1], err


def test_cli_does_not_fit_exits_1_with_one_line(configs, capsys):
    args = ["compile", "--chip", "h100", "--target", str(configs["dense"]), "--batch", "64", "--cache-len",
            str(2**21), "--max-new-tokens", "8", "--prompt-bucket", "16"]
    assert main(args) == 1
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert re.fullmatch(r"  does not fit: needs [\d.]+ GiB of memory per device, h100 has 79\.1 GiB; lower batch, .*", last)


def test_compile_for_takes_loaded_models_and_dataclass_copies():
    """A loaded ``api.Model`` (concrete params) compiles by its shapes alone; nothing is placed anywhere."""
    from dtree_jax import api
    from dtree_jax.cli import SHIPPED_TINY, shipped

    target, draft = (api.load_model(shipped(n)) for n in SHIPPED_TINY)
    report = aot.compile_for(target, draft, "ddtree", "h200", budget=4, max_new_tokens=8)
    assert report.fits and report.dtype == "float32" and report.kernel_calls == {"triton": 9}
    assert dataclasses.replace(report, error="x").fits is False
