"""AOT-compiles the whole dominotree generation (prefill + the while loop) at real model sizes on this CPU, with
abstract params (no weights): Qwen3-8B + its Domino drafter, Qwen3.6-27B + its Domino drafter, Qwen3-Next-80B-A3B
+ a Domino drafter of the same recipe (none is released), on meshes of 1, 4 and 8 host devices (1x1, 1x4, 2x4;
``--meshes 1x8`` adds tensor parallelism over all 8).

Records per configuration: trace, lower and compile seconds, ``compiled.memory_analysis()`` per device
(argument, output, temp bytes), the analytic estimate (``api.memory_estimate``: params and caches as the
sharding table splits them, a round's logits and attention scores) and which per-device memories it fits.
Results: ``experiments/results/aot_real_shapes.json``; ``experiments/report.py --aot`` prints the README table.

    python experiments/aot_real_shapes.py                      # every model, meshes 1 / 4 / 8
    python experiments/aot_real_shapes.py --models qwen3-8b --meshes 1x1

Shapes: bf16 params and caches, batch 8, a 512-token prompt bucket (one prefill pass) and caches of
``--context`` rows (32K), budget 16.  The CPU compiler upcasts bf16 dots to fp32 and keeps those copies as
temporaries, so its temp bytes are not what an accelerator needs; they are recorded but the fit is judged on
the arguments (exact: the params each device holds), the caches as the table splits them (made inside the
program, so the CPU counts them as temp) and the analytic activations of a round.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from dtree_jax import api  # noqa: E402
from dtree_jax.models import drafter, qwen3, qwen3_5, sharding  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "aot_real_shapes.json"
GIB = 2**30
DEVICE_MEMORIES = {"16 GiB": 16 * GIB, "32 GiB": 32 * GIB, "141 GiB": 141 * GIB}
MESHES = {"1x1": (1, 1), "1x4": (1, 4), "2x4": (2, 4), "1x8": (1, 8)}  # data x model

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
    "qwen3-8b": (qwen3, QWEN3_8B, domino_config(4096, 32, 8, 128, 12288, 151936, [1, 9, 17, 25, 33], 36, 151669,
                                                1e6), "the released Qwen3-8B Domino config"),
    "qwen3.6-27b": (qwen3_5, QWEN36_27B, domino_config(5120, 32, 8, 128, 17408, 248320, [1, 16, 31, 46, 61], 64,
                                                       248070, 1e7), "the released Qwen3.6-27B Domino config"),
    "qwen3-next-80b": (qwen3_5, QWEN3_NEXT_80B, domino_config(2048, 16, 4, 128, 6144, 151936, [1, 12, 24, 35, 46],
                                                              48, 151669, 1e7),
                       "hypothetical: the same recipe at the 80B's width (no drafter is released)"),
}


def abstract_models(name: str, dtype=jnp.bfloat16):
    module, tcfg_dict, dcfg_dict, _ = MODELS[name]
    tcfg = module.config_from_hf(tcfg_dict, dtype=dtype)
    dcfg = drafter.config_from_hf(dcfg_dict, dtype=dtype)
    kind = "qwen3" if module is qwen3 else "qwen3_5"
    return (api.Model(kind, tcfg, module.abstract_params(tcfg, dtype)),
            api.Model("drafter", dcfg, drafter.abstract_params(dcfg, dtype)))


def one(name: str, shape: str, args) -> dict:
    target, draft = abstract_models(name)
    data, model = MESHES[shape]
    devices = data * model
    mesh = sharding.make_mesh(data, model) if devices > 1 else None
    knobs = dict(budget=args.budget, max_new_tokens=args.context - args.prompt_bucket - 64,
                 cache_len=args.context)
    t0 = time.perf_counter()
    traced = api.trace_generation(target, draft, "dominotree", batch=args.batch, prompt_bucket=args.prompt_bucket,
                                  mesh=mesh, **knobs)
    t1 = time.perf_counter()
    lowered = traced.lower()
    t2 = time.perf_counter()
    compiled = lowered.compile()
    t3 = time.perf_counter()
    mem = compiled.memory_analysis()
    count = lambda tree: sum(x.size for x in jax.tree.leaves(tree))  # noqa: E731
    row = dict(
        model=name, devices=devices, mesh=dict(data=data, model=model), batch=args.batch,
        prompt_bucket=args.prompt_bucket, context=args.context, budget=args.budget, dtype="bfloat16",
        target_params=count(target.params), drafter_params=count(draft.params), drafter=MODELS[name][3],
        trace_seconds=round(t1 - t0, 2), lower_seconds=round(t2 - t1, 2), compile_seconds=round(t3 - t2, 2),
        total_seconds=round(t3 - t0, 2),
        memory_analysis=dict(argument_bytes=int(mem.argument_size_in_bytes), output_bytes=int(mem.output_size_in_bytes),
                             temp_bytes=int(mem.temp_size_in_bytes),
                             alias_bytes=int(mem.alias_size_in_bytes)),
    )
    return with_estimate(row)


def with_estimate(row: dict) -> dict:
    """``row`` plus the analytic estimate of its configuration (the models set up for the mesh as ``generate``
    does: ``sharding.for_mesh``) and the fit: the compiled arguments (the params) + the caches + a round's
    activations.  The caches are made inside the program, so the CPU counts them in its temp bytes."""
    target, draft = abstract_models(row["model"])
    mesh = sharding.make_mesh(row["mesh"]["data"], row["mesh"]["model"]) if row["devices"] > 1 else None
    target = api.Model(target.kind, sharding.for_mesh(target.cfg, mesh), target.params)
    draft = api.Model(draft.kind, sharding.for_mesh(draft.cfg, mesh), draft.params)
    spec = api.make_spec(target, draft, "dominotree", budget=row["budget"], node_topk=4, corr_topm=None,
                         max_depth=None, max_new_tokens=row["context"] - row["prompt_bucket"] - 64,
                         prompt_bucket=row["prompt_bucket"], stop_ids=(), top_k=0, top_p=1.0,
                         cache_len=row["context"], mesh=mesh)
    est = api.memory_estimate(spec, target, draft, row["batch"])
    need = row["memory_analysis"]["argument_bytes"] + est["cache"] + est["logits"] + est["tree"]
    return dict(row, estimate_bytes={k: int(v) for k, v in est.items()}, per_device_bytes=int(need),
                fits={k: need <= v for k, v in DEVICE_MEMORIES.items()})


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", choices=tuple(MODELS), default=tuple(MODELS))
    p.add_argument("--meshes", nargs="+", choices=tuple(MESHES), default=("1x1", "1x4", "2x4"),
                   help="data x model mesh shapes")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--context", type=int, default=32768, help="cache rows per request")
    p.add_argument("--prompt-bucket", type=int, default=512)
    p.add_argument("--budget", type=int, default=16)
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--estimates-only", action="store_true",
                   help="recompute the analytic estimates and fits of the rows in --out, compiling nothing")
    args = p.parse_args(argv)
    if args.estimates_only:
        d = json.loads(args.out.read_text())
        d["rows"] = [with_estimate(r) for r in d["rows"]]
        args.out.write_text(json.dumps(d, indent=1) + "\n")
        return 0
    most = max(MESHES[m][0] * MESHES[m][1] for m in args.meshes)
    if len(jax.devices()) < most:
        p.error(f"{most} devices needed, {len(jax.devices())} visible (XLA_FLAGS was set elsewhere?)")
    old = json.loads(args.out.read_text()) if args.out.is_file() else {}
    key = lambda r: (r["model"], r["mesh"]["data"], r["mesh"]["model"])  # noqa: E731
    rows = {key(r): r for r in old.get("rows", [])}
    for name in args.models:
        for shape in args.meshes:
            print(f"{name} on a {shape} mesh ...", file=sys.stderr, flush=True)
            r = one(name, shape, args)
            rows[key(r)] = r
            m = r["memory_analysis"]
            print(f"  compile {r['total_seconds']} s (trace {r['trace_seconds']}, lower {r['lower_seconds']}, "
                  f"compile {r['compile_seconds']}); per device: arguments {m['argument_bytes'] / GIB:.2f} GiB, "
                  f"temp (CPU) {m['temp_bytes'] / GIB:.2f} GiB, need {r['per_device_bytes'] / GIB:.2f} GiB",
                  file=sys.stderr, flush=True)
            args.out.parent.mkdir(parents=True, exist_ok=True)
            machine = dict(cpu_cores=os.cpu_count(), jax=jax.__version__, backend=jax.default_backend(),
                           host_devices=len(jax.devices()))
            args.out.write_text(json.dumps(dict(machine=machine, rows=sorted(
                rows.values(), key=lambda r: (list(MODELS).index(r["model"]), r["devices"], r["mesh"]["model"]))),
                indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
