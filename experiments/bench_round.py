"""Where a round's time goes, against an ``ar`` step, at SmolLM2-135M's shapes (the main job's pair).

    python experiments/bench_round.py                    # budgets 4 and 8, 40 interleaved repeats
    python experiments/bench_round.py --budgets 4 --repeats 80
    python experiments/bench_round.py --modes arguments,arguments+ynn,baked,baked+ynn
    python experiments/bench_round.py --generations 5      # + whole generations: ar vs dominotree, 5 pairs

From the state after the main job's default chat request is prefilled, every piece is compiled first, then timed
once per repeat in an interleaved order (ar step, draft, build, verify, commit, whole round, output head at 1 / N
rows, ...), so a slow stretch of this shared machine hits every piece alike; medians and the 10th-90th percentile
spread are reported, as ratios to the ``ar`` step measured in the same repeats.  ``ar`` is budget 0 of the same
loop: one ``decode_round`` verifying the root alone.  Each mode (``--modes``) compiles every piece with the weights
baked in as constants or passed as arguments, with or without XLA:CPU's YNNPACK dot fusions
(``dtree_jax.cpu_options``) and the few-row kernel (``+kernel``: ``dtree_jax.cpu_dot``), so the modes are compared
in one process.  ``--generations N`` then times whole
generations of the default request (``api.generate``, as the main job runs them) in N interleaved repeats of ar and
dominotree at each budget, with the weights baked in (the kernel where it builds) and (``BAKE_LIMIT_BYTES = 0``) as
arguments.

Writes experiments/results/bench_round.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from dtree_jax import api, cpu_dot, cpu_options, loop, planning  # noqa: E402
from dtree_jax.cli import DEFAULT_REQUEST, SHIPPED_DRAFTER, shipped  # noqa: E402
from dtree_jax.cpu_options import OPTION_SETS  # noqa: E402
from dtree_jax.gguf import smollm2_gguf  # noqa: E402
from dtree_jax.text import encode_prompts  # noqa: E402
from experiments.run_experiments import RESULTS, machine  # noqa: E402


def pieces(target, drafter, budget: int, prompt: list[int], max_new: int, draft_vocab=None) -> dict:
    """``name -> (function, args)`` for one budget: the ar step, the tree round's stages and the whole round,
    and the target's output head alone at 1 and at N rows; ``draft_vocab`` (``drafter.DraftVocab``) goes to the
    tree's spec."""
    knobs = dict(node_topk=8, corr_topm=None, max_depth=None, max_new_tokens=max_new, prompt_bucket=len(prompt),
                 stop_ids=(), top_k=0, top_p=1.0, draft_vocab=draft_vocab)
    ar = api.make_spec(target, None, "ar", budget=1, **knobs)
    tree = api.make_spec(target, drafter, "dominotree", budget=budget, **knobs)
    temp = jnp.float32(0.0)
    args = (jnp.asarray([prompt], jnp.int32), jnp.asarray([len(prompt)], jnp.int32), api.request_keys(0, 1), temp)
    tp, dp = target.params, drafter.params
    ar_state = loop.prefill_on_device(ar, tp, None, *args)
    state = loop.prefill_on_device(tree, tp, dp, *args)
    rnd = loop.draft(tree, tp, dp, state)
    tree_nodes = loop.build_tree(tree, tp, dp, rnd, state)
    logits, feats, cache = loop.verify(tree, tp, tree_nodes, state)
    n = tree.num_nodes  # verify rows; the draft's head runs on tree.draft_depth rows
    hidden = target.cfg.hidden_size
    head = lambda spec, p, x: spec.target.lm_head(p, spec.target_cfg, x)  # noqa: E731
    return {
        "ar step": (loop.decode_round, (ar, tp, None, temp, ar_state)),
        "draft": (loop.draft, (tree, tp, dp, state)),
        "build": (loop.build_tree, (tree, tp, dp, rnd, state)),
        "verify": (loop.verify, (tree, tp, tree_nodes, state)),
        "commit": (loop.accept_commit, (tree, dp, tree_nodes, logits, feats, cache, state, temp)),
        "round": (loop.decode_round, (tree, tp, dp, temp, state)),
        "head, 1 row": (head, (ar, tp, jnp.ones((1, 1, hidden), jnp.float32))),
        "head, verify rows": (head, (tree, tp, jnp.ones((1, n, hidden), jnp.float32))),
        "head, draft rows": (head, (tree, tp, jnp.ones((1, tree.draft_depth, hidden), jnp.float32))),
    }


