"""Prepared one-shot GPU check of the Pallas tree-attention kernel (sized for one H200, ~9 minutes in all).

    python experiments/gpu_check.py            # on the GPU machine
    python experiments/gpu_check.py --smoke    # tiny sizes on CPU, kernels in interpret mode (a dry run)

Sections, each recorded in the JSON (``--out``; default ``$OUT/gpu_check.json`` when ``$OUT`` is set, else
``experiments/results/gpu_check.json``, ``gpu_check_smoke.json`` for ``--smoke``):
  1. copy bandwidth: time of a large on-device array copy (read + write), the roofline for the rest;
  2. errors: Pallas kernel vs ``reference_tree_attention`` (fp32 at highest matmul precision, and bf16);
  3. the kernels in the real loop (``loop_checks``): every method's whole generation compiled through
     ``aot.compile_for`` (the path of ``dtree-jax compile``) for this machine and for a v5e chip (kernel calls,
     memory, fit), then short runs of ar / dflash / dominotree on the
     shipped pair (fp32, bf16) and a random hybrid GDN target with ``attention_impl="pallas"`` vs ``"xla"``
     (runs stop once 72 % of the budget is left);
  4. timing grid at the Qwen3-8B attention shape (H=32, Hkv=8, D=128, bf16): kernel vs XLA masked attention
     (``reference_tree_attention``) vs ``jax.nn.dot_product_attention`` with an explicit mask, over
     prefix 1K/8K/32K x N 16/32/64 x batch 1/8, with achieved HBM bandwidth (K/V bytes of lens + N rows);
  5. hooks: ``bench_verify_vs_ar`` (verify forward vs AR step) and ``bench_frontier_build`` take callables;
     they are filled from ``dtree_jax.models.decoder`` and ``dtree_jax.builders`` when those import, else skipped
     with a printed note.
A time budget (``--budget-s``) skips what would not fit; the short table is printed last.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dtree_jax import chips  # noqa: E402

chips.allow_compile_only()  # before JAX starts its backends: the v5e compile needs libtpu without a TPU lock

from dtree_jax.tree import ancestor_mask  # noqa: E402
from pallas_kernels.tree_attention import reference_tree_attention, tree_attention  # noqa: E402

FULL = dict(
    prefixes=(1024, 8192, 32768), nodes=(16, 32, 64), batches=(1, 8), heads=(32, 8, 128),
    copy_bytes=2 << 30, kernel_configs=({}, {"block_kv": 128}),
    qwen3=dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_layers=36, num_heads=32,
               num_kv_heads=8, head_dim=128, rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=False),
    qwen3_run=dict(prefix=8192, nodes=32, batch=1),
    frontier=dict(batch=(1, 8), budget=(16, 32, 64), depths=16, hidden=4096, vocab=151936, gru=256, e=256),
)
SMOKE = dict(
    prefixes=(64, 200), nodes=(4, 9), batches=(1, 2), heads=(4, 2, 32),
    copy_bytes=8 << 20, kernel_configs=({"block_kv": 32},),
    qwen3=dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
               num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=False),
    qwen3_run=dict(prefix=40, nodes=8, batch=1),
    frontier=dict(batch=(1,), budget=(8,), depths=4, hidden=64, vocab=256, gru=16, e=16),
)


class Clock:
    def __init__(self, budget_s: float):
        self.t0, self.budget = time.perf_counter(), budget_s

    def left(self) -> float:
        return self.budget - (time.perf_counter() - self.t0)


def bench(fn: Callable[[], Any], min_time: float = 0.15, reps: int = 3) -> float:
    """Seconds per call of ``fn`` (warmed up, compiled); the best of ``reps`` batches of calls."""
    jax.block_until_ready(fn())
    t = time.perf_counter()
    jax.block_until_ready(fn())
    one = max(time.perf_counter() - t, 1e-6)
    iters = int(min(100, max(2, min_time / one)))
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(iters):
            out = fn()
        jax.block_until_ready(out)
        best = min(best, (time.perf_counter() - t) / iters)
    return best


def random_inputs(key, b, t, h, hkv, d, s, lens, dtype):
    """Random q/k/v, random trees (random parents) and the given per-request lens."""
    kq, kk, kv, kp = jax.random.split(key, 4)
    q = jax.random.normal(kq, (b, t, h, d), jnp.float32).astype(dtype)
    k = jax.random.normal(kk, (b, s, hkv, d), jnp.float32).astype(dtype)
    v = jax.random.normal(kv, (b, s, hkv, d), jnp.float32).astype(dtype)
    u = jax.random.uniform(kp, (b, t))
    parents = jnp.where(jnp.arange(t) == 0, -1, jnp.floor(u * jnp.arange(t)).astype(jnp.int32))
    return q, k, v, jnp.asarray(lens, jnp.int32), ancestor_mask(parents)


def dense_mask(lens, local_mask, s):  # [B], [B, T, T] -> [B, 1, T, S]
    """The full verify mask for ``jax.nn.dot_product_attention``, built outside the timed call."""
    t = local_mask.shape[-1]
    cols = jnp.arange(s)[None, :]
    rel = cols - lens[:, None]
    idx = jnp.broadcast_to(jnp.clip(rel, 0, t - 1)[:, None, :], local_mask.shape[:2] + (s,))
    local = jnp.take_along_axis(local_mask, idx, axis=2)
    visible = (cols < lens[:, None])[:, None, :] | (((rel >= 0) & (rel < t))[:, None, :] & local)
    return visible[:, None]


def sdpa_fn(q, k, v, mask, scale):
    """``jax.nn.dot_product_attention`` with the explicit mask: cuDNN if it accepts the inputs, else XLA."""
    for impl in ("cudnn", "xla"):
        f = jax.jit(functools.partial(jax.nn.dot_product_attention, scale=scale, implementation=impl))
        try:
            jax.block_until_ready(f(q, k, v, mask=mask))
            return impl, lambda: f(q, k, v, mask=mask)
        except Exception as e:  # cuDNN absent or shape/mask not supported
            last = f"{type(e).__name__}: {str(e)[:200]}"
    raise RuntimeError(last)


def copy_bandwidth(nbytes: int) -> dict:
    x = jnp.ones((nbytes // 2,), jnp.bfloat16)
    f = jax.jit(lambda a: a * 2)  # one read and one write of every byte
    t = bench(lambda: f(x))
    return dict(bytes=nbytes, seconds=t, gbps=2 * nbytes / t / 1e9)


def error_checks(cfg: dict, interpret: bool) -> list[dict]:
    h, hkv, d = cfg["heads"]
    s = max(cfg["prefixes"]) // 4 + 64
    cases = [(2, 32, h, hkv, d, s, jnp.float32), (2, 32, h, hkv, d, s, jnp.bfloat16),
             (3, 17, 4, 2, 32, 300, jnp.float32), (2, 64, h, hkv, d, s, jnp.bfloat16)]
    out = []
    for i, (b, t, hh, kh, dd, ss, dtype) in enumerate(cases):
        lens = [0, ss - t, ss // 3][:b]
        args = random_inputs(jax.random.key(i), b, t, hh, kh, dd, ss, lens, dtype)
        scale = dd**-0.5
        with jax.default_matmul_precision("highest"):
            ref = reference_tree_attention(*args, scale=scale).astype(jnp.float32)
        got = tree_attention(*args, scale=scale, interpret=interpret, backend="gpu").astype(jnp.float32)
        err = float(jnp.max(jnp.abs(got - ref)))
        tol = 1e-4 if dtype == jnp.float32 else 5e-2  # bf16: a few output ulps at |out| ~ 2
        out.append(dict(shape=[b, t, hh, kh, dd, ss], dtype=jnp.dtype(dtype).name, max_abs_err=err, tol=tol,
                        ok=bool(err <= tol)))
        print(f"  err {out[-1]['shape']} {out[-1]['dtype']}: {err:.2e} (tol {tol:g}) {'ok' if err <= tol else 'FAIL'}")
    return out


def timing_grid(cfg: dict, interpret: bool, clock: Clock, stop_at: float, copy_gbps: float) -> list[dict]:
    h, hkv, d = cfg["heads"]
    rows = []
    for b in cfg["batches"]:
        for prefix in cfg["prefixes"]:
            for n in cfg["nodes"]:
                if clock.left() < stop_at:
                    print(f"  budget: skipping B={b} prefix={prefix} N={n} and later")
                    return rows
                s = -(-(prefix + n) // 512) * 512
                args = random_inputs(jax.random.key(prefix + n), b, n, h, hkv, d, s, [prefix] * b, jnp.bfloat16)
                scale = d**-0.5
                row = dict(batch=b, prefix=prefix, nodes=n, kv_bytes=2 * b * (prefix + n) * hkv * d * 2)
                best = None
                for kc in cfg["kernel_configs"]:
                    f = jax.jit(functools.partial(tree_attention, scale=scale, interpret=interpret, backend="gpu", **kc))
                    try:
                        t = bench(lambda: f(*args))
                    except Exception as e:
                        row.setdefault("kernel_errors", []).append(f"{kc}: {type(e).__name__}: {str(e)[:200]}")
                        continue
                    row.setdefault("kernel_configs", []).append(dict(config=kc, seconds=t))
                    if best is None or t < best[0]:
                        best = (t, kc)
                if best:
                    row.update(kernel_s=best[0], kernel_config=best[1], kernel_gbps=row["kv_bytes"] / best[0] / 1e9)
                    row["kernel_frac_copy_bw"] = row["kernel_gbps"] / copy_gbps
                ref = jax.jit(functools.partial(reference_tree_attention, scale=scale))
                row["xla_s"] = bench(lambda: ref(*args))
                try:
                    mask = dense_mask(args[3], args[4], s)
                    row["sdpa_impl"], sdpa = sdpa_fn(*args[:3], mask, scale)
                    row["sdpa_s"] = bench(sdpa)
                except Exception as e:
                    row["sdpa_error"] = str(e)
                rows.append(row)
                print("  " + fmt_row(row))
    return rows


# ----------------------------------------------------------------------------------------------------------
# HOOKS: callables to be filled by the decode / model / build modules.
# ----------------------------------------------------------------------------------------------------------


def bench_verify_vs_ar(verify_step: Callable[[], Any], ar_step: Callable[[], Any]) -> dict:
    """HOOK "verify forward at Qwen3-8B shape vs AR step": each callable runs one full target forward (tree
    verify of N nodes / one decode token) and returns something to block on."""
    tv, ta = bench(verify_step, reps=2), bench(ar_step, reps=2)
    return dict(verify_s=tv, ar_s=ta, verify_over_ar=tv / ta)


def bench_frontier_build(build_step: Callable[[], Any]) -> dict:
    """HOOK "frontier build time": ``build_step`` builds one round's draft trees for the whole batch."""
    return dict(build_s=bench(build_step))


