"""Held-out tau of SmolLM2 drafters side by side: the stage gate of experiments/train_smollm2.py (a stage ships
only when it beats the shipped drafter here).

    python experiments/eval_drafter.py checkpoints/smollm2-domino ~/.cache/dtree-jax/smollm2-domino-s3
    python experiments/eval_drafter.py DIR ... --budgets 4,8 --prompts 20 --max-new-tokens 64
    python experiments/eval_drafter.py DIR --calibrate   # tau per budget into DIR/calibration.json

Every drafter runs DominoTree on the same held-out prompts (experiments/results/smollm2_heldout_prompts.json,
from standard-library files no training prompt came from; the first ``--prompts`` of them, as the experiments
use), greedy, all prompts in one batch (each row builds its own trees; a set's tau is its rows' generated tokens
after the root over their rounds), plus the main job's default request and a plain code continuation.  tau is
reported for the chat prompts, the continuation (code) prompts and all of them.  Writes
experiments/results/eval_drafter.json and prints a markdown table.

``--calibrate`` instead measures the drafter's tau per budget (4, 8, 16, 32) on the calibration prompts, the
held-out prompts after the gate's (``--prompts`` .. ``--prompts + 4``, so the gate's prompts are not the ones
``--budget auto`` is tuned on), in one batch, and writes it into the drafter's ``calibration.json`` as
``tau_by_budget`` (with ``tau_measured`` saying how; the file's other fields are kept).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dtree_jax.api import generate, load_model  # noqa: E402
from dtree_jax.cli import DEFAULT_REQUEST  # noqa: E402
from dtree_jax.gguf import smollm2_gguf  # noqa: E402
from dtree_jax.text import encode_prompts  # noqa: E402
from experiments.run_experiments import PROMPT_TOKENS, RESULTS, machine, smollm2_heldout  # noqa: E402

CODE_REQUEST = "def fibonacci(n):"  # a plain continuation, no chat template


def prompt_sets(target, n: int) -> dict[str, list[list[int]]]:
    """``kind -> token ids``: the first ``n`` held-out prompts split by kind, and the two requests of the CLI."""
    kept, ids = smollm2_heldout(target, n)
    return {
        "chat": [i for p, i in zip(kept, ids) if p.kind == "chat"],
        "continue": [i for p, i in zip(kept, ids) if p.kind == "continue"],
        "default request": encode_prompts(target.path, [DEFAULT_REQUEST], chat=True),
        "code request": encode_prompts(target.path, [CODE_REQUEST], chat=False),
    }


def _tau(stats: list[dict], tokens: list[list[int]], vocab: set | None = None) -> dict:
    """Generated tokens after the root over rounds, summed over requests; with a draft ``vocab``, the share of
    the generated tokens inside it (``in_vocab``)."""
    gen, rounds = sum(s["generated"] for s in stats), sum(s["rounds"] for s in stats)
    row = dict(tau=(gen - len(stats)) / max(rounds, 1), generated=gen, rounds=rounds, prompts=len(stats))
    if vocab is not None:
        row["in_vocab"] = sum(t in vocab for ts in tokens for t in ts) / max(sum(map(len, tokens)), 1)
    return row


def taus(target, drafter, sets: dict[str, list[list[int]]], budget: int, max_new: int, draft_vocab="auto") -> dict:
    """``kind -> {tau, generated, rounds, prompts}`` (and ``held-out``: chat + continue), every set's prompts in
    one batch (one compilation); ``draft_vocab`` goes to ``generate`` (token ids: ``in_vocab`` too)."""
    prompts = [p for ps in sets.values() for p in ps]
    g = generate(target, prompts, "dominotree", drafter, budget=budget, max_new_tokens=max_new,
                 prompt_bucket=PROMPT_TOKENS, draft_vocab=draft_vocab)
    vocab = None if draft_vocab is None or isinstance(draft_vocab, str) else set(draft_vocab)
    rows, i = {}, 0
    for kind, ps in sets.items():
        rows[kind], i = (g.stats[i : i + len(ps)], g.tokens[i : i + len(ps)]), i + len(ps)
    held = tuple(a + b for a, b in zip(rows["chat"], rows["continue"]))
    return {"held-out": _tau(*held, vocab), **{k: _tau(*v, vocab) for k, v in rows.items()}}


CALIBRATION_BUDGETS = (4, 8, 16, 32)
CALIBRATION_PROMPTS = 4
CALIBRATION_NEW_TOKENS = 40


def calibrate(target, path: str, offset: int) -> dict:
    """Writes ``tau_by_budget`` (and ``tau_measured``) into ``path/calibration.json``; returns the taus."""
    _, ids = smollm2_heldout(target, CALIBRATION_PROMPTS, offset)
    drafter = load_model(path)
    taus = {"0": 1.0}
    for budget in CALIBRATION_BUDGETS:
        g = generate(target, ids, "dominotree", drafter, budget=budget, max_new_tokens=CALIBRATION_NEW_TOKENS,
                     prompt_bucket=PROMPT_TOKENS)
        taus[str(budget)] = _tau(g.stats, g.tokens)["tau"]
        print(f"budget {budget}: tau {taus[str(budget)]:.2f}", flush=True)
    file = pathlib.Path(path) / "calibration.json"
    cal = json.loads(file.read_text()) if file.is_file() else {}
    cal.update(tau_by_budget=taus, tau_measured=dict(
        tool="experiments/eval_drafter.py --calibrate", heldout_prompts=[offset, offset + CALIBRATION_PROMPTS],
        batch=CALIBRATION_PROMPTS, max_new_tokens=CALIBRATION_NEW_TOKENS, machine=machine()))
    file.write_text(json.dumps(cal, indent=2) + "\n")
    return taus


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("drafters", nargs="+", help="HF-layout drafter directories")
    parser.add_argument("--budgets", default="4,8")
    parser.add_argument("--prompts", type=int, default=20)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--out", default=str(RESULTS / "eval_drafter.json"))
    parser.add_argument("--calibrate", action="store_true",
                        help="write each drafter's tau per budget into its calibration.json instead")
    args = parser.parse_args(argv)
    missing = [d for d in args.drafters if not (pathlib.Path(d) / "config.json").is_file()]
    if missing:
        parser.error(f"not a drafter directory (no config.json): {', '.join(missing)}")
    budgets = [int(b) for b in args.budgets.split(",")]
    target = load_model(smollm2_gguf())
    if args.calibrate:
        for path in args.drafters:
            try:
                calibrate(target, path, args.prompts)
            except ValueError as e:
                parser.error(str(e))
        return 0
    try:
        sets = prompt_sets(target, args.prompts)
    except ValueError as e:
        parser.error(str(e))
    rows = []
    print(f"| drafter | budget | held-out | {' | '.join(sets)} |", flush=True)
    for path in args.drafters:
        drafter = load_model(path)
        for budget in budgets:
            row = dict(drafter=str(pathlib.Path(path).resolve()), budget=budget,
                       **taus(target, drafter, sets, budget, args.max_new_tokens))
            rows.append(row)
            print(f"| {path} | {budget} | " + " | ".join(f"{row[k]['tau']:.2f}" for k in ("held-out", *sets)) + " |",
                  flush=True)
    payload = dict(machine=machine(), prompts=args.prompts, max_new_tokens=args.max_new_tokens, rows=rows)
    pathlib.Path(args.out).write_text(json.dumps(payload, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