MODES = {  # how a piece is compiled: weights baked in as constants or passed as arguments, and XLA:CPU options
    "arguments": (False, OPTION_SETS["default"]),
    "arguments+ynn": (False, OPTION_SETS["ynn"]),
    "baked": (True, OPTION_SETS["default"]),
    "baked+ynn": (True, OPTION_SETS["ynn"]),  # what dtree_jax compiled CPU generations with before cpu_dot
    "baked+xnn": (True, OPTION_SETS["xnn"]),
    "baked+onednn": (True, OPTION_SETS["onednn"]),
    "baked+ynn+vocab": (True, OPTION_SETS["ynn"]),  # + the drafter's draft vocabulary (its draft_vocab.json)
    # + the dense weights packed for the few-row kernel (cpu_dot): what dtree_jax compiles CPU generations with
    # where the kernel builds
    "baked+kernel+vocab": (True, OPTION_SETS["ynn"]),
    # the same with XLA's attention: what ran before cpu_dot.tree_attention
    "baked+kernel+xattn+vocab": (True, OPTION_SETS["ynn"]),
    # the same with XLA's RoPE tables and argmax: what ran before cpu_ops.cc
    "baked+kernel+xops+vocab": (True, OPTION_SETS["ynn"]),
    # the same, with bf16 weights (the shipped drafter's) on fp32 panels: what ran before bf16 panels
    "baked+kernel32+vocab": (True, OPTION_SETS["ynn"]),
}


def compile_piece(fn, args: tuple, weights: tuple, mode: str, baked_as: tuple):
    """``fn(*args)`` (``args[0]`` static) compiled in ``mode``; returns ``(program, its arguments)``.  Baked, each
    of ``weights`` found in ``args`` is baked in as its counterpart in ``baked_as`` (``loop.unshared_heads``, as
    generations are compiled)."""
    baked, options = MODES[mode]
    static, rest = args[0], args[1:]
    if not baked:
        return jax.jit(fn, static_argnums=0).lower(*args).compile(compiler_options=options), rest
    where = [i for i, a in enumerate(rest) if any(a is w for w in weights)]
    others = [a for i, a in enumerate(rest) if i not in where]

    def call(*flat):
        baked_in, given = list(flat[: len(where)]), iter(flat[len(where):])
        return fn(static, *(baked_in.pop(0) if i in where else next(given) for i in range(len(rest))))

    values = tuple(next(b for w, b in zip(weights, baked_as) if rest[i] is w) for i in where)
    if "+kernel32" in mode:
        widen = lambda a: a.astype(jnp.float32) if getattr(a, "dtype", None) == jnp.bfloat16 else a  # noqa: E731
        values = cpu_options.pack_dense(jax.tree.map(widen, values))
    elif "+kernel" in mode:
        values = cpu_options.pack_dense(values)
    attention = False if "+xattn" in mode else None
    ops = False if "+xops" in mode else None
    return cpu_options.compile_baked(call, values, *others, options=options, attention=attention, ops=ops), others


def compile_all(named: dict, weights: tuple, mode: str, baked_as: tuple) -> dict:
    out = {}
    for name, (fn, args) in named.items():
        t0 = time.perf_counter()
        program, inputs = compile_piece(fn, args, weights, mode, baked_as)
        jax.block_until_ready(program(*inputs))  # the first run of a baked program is slower: untimed
        out[name] = (program, inputs, time.perf_counter() - t0)
    return out


def time_interleaved(compiled: dict, repeats: int) -> dict[str, list[float]]:
    times = {name: [] for name in compiled}
    for _ in range(repeats):
        for name, (fn, args, _) in compiled.items():
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times[name].append(time.perf_counter() - t0)
    return times


def summary(times: dict[str, list[float]]) -> dict:
    ar = statistics.median(times["ar step"])
    rows = {}
    for name, ts in times.items():
        med = statistics.median(ts)
        p10, p90 = np.percentile(ts, [10, 90])
        rows[name] = dict(ms=med * 1e3, p10_ms=p10 * 1e3, p90_ms=p90 * 1e3, x_ar=med / ar)
    return rows