def qwen3_steps(cfg: dict, impl: str, prefix: int, nodes: int, batch: int):
    """Filler for ``bench_verify_vs_ar`` from ``dtree_jax.models.decoder`` (random bf16 weights; with
    ``impl="pallas"`` the model picks the kernel, in interpret mode on CPU)."""
    from dtree_jax.models import decoder

    mcfg = decoder.DecoderConfig(**cfg, dtype="bfloat16", attention_impl=impl)
    abstract = decoder.abstract_params(mcfg, jnp.bfloat16)
    leaves, treedef = jax.tree.flatten(abstract)
    init = jax.jit(lambda key, shape: (0.02 * jax.random.normal(key, shape, jnp.float32)).astype(jnp.bfloat16),
                   static_argnums=1)
    params = jax.tree.unflatten(treedef, [init(jax.random.key(i), tuple(x.shape)) for i, x in enumerate(leaves)])
    cache = decoder.init_cache(mcfg, batch, -(-(prefix + nodes) // 512) * 512)
    lens = jnp.full((batch,), prefix, jnp.int32)
    fwd = jax.jit(decoder.forward, static_argnums=(1,), donate_argnums=(4,))
    state = {"cache": cache}

    def step(t, mask):
        tokens = jnp.zeros((batch, t), jnp.int32)
        depths = jnp.sum(mask, axis=-1, dtype=jnp.int32) - 1
        positions = lens[:, None] + depths

        def run():
            logits, _, state["cache"] = fwd(params, mcfg, tokens, positions, state["cache"], lens, mask)
            return logits

        return run

    parents = jnp.where(jnp.arange(nodes) == 0, -1, (jnp.arange(nodes) - 1) // 2)  # a binary tree
    tree_mask = jnp.broadcast_to(ancestor_mask(parents), (batch, nodes, nodes))
    return step(nodes, tree_mask), step(1, jnp.ones((batch, 1, 1), bool))


def frontier_steps(cfg: dict):
    """Filler for ``bench_frontier_build`` from ``dtree_jax.builders`` (random drafter outputs): yields
    (label, build_step) per method, batch and budget."""
    from dtree_jax import builders
    from dtree_jax.models.domino_head import DominoHead

    k_, hdim, vocab, g, e = cfg["depths"], cfg["hidden"], cfg["vocab"], cfg["gru"], cfg["e"]
    keys = jax.random.split(jax.random.key(0), 8)
    head = DominoHead(*(0.02 * jax.random.normal(kk, shp) for kk, shp in
                        zip(keys[:4], [(hdim, 3 * g), (g, 3 * g), (hdim + g, e), (vocab, e)])))
    embed = 0.02 * jax.random.normal(keys[4], (vocab, hdim))
    for b in cfg["batch"]:
        rnd = builders.DraftRound(
            ph=jax.random.normal(keys[5], (b, k_, hdim)),
            base=3 * jax.random.normal(keys[6], (b, k_, vocab)),
            root_state=jnp.zeros((b, g), jnp.float32),
            root=jnp.zeros((b,), jnp.int32),
        )
        for budget in cfg["budget"]:
            for method in ("ddtree", "dominotree"):
                fn = functools.partial(builders.build_tree, method, rnd, head, embed, budget=budget, k=8, M=64,
                                       mask_token_id=0)
                yield f"{method} B={b} budget={budget}", lambda fn=fn: fn().tokens


def run_hooks(cfg: dict, clock: Clock, out: dict, save: Callable[[], None]) -> None:
    """Fills ``out`` section by section, calling ``save`` after each."""
    try:
        frontier = {}
        for label, step in frontier_steps(cfg["frontier"]):
            if clock.left() < 100:
                print("  frontier: budget exhausted")
                break
            frontier[label] = bench_frontier_build(step)
            print(f"  frontier build {label}: {1e3 * frontier[label]['build_s']:.3f} ms")
        out["frontier_build"] = frontier
    except Exception as e:
        note = f"frontier build skipped: {type(e).__name__}: {str(e)[:300]}"
        print("  NOTE " + note)
        out["frontier_build_note"] = note
    save()
    run = cfg["qwen3_run"]
    out["verify_vs_ar"] = {}
    for impl in ("xla", "pallas"):
        if clock.left() < 100:
            print(f"  NOTE verify-vs-AR ({impl}) skipped: budget")
            continue
        try:
            verify, ar = qwen3_steps(cfg["qwen3"], impl, **run)
            res = dict(run, **bench_verify_vs_ar(verify, ar))
            out["verify_vs_ar"][impl] = res
            print(f"  verify(N={run['nodes']}) vs AR at prefix {run['prefix']}, {impl}: "
                  f"{1e3 * res['verify_s']:.2f} ms vs {1e3 * res['ar_s']:.2f} ms ({res['verify_over_ar']:.2f}x)")
        except Exception as e:
            note = f"verify-vs-AR ({impl}) skipped: {type(e).__name__}: {str(e)[:300]}"
            print("  NOTE " + note)
            out["verify_vs_ar"][impl] = dict(note=note, trace=traceback.format_exc()[-1500:])
        save()


# ----------------------------------------------------------------------------------------------------------
# The kernels inside the real loop: the whole jitted generation lowered with them, and short runs vs XLA.
# ----------------------------------------------------------------------------------------------------------

LOOP_METHODS = ("ar", "dflash", "dominotree")
LOOP_PROMPTS = ("import os\nimport sys\n\n\ndef main(argv=None):\n    ", "class Queue:\n    def __init__(self")
HYBRID_TEXT = dict(  # random Qwen3.5-style hybrid with the shipped target's width (layers 0-2 GDN, 3 attention)
    model_type="qwen3_5_text", vocab_size=264, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4,
    linear_key_head_dim=32, linear_value_head_dim=32, linear_conv_kernel_dim=4, rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
    tie_word_embeddings=True,
)


def random_params(abstract, seed: int = 0):
    """Random N(0, 0.02^2) leaves for an abstract params pytree (norm weights near 0 or 1 both work)."""
    leaves, treedef = jax.tree.flatten(abstract)
    init = jax.jit(lambda key, shape, dtype: (0.02 * jax.random.normal(key, shape, jnp.float32)).astype(dtype),
                   static_argnums=(1, 2))
    return jax.tree.unflatten(treedef, [init(jax.random.key(seed + i), tuple(x.shape), x.dtype)
                                        for i, x in enumerate(leaves)])


def loop_models(smoke: bool) -> dict:
    """name -> (target, drafter): the shipped pair (fp32 as shipped, and bf16 on the device) and a random
    hybrid GDN target with the shipped drafter (same width and vocabulary; its acceptance is meaningless)."""
    from dtree_jax import api, convert
    from dtree_jax.models import qwen3_5

    from dtree_jax.cli import SHIPPED_TINY, shipped

    paths = [shipped(name) for name in SHIPPED_TINY]
    dense = tuple(api.load_model(p) for p in paths)
    models = {"dense-fp32": dense}
    if not smoke:
        models["dense-bf16"] = tuple(
            api.Model(*convert.load_model(p, "bfloat16"), p, m.eos_token_ids) for p, m in zip(paths, dense))
    hcfg = qwen3_5.config_from_hf(HYBRID_TEXT, dtype="float32")
    hybrid = api.Model("qwen3_5", hcfg, random_params(qwen3_5.abstract_params(hcfg, jnp.float32)))
    models["hybrid-fp32"] = (hybrid, dense[1])
    return models


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token (or the shorter length), None if equal."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def loop_checks(smoke: bool, clock: Clock, stop_at: float, out: dict, save: Callable[[], None]) -> None:
    """a. ``compiles``: each method's whole generation (prefill + while_loop) compiled through ``aot.compile_for``
    (the path of ``dtree-jax compile``) for this machine's devices with their kernels and for a v5e chip (needs
    libtpu), kernel calls and memory recorded (on GPU the tree-GDN verify takes the XLA path on purpose).  b. ``runs``: each method generated with ``attention_impl="xla"``
    and ``"pallas"`` (this machine's kernels: Triton on GPU, interpret mode for ``--smoke``), tokens compared,
    and each pallas method compared with pallas ``ar`` (lossless)."""
    from dtree_jax import aot, api

    platform = "cpu" if smoke else "gpu"
    models = loop_models(smoke)
    methods = ("ar", "dominotree") if smoke else LOOP_METHODS
    compiles = out.setdefault("compiles", [])
    for chip in ("attached", "v5e-1"):  # what `dtree-jax compile` does, for this GPU and for a TPU
        for name, (target, draft) in models.items():
            for method in methods:
                row = dict(chip=chip, target=name, method=method)
                try:
                    report = aot.compile_for(target, draft, method, chip, budget=8, max_new_tokens=16)
                    row.update({k: report.to_dict()[k] for k in ("kernel_calls", "seconds", "memory", "fits",
                                                                  "error")})
                except Exception as e:
                    row.update(fits=False, error=f"{type(e).__name__}: {str(e)[:300]}")
                compiles.append(row)
                print(f"  compile {chip:8s} {name:11s} {method:10s}: {row.get('kernel_calls')} fits {row['fits']}"
                      + (f" ({row['error']})" if row.get("error") else ""))
    save()

    prompts = [list(p.encode("utf-8")) for p in LOOP_PROMPTS[: 1 if smoke else 2]]  # the shipped byte tokenizer
    knobs = dict(budget=8 if smoke else 16, max_new_tokens=6 if smoke else 32, stop_ids=())
    runs = out.setdefault("runs", [])
    for name, (target, draft) in models.items():
        ar_pallas = None
        for method in methods:
            if clock.left() < stop_at:
                print(f"  budget: skipping loop runs from {name} {method}")
                save()
                return
            row = dict(target=name, method=method, platform=platform)
            try:
                gens = {impl: api.generate(target, prompts, method, draft, attention_impl=impl,
                                              kernel_platform=platform if impl == "pallas" else None, **knobs)
                        for impl in ("xla", "pallas")}
                xla, pal = gens["xla"].tokens, gens["pallas"].tokens
                ar_pallas = pal if method == "ar" else ar_pallas
                row.update(
                    same_tokens=xla == pal,
                    first_divergence=[first_divergence(a, b) for a, b in zip(xla, pal)],
                    pallas_equals_ar=None if ar_pallas is None or method == "ar" else pal == ar_pallas,
                    tau={impl: [round(float(s["tau"]), 3) for s in g.stats] for impl, g in gens.items()},
                    tokens_per_second={impl: g.stats[0]["tokens_per_second"] for impl, g in gens.items()},
                    compile_s={impl: g.compile_seconds for impl, g in gens.items()},
                )
            except Exception as e:
                row.update(error=f"{type(e).__name__}: {str(e)[:300]}", trace=traceback.format_exc()[-1500:])
            runs.append(row)
            print(f"  run {name:11s} {method:10s}: " + (row["error"] if "error" in row else
                  f"pallas == xla {row['same_tokens']} (first divergence {row['first_divergence']}), "
                  f"pallas == pallas ar {row['pallas_equals_ar']}, tau {row['tau']['pallas']}"))
            save()


def fmt_row(r: dict) -> str:
    ms = lambda k: f"{1e3 * r[k]:8.3f}" if k in r else "     n/a"
    bw = f"{r['kernel_gbps']:7.0f} {100 * r['kernel_frac_copy_bw']:4.0f}%" if "kernel_gbps" in r else "    n/a     "
    return f"B={r['batch']:<2d} prefix={r['prefix']:<6d} N={r['nodes']:<3d} | {ms('kernel_s')} {ms('xla_s')} {ms('sdpa_s')} | {bw}"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny sizes on CPU, kernels in interpret mode")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--budget-s", type=float, default=480.0, help="wall-clock budget after start-up")
    args = ap.parse_args(argv)
    cfg, interpret = (SMOKE, True) if args.smoke else (FULL, False)
    if not args.smoke and jax.default_backend() != "gpu":
        raise SystemExit(f"no GPU (default backend {jax.default_backend()!r}); use --smoke for a CPU dry run")
    name = "gpu_check_smoke.json" if args.smoke else "gpu_check.json"
    out_path = args.out or (Path(os.environ["OUT"]) / name if os.environ.get("OUT") else
                            Path(__file__).resolve().parent / "results" / name)
    clock = Clock(args.budget_s)
    res = dict(jax=jax.__version__, devices=[str(d) for d in jax.devices()], smoke=args.smoke)
    out_path.parent.mkdir(parents=True, exist_ok=True)

    def save():  # after every section, so a run killed by its time limit keeps what it measured
        res["elapsed_s"] = args.budget_s - clock.left()
        out_path.write_text(json.dumps(res, indent=1, default=str))

    print(f"jax {jax.__version__} on {res['devices']}")

    print("1. copy bandwidth")
    res["copy"] = copy_bandwidth(cfg["copy_bytes"])
    print(f"  {res['copy']['gbps']:.0f} GB/s (read + write of {cfg['copy_bytes'] >> 20} MiB)")
    save()
    print("2. kernel vs reference")
    res["errors"] = error_checks(cfg, interpret)
    save()
    print("3. kernels in the real loop (whole-generation compiles; short runs, pallas vs xla)")
    res["loop"] = {}
    try:
        loop_checks(args.smoke, clock, 0.72 * args.budget_s, res["loop"], save)
    except Exception as e:
        res["loop"]["note"] = f"{type(e).__name__}: {str(e)[:300]}"
        print("  NOTE loop checks stopped: " + res["loop"]["note"])
    save()
    print("4. timing grid (ms: kernel, xla reference, dot_product_attention | kernel GB/s, % of copy)")
    res["grid"] = timing_grid(cfg, interpret, clock, stop_at=0.45 * args.budget_s, copy_gbps=res["copy"]["gbps"])
    save()
    print("5. hooks")
    res["hooks"] = {}
    run_hooks(cfg, clock, res["hooks"], save)
    print(f"\nwrote {out_path} ({res['elapsed_s']:.0f} s)")
    print(f"copy {res['copy']['gbps']:.0f} GB/s; max err fp32 "
          f"{max(e['max_abs_err'] for e in res['errors'] if e['dtype'] == 'float32'):.1e}, bf16 "
          f"{max(e['max_abs_err'] for e in res['errors'] if e['dtype'] == 'bfloat16'):.1e}; "
          f"all ok: {all(e['ok'] for e in res['errors'])}")
    print("                               |   kernel      xla     sdpa |  kernel GB/s")
    for r in res["grid"]:
        print(fmt_row(r))
    low, runs = res["loop"].get("compiles", []), res["loop"].get("runs", [])
    print(f"loop: {sum(r['fits'] for r in low)}/{len(low)} whole-generation compiles with kernels; "
          f"{sum(r.get('same_tokens', False) for r in runs)}/{len(runs)} runs pallas == xla; "
          f"{sum(r.get('pallas_equals_ar') is True for r in runs)}/{sum(r['method'] != 'ar' for r in runs)} "
          "pallas methods == pallas ar")


if __name__ == "__main__":
    main()
