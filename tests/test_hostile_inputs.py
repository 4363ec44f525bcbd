"""Hostile checkpoints and flags (issue 28): every file a command reads from a checkpoint stays inside it
(``dtree_jax.checkpoint_files``), prompts and the memory check are bounded, every error caused by input is one
line (exit 2) while a genuine bug keeps its traceback, and concurrent conversions never replace or swap a
directory under another process.  Each probe comes with the control that the defect is real."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dtree_jax import api, checkpoint_files, cli, convert
from dtree_jax.cli import SHIPPED_TINY, main, shipped

SECRET = "root:x:0:0:secret-outside-the-checkpoint"


@pytest.fixture
def tiny(tmp_path):
    """A copy of the shipped tiny target (HF directory: config, safetensors, tokenizer) and a secret file
    outside it."""
    target = tmp_path / "target"
    shutil.copytree(shipped(SHIPPED_TINY[0]), target)
    secret = tmp_path / "secret.txt"
    secret.write_text(SECRET)
    return target, secret


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("dtree-jax: error: "), err
    return err[0]


@pytest.mark.parametrize("name", ["chat_template.jinja", "tokenizer_config.json", "generation_config.json",
                                  "tokenizer.json", "config.json"])
def test_generate_never_reads_through_a_symlink_out_of_the_checkpoint(tiny, name, capsys):
    target, secret = tiny
    (target / name).unlink(missing_ok=True)
    (target / name).symlink_to(secret)
    assert (target / name).read_text() == SECRET  # control: the link really leads to the secret
    code = main(["generate", "--target", str(target), "--method", "ar", "--chat", "--prompt", "hi",
                 "--max-new-tokens", "2"])
    out = capsys.readouterr()
    assert code == 2 and SECRET not in out.out + out.err
    line = out.err.strip().splitlines()
    assert len(line) == 1 and "outside the checkpoint" in line[0] and name in line[0]


def test_a_link_inside_the_checkpoint_is_still_read(tiny):
    target, _ = tiny
    (target / "templates").mkdir()
    (target / "templates" / "chat.jinja").write_text("{% for m in messages %}<{{ m.content }}>{% endfor %}")
    (target / "chat_template.jinja").symlink_to(target / "templates" / "chat.jinja")
    from dtree_jax.text import render_chat

    assert render_chat(target, [{"role": "user", "content": "hi"}]) == "<hi>"


def test_an_index_symlinked_out_is_refused(tiny, tmp_path):
    target, _ = tiny
    elsewhere = tmp_path / "index.json"
    elsewhere.write_text(json.dumps({"weight_map": {"model.embed_tokens.weight": "model.safetensors"}}))
    (target / "model.safetensors.index.json").symlink_to(elsewhere)
    with pytest.raises(ValueError, match="outside the checkpoint"):
        convert.load_model(target)


def test_a_converted_directory_whose_params_lead_out_is_refused(tiny, tmp_path):
    target, _ = tiny
    convert.convert(target, out_dir=tmp_path / "out", dtype="float32", progress=False)
    convert.load_model(tmp_path / "out" / "target")  # control: the conversion itself loads
    other = tmp_path / "other"
    convert.convert(target, out_dir=other, dtype="float32", progress=False)
    params = tmp_path / "out" / "target" / "params"
    shutil.rmtree(params)
    params.symlink_to(other / "target" / "params")
    with pytest.raises(ValueError, match="outside the checkpoint"):
        convert.load_model(tmp_path / "out" / "target")


def test_a_link_out_from_inside_the_params_is_refused(tiny, tmp_path):
    target, secret = tiny
    convert.convert(target, out_dir=tmp_path / "out", dtype="float32", progress=False)
    params = tmp_path / "out" / "target" / "params"
    victim = next(p for p in params.rglob("*") if p.is_file())
    victim.unlink()
    victim.symlink_to(secret)
    with pytest.raises(ValueError, match="outside the checkpoint"):
        convert.load_model(tmp_path / "out" / "target")


def test_checkpoint_json_is_size_capped_and_depth_safe(tmp_path):
    (tmp_path / "deep.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(RecursionError):  # control: the plain parser fails with a traceback-only error
        json.loads((tmp_path / "deep.json").read_text())
    with pytest.raises(ValueError, match="nested too deep"):
        checkpoint_files.read_json(tmp_path, "deep.json", expect=list)
    with open(tmp_path / "big.json", "wb") as f:
        f.truncate(checkpoint_files.JSON_LIMIT + 1)
    with pytest.raises(ValueError, match="larger than"):
        checkpoint_files.read_json(tmp_path, "big.json")
    (tmp_path / "list.json").write_text("[1]")
    with pytest.raises(ValueError, match="expected a JSON object, got array"):
        checkpoint_files.read_json(tmp_path, "list.json")


@pytest.mark.parametrize("value", [[None], ["2"], True, -1])
def test_bad_eos_ids_are_one_line(tiny, value):
    target, _ = tiny
    (target / "generation_config.json").write_text(json.dumps({"eos_token_id": value}))
    with pytest.raises(ValueError, match="eos_token_id must be a token id"):
        api.load_model(target)


@pytest.mark.parametrize("device", ["/dev/zero", "/dev/urandom"])
def test_prompts_file_from_a_device_is_bounded(device, capsys):
    start = time.perf_counter()
    code = main(["generate", "--target", shipped(SHIPPED_TINY[0]), "--method", "ar", "--prompts-file", device])
    assert code == 2 and time.perf_counter() - start < 10
    assert "more than 4 MiB" in _one_error_line(capsys)


def test_the_memory_check_covers_the_prefill(tiny, capsys):
    target, _ = tiny
    config = json.loads((target / "config.json").read_text())
    del config["max_position_embeddings"]
    (target / "config.json").write_text(json.dumps(config))
    model = api.load_model(target)
    spec = api.make_spec(model, None, "ar", budget=1, node_topk=8, corr_topm=None, max_depth=None,
                         max_new_tokens=4, prompt_bucket=40_000, stop_ids=(), top_k=0, top_p=1.0)
    assert sum(api.memory_estimate(spec, model, None, 1).values()) < 2**30  # control: the old estimate passes
    assert api.memory_estimate(spec, model, None, 1, prompt_bucket=40_000)["prefill"] > 70 * 2**30
    ids = ",".join(["65"] * 40_000)
    assert main(["generate", "--target", str(target), "--method", "ar", "--prompt-ids", ids,
                 "--max-new-tokens", "4"]) == 2
    line = _one_error_line(capsys)
    assert "prefill" in line and "prompt length" in line


def test_device_out_of_memory_is_one_line_and_a_bug_keeps_its_traceback(monkeypatch, capsys):
    import jax

    def oom(args):
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 84610891776 bytes.\nmore")

    monkeypatch.setattr(cli, "run_generate", oom)
    assert main(["generate", "--method", "ar"]) == 2
    assert "out of device memory (RESOURCE_EXHAUSTED" in _one_error_line(capsys)
    with pytest.raises(jax.errors.JaxRuntimeError):
        main(["--debug", "generate", "--method", "ar"])

    def bug(args):
        raise KeyError("a genuine bug")

    monkeypatch.setattr(cli, "run_generate", bug)
    with pytest.raises(KeyError):  # not input: the traceback stays
        main(["generate", "--method", "ar"])


@pytest.mark.parametrize("seed", ["100000000000000000000000", "4294967296", "-1"])
def test_seeds_out_of_range_are_one_line(seed, capsys):
    with pytest.raises(SystemExit) as e:
        main(["generate", "--method", "ar", "--seed", seed])
    assert e.value.code == 2 and "--seed: must be an integer from 0 to 2**32 - 1" in capsys.readouterr().err
    with pytest.raises(ValueError, match="seed must be an integer from 0"):
        api.generate(shipped(SHIPPED_TINY[0]), [[1, 2]], "ar", seed=int(seed), max_new_tokens=1)


def test_convert_into_a_symlink_with_overwrite_replaces_its_target(tiny, tmp_path, capsys):
    target, _ = tiny
    real = tmp_path / "disk" / "conv"
    real.mkdir(parents=True)
    (real / "old.txt").write_text("previous conversion")
    link = tmp_path / "conv-link"
    link.symlink_to(real)
    assert main(["convert", "--target", str(target), "--out", str(link), "--overwrite", "--no-progress"]) == 0
    assert "converted" in capsys.readouterr().out
    assert link.is_symlink() and (link / "target" / convert.META_FILE).is_file() and not (real / "old.txt").exists()
    assert not [p for p in (*tmp_path.iterdir(), *real.parent.iterdir()) if ".partial-" in p.name]


def _python(code: str) -> subprocess.Popen:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)


def _wait_for(proc: subprocess.Popen, text: str, timeout: float = 120) -> str:
    """Reads ``proc``'s stderr until ``text`` appears (the process is then blocked on the lock)."""
    seen, deadline = "", time.monotonic() + timeout
    while text not in seen and time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line and proc.poll() is not None:
            break
        seen += line
    assert text in seen, seen
    return seen