def whole_generations(target, drafter, budgets, repeats: int) -> list[dict]:
    """The default chat request generated whole (128 new tokens) by ar and by dominotree at each budget, with the
    weights baked in and as arguments: each compiled and run once untimed, then ``repeats`` interleaved rounds of
    every configuration; median seconds, tokens/s and the speedup over ar of the same mode."""
    configs = [("ar", None)] + [("dominotree", b) for b in budgets]
    limit = cpu_options.BAKE_LIMIT_BYTES
    modes = {"baked": limit, "arguments": 0}  # baked: as generations compile (the kernel where it builds)

    def run(method, budget, mode):
        cpu_options.BAKE_LIMIT_BYTES = modes[mode]
        try:
            return api.generate(target, [DEFAULT_REQUEST], method, drafter if budget else None, budget=budget or 1,
                                max_new_tokens=128, chat=True)
        finally:
            cpu_options.BAKE_LIMIT_BYTES = limit

    keys = [(m, b, mode) for mode in modes for m, b in configs]
    first = {k: run(*k) for k in keys}
    seconds = {k: [] for k in keys}
    for _ in range(repeats):
        for k in keys:
            r = run(*k)
            assert r.tokens == first[("ar", None, k[2])].tokens, f"{k} differs from ar"
            seconds[k].append(r.seconds)
    rows = []
    for m, b, mode in keys:
        med = statistics.median(seconds[(m, b, mode)])
        ar = statistics.median(seconds[("ar", None, mode)])
        n = first[(m, b, mode)].stats[0]["generated"]
        rows.append(dict(method=m, budget=b, mode=mode, generated=n, tau=first[(m, b, mode)].stats[0]["tau"],
                         seconds=seconds[(m, b, mode)], median_s=med, tokens_per_second=n / med,
                         speedup_vs_ar=ar / med, compile_s=first[(m, b, mode)].compile_seconds))
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budgets", default="4,8", help="comma-separated tree budgets")
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--modes", default="arguments,baked+ynn", help=f"comma-separated: {', '.join(MODES)}")
    parser.add_argument("--generations", type=int, default=0, help="interleaved whole-generation repeats (0: none)")
    parser.add_argument("--out", default=str(RESULTS / "bench_round.json"))
    args = parser.parse_args(argv)
    budgets = [int(b) for b in args.budgets.split(",")]
    option_names = args.modes.split(",")
    unknown = [o for o in option_names if o not in MODES]
    if unknown:
        parser.error(f"unknown modes {unknown}; known: {', '.join(MODES)}")
    target = api.load_model(smollm2_gguf())
    drafter = api.load_model(shipped(SHIPPED_DRAFTER))
    prompt = encode_prompts(target.path, [DEFAULT_REQUEST], chat=True)[0]
    vocab = planning.draft_vocabulary(target, drafter, "auto")
    if any("+kernel" in o for o in option_names) and not cpu_dot.available():
        parser.error(f"a +kernel mode needs the few-row kernel: {cpu_dot.status()}")
    if vocab is None and any(o.endswith("+vocab") for o in option_names):
        parser.error(f"a +vocab mode needs {planning.DRAFT_VOCAB_FILE} beside the drafter (experiments/draft_vocab.py)")
    results = []
    for budget in budgets:
        named = {o: pieces(target, drafter, budget, prompt, max_new=128,
                           draft_vocab=vocab if o.endswith("+vocab") else None) for o in option_names}
        weights = (target.params, drafter.params)
        compiled = {o: compile_all(named[o], weights, o, loop.unshared_heads(named[o]["round"][1][0], *weights))
                    for o in option_names}
        # Interleave the modes too: one repeat of every piece in every mode, then the next repeat.
        times = {o: {name: [] for name in named[o]} for o in option_names}
        for _ in range(args.repeats):
            for o in option_names:
                for name, ts in time_interleaved(compiled[o], 1).items():
                    times[o][name] += ts
        for o in option_names:
            rows = summary(times[o])
            spec = named[o]["round"][1][0]
            results.append(dict(budget=budget, verify_rows=spec.num_nodes, draft_rows=spec.draft_depth, mode=o,
                                draft_vocab=len(spec.draft_vocab.ids) if spec.draft_vocab else None,
                                baked=MODES[o][0], xla_options=MODES[o][1], stages=rows,
                                compile_s={k: v[2] for k, v in compiled[o].items()},
                                stage_sum_x_ar=sum(rows[k]["x_ar"]
                                                   for k in ("draft", "build", "verify", "commit")),
                                times_ms={k: [t * 1e3 for t in v] for k, v in times[o].items()}))
    generations = whole_generations(target, drafter, budgets, args.generations) if args.generations else None
    payload = dict(machine=machine(), kernel=cpu_dot.status(), prompt_tokens=len(prompt), repeats=args.repeats,
                   results=results, generations=generations)
    pathlib.Path(args.out).write_text(json.dumps(payload, indent=1))
    print(f"| budget | mode | ar step ms | {' | '.join(k for k in results[0]['stages'] if k != 'ar step')} |")
    for r in results:
        s = r["stages"]
        cells = [f"{v['x_ar']:.2f}x ({v['ms']:.1f})" for k, v in s.items() if k != "ar step"]
        print(f"| {r['budget']} | {r['mode']} | {s['ar step']['ms']:.1f} | {' | '.join(cells)} |")
    for g in generations or ():
        print(f"| {g['method']} | {g['budget']} | {g['mode']} | {g['tokens_per_second']:.1f} tok/s | "
              f"{g['speedup_vs_ar']:.2f}x | tau {g['tau']:.2f} | compile {g['compile_s']:.0f} s |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
