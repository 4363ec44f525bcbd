"""Compiles the whole dominotree generation (prefill + the while loop, the chip's Pallas kernels) at real model
sizes for real chips on this CPU, with abstract params (no weights), through ``dtree_jax.aot.compile_for``: Qwen3-8B
+ its Domino drafter, Qwen3.6-27B (hybrid, with the tree-GDN kernel) + its Domino drafter, the MoE targets
Qwen3-Next-80B-A3B, Qwen3-30B-A3B (``qwen3_moe``) and Qwen3.6-35B-A3B (``qwen3_5_moe``) + a Domino drafter of
the same recipe at their width, each on the smallest TPU slice and GPU count that hold it, and the 8B on one
v5e chip, which does not (the TPU compiler refuses it; the row says so).

Records per configuration: trace, lower and compile seconds, the kernel calls, ``compiled.memory_analysis()`` per
device, whether it fits and the compiler's one-line refusal when it does not.  Results:
``experiments/results/aot_real_shapes.json`` (rows kept across runs, keyed by model, chip and layer count);
``--table`` prints the README table.

    python experiments/aot_real_shapes.py                        # every row (about an hour on 2 cores)
    python experiments/aot_real_shapes.py --rows qwen3-8b@v5e-4  # one
    python experiments/aot_real_shapes.py --rows qwen3-8b@v5e-4 --layers 9   # compile time vs depth

Shapes: bf16 params and caches, batch 1, a 512-token prompt bucket, 4096 cache rows, budget 32 (the settings of
the first measurements in ../shared/reference/chips.md), the model axis over every device of the slice.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from dtree_jax import chips  # noqa: E402

chips.allow_compile_only()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from dtree_jax import aot, api  # noqa: E402
from dtree_jax.models import decoder, drafter, qwen3_5  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "aot_real_shapes.json"
GIB = 2**30
ROWS = ("qwen3-8b@v5e-1", "qwen3-8b@v5e-4", "qwen3-8b@v6e-4", "qwen3-8b@h200", "qwen3.6-27b@v5e-8",
        "qwen3.6-27b@h200", "qwen3-next-80b@v5e-16", "qwen3-next-80b@h200-2", "qwen3-30b-a3b@v5e-8",
        "qwen3-30b-a3b@h200", "qwen3.6-35b-a3b@v5e-8", "qwen3.6-35b-a3b@h200")

QWEN3_8B = dict(model_type="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=False, max_position_embeddings=40960)
QWEN36_27B = dict(model_type="qwen3_5_text", vocab_size=248320, hidden_size=5120, intermediate_size=17408,
                  num_hidden_layers=64, num_attention_heads=24, num_key_value_heads=4, head_dim=256,
                  linear_num_key_heads=16, linear_num_value_heads=48, linear_key_head_dim=128,
                  linear_value_head_dim=128, linear_conv_kernel_dim=4, full_attention_interval=4,
                  rms_norm_eps=1e-6, tie_word_embeddings=False, max_position_embeddings=262144,
                  rope_parameters=dict(rope_type="default", rope_theta=1e7, partial_rotary_factor=0.25))
QWEN3_NEXT_80B = dict(model_type="qwen3_next", vocab_size=151936, hidden_size=2048, intermediate_size=5120,
                      num_hidden_layers=48, num_attention_heads=16, num_key_value_heads=2, head_dim=256,
                      linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
                      linear_value_head_dim=128, linear_conv_kernel_dim=4, num_experts=512,
                      num_experts_per_tok=10, moe_intermediate_size=512, shared_expert_intermediate_size=512,
                      norm_topk_prob=True, decoder_sparse_step=1, rms_norm_eps=1e-6, tie_word_embeddings=False,
                      partial_rotary_factor=0.25, rope_theta=1e7, max_position_embeddings=262144)

QWEN3_30B_A3B = dict(model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                     num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                     num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
                     decoder_sparse_step=1, mlp_only_layers=[], rms_norm_eps=1e-6, rope_theta=1e6,
                     tie_word_embeddings=False, max_position_embeddings=40960)
QWEN36_35B_A3B = dict(model_type="qwen3_5_moe_text", vocab_size=248320, hidden_size=2048, num_hidden_layers=40,
                      num_attention_heads=16, num_key_value_heads=2, head_dim=256, linear_num_key_heads=16,
                      linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
                      linear_conv_kernel_dim=4, full_attention_interval=4, num_experts=256, num_experts_per_tok=8,
                      moe_intermediate_size=512, shared_expert_intermediate_size=512, rms_norm_eps=1e-6,
                      tie_word_embeddings=False, max_position_embeddings=262144,
                      rope_parameters=dict(rope_type="default", rope_theta=1e7, partial_rotary_factor=0.25))


def domino_config(hidden, heads, kv_heads, head_dim, intermediate, vocab, taps, target_layers, mask_token, theta):
    """A Domino drafter config.json in the released recipe (5 Qwen3 layers, block 16, GRU 1024, emb 256)."""
    return dict(architectures=["DFlashDraftModel"], model_type="qwen3", hidden_size=hidden, num_hidden_layers=5,
                num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                intermediate_size=intermediate, vocab_size=vocab, rms_norm_eps=1e-6, rope_theta=theta,
                tie_word_embeddings=False, max_position_embeddings=40960, block_size=16,
                num_target_layers=target_layers,
                dflash_config=dict(mask_token_id=mask_token, target_layer_ids=taps, projector_type="domino",
                                   pure_draft_prefix_len=1, emb_dim=256, gru_hidden_dim=1024, shift_label=True))


MODELS = {
    # name: (target module, target config, drafter config, what the drafter is)
    "qwen3-8b": (decoder, QWEN3_8B, domino_config(4096, 32, 8, 128, 12288, 151936, [1, 9, 17, 25, 33], 36, 151669,
                                                1e6), "the released Qwen3-8B Domino config"),
    "qwen3.6-27b": (qwen3_5, QWEN36_27B, domino_config(5120, 32, 8, 128, 17408, 248320, [1, 16, 31, 46, 61], 64,
                                                       248070, 1e7), "the released Qwen3.6-27B Domino config"),
    "qwen3-next-80b": (qwen3_5, QWEN3_NEXT_80B, domino_config(2048, 16, 4, 128, 6144, 151936, [1, 12, 24, 35, 46],
                                                              48, 151669, 1e7),
                       "hypothetical: the same recipe at the 80B's width (no drafter is released)"),
    "qwen3-30b-a3b": (decoder, QWEN3_30B_A3B, domino_config(2048, 32, 4, 128, 6144, 151936, [1, 12, 23, 34, 45],
                                                            48, 151669, 1e6),
                      "the Domino recipe at the 30B-A3B's width (DFlash's Qwen3-Coder-30B-A3B drafter's shape)"),
    "qwen3.6-35b-a3b": (qwen3_5, QWEN36_35B_A3B, domino_config(2048, 16, 2, 128, 6144, 248320, [1, 10, 19, 28, 37],
                                                               40, 248070, 1e7),
                        "the Domino recipe at the 35B-A3B's width"),
}


def abstract_models(name: str, dtype=jnp.bfloat16, layers: int | None = None):
    """The target and drafter of ``MODELS[name]`` with abstract params; ``layers`` cuts the target's depth (the
    drafter's taps kept inside it), for measuring compile time against depth."""
    module, tcfg_dict, dcfg_dict, _ = MODELS[name]
    if layers is not None:
        tcfg_dict = dict(tcfg_dict, num_hidden_layers=layers)
        taps = [min(i, layers - 1) for i in dcfg_dict["dflash_config"]["target_layer_ids"]]
        dcfg_dict = dict(dcfg_dict, num_target_layers=layers,
                         dflash_config=dict(dcfg_dict["dflash_config"], target_layer_ids=sorted(set(taps))))
    tcfg = module.config_from_hf(tcfg_dict, dtype=dtype)
    dcfg = drafter.config_from_hf(dcfg_dict, dtype=dtype)
    kind = tcfg_dict["model_type"] if module is decoder else "qwen3_5"
    return (api.Model(kind, tcfg, module.abstract_params(tcfg, dtype), name),
            api.Model("drafter", dcfg, drafter.abstract_params(dcfg, dtype), name + "-domino"))