def test_a_second_conversion_into_one_out_waits_then_refuses(tiny, tmp_path):
    target, _ = tiny
    out = tmp_path / "out"
    with convert.destination_lock(out):  # this process is the first conversion, still running
        proc = _python(f"import sys; from dtree_jax import cli; sys.exit(cli.main(['convert', '--target', "
                       f"{str(target)!r}, '--out', {str(out)!r}, '--no-progress']))")
        _wait_for(proc, "waiting for another dtree-jax process")
        convert._convert_into(out, target, None, "float32", False)  # the first one installs its result
        first = (out / "target" / convert.META_FILE).stat().st_ino
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2 and "exists and is not an empty directory" in err.strip().splitlines()[-1]
    assert (out / "target" / convert.META_FILE).stat().st_ino == first  # nothing replaced


def test_concurrent_first_runs_of_a_gguf_convert_it_once(tmp_path, monkeypatch):
    from dtree_jax.gguf import smollm2_gguf

    gguf = str(smollm2_gguf())
    monkeypatch.setenv("DTREE_JAX_CACHE", str(tmp_path / "cache"))
    key_dir = convert.model_dir(gguf, weights=False).with_name(
        convert.model_dir(gguf, weights=False).name.removesuffix("-files"))
    with convert.destination_lock(key_dir):  # a first run converting
        proc = _python(f"from dtree_jax import convert; print(convert.model_dir({gguf!r}, progress=False))")
        _wait_for(proc, "waiting for another dtree-jax process")
        (key_dir / "target").mkdir(parents=True)
        (key_dir / "target" / convert.META_FILE).write_text('{"kind": "llama", "dtype": "float32"}')
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert out.strip() == str(key_dir / "target") and "converting" not in err  # reused, not converted again


def test_a_load_waits_while_its_directory_is_being_written(tiny, tmp_path):
    target, _ = tiny
    out = tmp_path / "out"
    convert.convert(target, out_dir=out, dtype="float32", progress=False)
    with convert.destination_lock(out):  # a conversion with --overwrite swapping it
        proc = _python(f"from dtree_jax import convert; convert.load_model({str(out / 'target')!r}); print('ok')")
        _wait_for(proc, "waiting for another dtree-jax process writing")
    stdout, err = proc.communicate(timeout=120)
    assert proc.returncode == 0 and stdout.strip() == "ok", err


def test_a_checkpoint_path_that_is_the_users_own_file_still_works(tmp_path):
    """Reading a config.json named directly (aot) confines to its own folder, not to the current directory."""
    cfg = tmp_path / "mine.json"
    cfg.write_text(Path(shipped(SHIPPED_TINY[0]), "config.json").read_text())
    assert convert.read_config(cfg)["model_type"] == "qwen3"
