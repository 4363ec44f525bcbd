"""A draft vocabulary for the SmolLM2 drafter: the tokens the target predicts most often in the training data, and
what drafting from fewer of them costs in held-out tau.

    python experiments/draft_vocab.py ~/.cache/dtree-jax/smollm2-distill-s4 ~/.cache/dtree-jax/smollm2-text-s5 \\
        --sizes 8192,16384,32768 --budgets 4,8
    python experiments/draft_vocab.py DATA ... --sizes '' --write 8192   # only checkpoints/smollm2-domino/draft_vocab.json

Tokens are ranked by how often they are the target's top-1 prediction at the positions a drafter trains on
(``distill.label_counts``; ties and unseen tokens by id, which for a BPE vocabulary roughly follows frequency).
Every size and the full vocabulary then run DominoTree on the held-out prompts of ``eval_drafter.py`` (greedy,
one batch), with the drafter's own head holding only those columns (``drafter.DraftVocab``; programs with baked
weights, the CPU default).  The outputs are the target's whatever the vocabulary, so ``in_vocab`` (the share of
the generated tokens inside it) and tau are what change; the draft's cost is ``bench_round.py``'s.  Writes
experiments/results/draft_vocab.json and prints a markdown table; ``--write N`` writes the top ``N`` tokens as
``draft_vocab.json`` beside the drafter, which ``generate``'s ``draft_vocab="auto"`` then uses.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dtree_jax import distill  # noqa: E402
from dtree_jax.api import load_model  # noqa: E402
from dtree_jax.cli import SHIPPED_DRAFTER, shipped  # noqa: E402
from dtree_jax.gguf import smollm2_gguf  # noqa: E402
from dtree_jax.planning import DRAFT_VOCAB_FILE  # noqa: E402
from experiments.eval_drafter import prompt_sets, taus  # noqa: E402
from experiments.run_experiments import RESULTS, machine  # noqa: E402


def ranked(counts: np.ndarray) -> np.ndarray:  # [V] -> [V] token ids, most often predicted first
    return np.lexsort((np.arange(counts.size), -counts))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("data", nargs="+", help="data directories (train_smollm2.py data / text)")
    parser.add_argument("--drafter", default=None, help="HF-layout drafter directory (default: the shipped one)")
    parser.add_argument("--sizes", default="8192,16384,32768")
    parser.add_argument("--budgets", default="4,8")
    parser.add_argument("--prompts", type=int, default=20)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--write", type=int, default=None, metavar="N",
                        help=f"write the top N tokens as {DRAFT_VOCAB_FILE} beside the drafter")
    parser.add_argument("--out", default=str(RESULTS / "draft_vocab.json"))
    args = parser.parse_args(argv)
    try:
        sizes = [int(s) for s in args.sizes.split(",") if s]  # none: only --write
        budgets = [int(b) for b in args.budgets.split(",")]
    except ValueError:
        parser.error("--sizes and --budgets take comma-separated integers")
    drafter_dir = args.drafter or str(shipped(SHIPPED_DRAFTER))
    target = load_model(smollm2_gguf())
    vocab = target.embedding_shape[0]
    if not all(0 < s <= vocab for s in sizes + ([args.write] if args.write else [])):
        parser.error(f"sizes must lie in 1..{vocab}")
    try:
        counts = distill.label_counts(vocab, *args.data)
        sets = prompt_sets(target, args.prompts)
    except ValueError as e:
        parser.error(str(e))
    order = ranked(counts)
    drafter = load_model(drafter_dir)
    rows = []
    print("| budget | draft vocabulary | held-out tau | chat | continuations | in vocabulary (held-out) |\n"
          "|---|---|---|---|---|---|", flush=True)
    for budget in budgets if sizes else []:  # no sizes: only --write
        for size in [None, *sizes]:
            ids = None if size is None else sorted(order[:size].tolist())
            row = dict(budget=budget, size=size or vocab,
                       **taus(target, drafter, sets, budget, args.max_new_tokens, draft_vocab=ids))
            rows.append(row)
            held = row["held-out"]
            print(f"| {budget} | {size or f'all {vocab}'} | {held['tau']:.2f} | {row['chat']['tau']:.2f} | "
                  f"{row['continue']['tau']:.2f} | {held.get('in_vocab', 1.0):.4f} |", flush=True)
    counted = dict(data=[str(pathlib.Path(d).resolve()) for d in args.data], positions=int(counts.sum()),
                   distinct=int((counts > 0).sum()))
    payload = dict(machine=machine(), drafter=str(pathlib.Path(drafter_dir).resolve()), prompts=args.prompts,
                   max_new_tokens=args.max_new_tokens, counted=counted, rows=rows)
    if rows:
        pathlib.Path(args.out).write_text(json.dumps(payload, indent=1) + "\n")
    if args.write:
        listed = dict(token_ids=sorted(order[: args.write].tolist()), size=args.write,
                      counted=dict(counted, data=[pathlib.Path(d).name for d in args.data]),
                      tool="experiments/draft_vocab.py")
        (pathlib.Path(drafter_dir) / DRAFT_VOCAB_FILE).write_text(json.dumps(listed) + "\n")
        print(f"wrote {pathlib.Path(drafter_dir) / DRAFT_VOCAB_FILE} ({args.write} tokens)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