def one(row: str, args) -> dict:
    name, chip = row.split("@")
    target, draft = abstract_models(name, layers=args.layers)
    count = lambda tree: sum(x.size for x in jax.tree.leaves(tree))  # noqa: E731
    report = aot.compile_for(target, draft, "dominotree", chip, batch=args.batch, prompt_bucket=args.prompt_bucket,
                             cache_len=args.context, budget=args.budget,
                             max_new_tokens=args.context - args.prompt_bucket - 64)
    return dict(model=name, layers=target.cfg.num_layers, target_params=count(target.params),
                drafter_params=count(draft.params), drafter_recipe=MODELS[name][3], **report.to_dict())


def table(rows: list[dict]) -> str:
    lines = ["| model | layers | chip | mesh | kernel calls | compiles | seconds (trace + lower + compile) | "
             "GiB per chip (args + temp) | fits |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        secs = r["seconds"]
        total = sum(secs.values())
        mem = r["memory"]
        gib = (f"{r['needed'] / GIB:.2f} ({mem['argument'] / GIB:.2f} + {mem['temp'] / GIB:.2f}) of "
               f"{r['memory_limit'] / GIB:.0f}" if mem else f"- of {r['memory_limit'] / GIB:.0f}")
        calls = ", ".join(f"{k} {v}" for k, v in r["kernel_calls"].items())
        fits = "yes" if r["fits"] else f"no: {r['error']}"
        lines.append(f"| {r['model']} | {r['layers']} | {r['chip']} | {r['mesh']['data']}x{r['mesh']['model']} | "
                     f"{calls} | {'yes' if r['memory'] else 'refused'} | {total:.0f} ({secs['trace']:.0f} + "
                     f"{secs['lower']:.0f} + {secs['compile']:.0f}) | {gib} | {fits} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", nargs="+", default=ROWS, help="model@chip, e.g. qwen3-8b@v5e-4")
    p.add_argument("--layers", type=int, default=None, help="cut the target to this many layers")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context", type=int, default=4096, help="cache rows per request")
    p.add_argument("--prompt-bucket", type=int, default=512)
    p.add_argument("--budget", type=int, default=32)
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--table", action="store_true", help="print the README table from --out and exit")
    args = p.parse_args(argv)
    key = lambda r: (r["model"], r["chip"], r["layers"])  # noqa: E731
    read = lambda: {key(r): r for r in (json.loads(args.out.read_text()) if args.out.is_file() else {}).get(  # noqa: E731
        "rows", [])}
    if args.table:
        print(table(list(read().values())))
        return 0
    for row in args.rows:
        if row.split("@")[0] not in MODELS or "@" not in row:
            p.error(f"--rows: {row!r} is not model@chip with a model from {sorted(MODELS)}")
        print(f"{row} ...", file=sys.stderr, flush=True)
        r = one(row, args)
        rows = read()  # as it is now: another run may have added rows meanwhile
        rows[key(r)] = r
        print(table([r]).splitlines()[-1], file=sys.stderr, flush=True)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        machine = dict(cpu_cores=os.cpu_count(), jax=jax.__version__, backend=jax.default_backend())
        order = lambda r: (list(MODELS).index(r["model"]), -r["layers"], r["chip"])  # noqa: E731
        args.out.write_text(json.dumps(dict(machine=machine, rows=sorted(rows.values(), key=order)), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
