"""Trains the shipped pair in checkpoints/: a byte-level Qwen3 target on the Python standard library, then a
Domino drafter for it (block-diffusion backbone, then the GRU head with the lambda_base curriculum).

    python experiments/train_tiny.py --stage target  --steps 300
    python experiments/train_tiny.py --stage drafter --steps 300
    python experiments/train_tiny.py --smoke          # a few steps of both, into a temporary directory

Each stage is seeded, logs its loss with a progress bar and writes its loss curve to
experiments/results/train_<stage>.json.  Outputs are HF layouts (config.json + model.safetensors +
tokenizer.json) that the converter loads and that transformers can load (the target).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dtree_jax import train  # noqa: E402
from dtree_jax.models import decoder, drafter  # noqa: E402
from experiments.run_experiments import machine  # noqa: E402

TARGET_CONFIG = dict(
    architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=train.VOCAB_SIZE, hidden_size=256,
    intermediate_size=768, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
    hidden_act="silu", max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=10000.0,
    tie_word_embeddings=True, attention_bias=False, use_sliding_window=False, bos_token_id=train.BOS,
    eos_token_id=train.EOS, pad_token_id=train.PAD, torch_dtype="float32",
)


def drafter_config(block_size: int, shift_label: bool) -> dict:
    t = TARGET_CONFIG
    return dict(
        architectures=["DFlashDraftModel"], model_type="qwen3", vocab_size=t["vocab_size"],
        hidden_size=t["hidden_size"], intermediate_size=512, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, hidden_act="silu", max_position_embeddings=4096, rms_norm_eps=1e-6,
        rope_theta=10000.0, tie_word_embeddings=False, attention_bias=False, torch_dtype="float32",
        block_size=block_size, num_target_layers=t["num_hidden_layers"], emb_dim=64,
        dflash_config=dict(mask_token_id=train.MASK, target_layer_ids=[1, 3], projector_type="domino",
                           pure_draft_prefix_len=1, emb_dim=64, gru_hidden_dim=64, shift_label=shift_label),
    )


def write_log(name: str, payload: dict, results: pathlib.Path) -> None:
    results.mkdir(parents=True, exist_ok=True)
    (results / f"train_{name}.json").write_text(json.dumps(payload, indent=2) + "\n")


def train_target(out: pathlib.Path, steps: int, batch: int, length: int, lr: float, seed: int, results: pathlib.Path):
    cfg = decoder.config_from_hf(TARGET_CONFIG, dtype="float32")
    params = train.init_params(decoder, cfg, jax.random.key(seed))
    stream = train.corpus("train")
    heldout = train.corpus("heldout")
    loss = lambda p, b, s: train.target_loss(decoder, p, cfg, b)
    params, log = train.fit(params, loss, train.windows(stream, batch, length + 1, seed), steps=steps, lr=lr,
                            desc="target")
    eval_loss = float(np.mean([jax.jit(loss)(params, b, 0) for b, _ in
                               zip(train.windows(heldout, batch, length + 1, seed + 1), range(8))]))
    train.save_hf(out, TARGET_CONFIG, train.hf_tensors(decoder, cfg, params), train.tokenizer_json())
    write_log("target", dict(steps=log.steps, loss=log.losses, seconds=log.seconds, heldout_loss=eval_loss,
                             batch=batch, length=length, lr=lr, seed=seed, machine=machine()), results)
    print(f"target: {steps} steps in {log.seconds:.0f}s, final train loss {log.losses[-1]:.3f}, "
          f"held-out loss {eval_loss:.3f} nats/byte -> {out}")


def train_drafter(target_dir: pathlib.Path, out: pathlib.Path, steps: int, head_steps: int, batch: int, length: int,
                  blocks: int, lr: float, seed: int, block_size: int, shift_label: bool, results: pathlib.Path):
    from dtree_jax.convert import load_hf

    _, tcfg, tparams = load_hf(target_dir, dtype="float32")
    dcfg_dict = drafter_config(block_size, shift_label)
    dcfg = drafter.config_from_hf(dcfg_dict, dtype="float32")
    dparams = train.init_params(drafter, dcfg, jax.random.key(seed + 7))
    stream = train.corpus("train")
    rng = np.random.default_rng(seed)

    def batches():
        for w in train.windows(stream, batch, length, seed + 3):
            yield w, train.sample_anchors(rng, batch, length, blocks, block_size)

    total = steps + head_steps

    def loss(p, b, step):
        # lambda_base curriculum: 1.0 (backbone only) for the first stage, then linear decay to 0.3.
        frac = jnp.clip((step - steps) / max(head_steps, 1), 0.0, 1.0)
        lam = jnp.where(step < steps, 1.0, 1.0 - 0.7 * frac)
        return train.drafter_loss(p, dcfg, decoder, tparams, tcfg, b[0], b[1], lam)

    dparams, log = train.fit(dparams, loss, batches(), steps=total, lr=lr, desc="drafter")
    train.save_hf(out, dcfg_dict, train.hf_tensors(drafter, dcfg, dparams))
    write_log("drafter", dict(steps=log.steps, loss=log.losses, seconds=log.seconds, backbone_steps=steps,
                              head_steps=head_steps, batch=batch, length=length, blocks=blocks, lr=lr, seed=seed,
                              block_size=block_size, shift_label=shift_label, machine=machine()), results)
    print(f"drafter: {total} steps in {log.seconds:.0f}s, final loss {log.losses[-1]:.3f} -> {out}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stage", choices=["target", "drafter", "all"], default="all")
    p.add_argument("--out", default=str(ROOT / "checkpoints"))
    p.add_argument("--results", default=str(ROOT / "experiments" / "results"))
    p.add_argument("--steps", type=int, default=300, help="target steps / drafter backbone steps")
    p.add_argument("--head-steps", type=int, default=150, help="drafter steps with the GRU head curriculum")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--length", type=int, default=256)
    p.add_argument("--blocks", type=int, default=16, help="draft blocks per training sequence")
    p.add_argument("--block-size", type=int, default=8)
    p.add_argument("--shift-label", action="store_true", help="ship the shift_label=true convention")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke", action="store_true", help="3 steps of each stage into a temporary directory")
    a = p.parse_args(argv)
    out, results = pathlib.Path(a.out), pathlib.Path(a.results)
    if a.smoke:
        tmp = pathlib.Path(tempfile.mkdtemp(prefix="dtree-smoke-"))
        out, results = tmp, tmp / "results"
        a.steps, a.head_steps, a.batch, a.length, a.blocks = 3, 2, 2, 64, 2
    if a.stage in ("target", "all"):
        train_target(out / "tiny-target", a.steps, a.batch, a.length, a.lr, a.seed, results)
    if a.stage in ("drafter", "all"):
        train_drafter(out / "tiny-target", out / "tiny-domino", a.steps, a.head_steps, a.batch, a.length, a.blocks,
                      a.lr, a.seed, a.block_size, a.shift_label, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
