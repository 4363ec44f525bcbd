"""Where a round's time goes on XLA:CPU: a ``jax.profiler`` trace of the main job's generation (the shipped
SmolLM2 pair, the default request as a chat, greedy), its thunks attributed to the dumped optimised HLO module and,
through each instruction's metadata, to our source lines.

    python experiments/profile_round.py                           # dominotree at budget 8 and ar, 3 generations each
    python experiments/profile_round.py --methods dominotree --budget 4 --top 40

For each method: thunk milliseconds per round (an ``ar`` step is its round) split into the few-row dot kernel, the
attention kernel, XLA's dots and everything else (the "small ops": their count per round and total), then the
largest groups of thunks by source line and HLO opcode.  Thunk time is time inside XLA's CPU thunks, not wall time:
the rest is the runtime's dispatch between them.  Writes ``experiments/results/profile_round.json`` (``--out``).
The traces and the HLO dump go to a temporary directory, removed afterwards unless ``--keep``.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import os
import pathlib
import re
import shutil
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "experiments" / "results"
DUMP = pathlib.Path(tempfile.gettempdir()) / f"dtree-jax-profile-{os.getpid()}"  # made by XLA's first dump
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={DUMP / 'hlo'} --xla_dump_hlo_as_text"
                           " --xla_dump_hlo_module_re=.*generate_loop.*").strip()

import jax  # noqa: E402

sys.path.insert(0, str(ROOT))

from dtree_jax import api, cli  # noqa: E402
from dtree_jax.gguf import smollm2_gguf  # noqa: E402
from experiments.run_experiments import machine  # noqa: E402

INSTRUCTION = re.compile(r"^\s*(?:ROOT )?(%?[\w.\-]+) = .*?\b([a-z][a-z\-]*)\(")
CUSTOM_TARGET = re.compile(r'custom_call_target="([^"]+)"')
FRAME = re.compile(r"stack_frame_id=(\d+)")
FUSION_KIND = re.compile(r"kind=(k\w+)")
TABLE_ROW = re.compile(r"^(\d+) (.*)$")
FIELD = re.compile(r"(\w+)=(\d+)")


def source_lines(text: str) -> dict[str, str]:
    """{stack frame id: "file.py:line function"} for the innermost frame, from the module's frame tables."""
    tables, current = collections.defaultdict(dict), None
    for line in text.splitlines():
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            current = line
        elif current and (m := TABLE_ROW.match(line)):
            tables[current][m.group(1)] = m.group(2)
        elif current and line.strip():
            current = None
    files, functions = tables["FileNames"], tables["FunctionNames"]
    where = {}
    for frame, fields in tables["StackFrames"].items():
        location = dict(FIELD.findall(tables["FileLocations"].get(dict(FIELD.findall(fields)).get("file_location_id", ""), "")))
        path = files.get(location.get("file_name_id", ""), '"?"').strip('"')
        function = functions.get(location.get("function_name_id", ""), '"?"').strip('"')
        where[frame] = f"{pathlib.Path(path).name}:{location.get('line', '?')} {function}"
    return where


def hlo_instructions(paths: list[pathlib.Path]) -> dict[str, dict[str, dict]]:
    """{module name: {instruction name: {opcode, where, detail}}} from the dumped optimised CPU modules."""
    modules = {}
    for path in paths:
        text = path.read_text()
        name = re.search(r"^HloModule (\S+?),", text, re.M).group(1)
        frames = source_lines(text)
        table = {}
        for line in text.splitlines():
            m = INSTRUCTION.match(line)
            if not m:
                continue
            op, opcode = m.group(1).lstrip("%"), m.group(2)
            detail = ""
            if opcode == "custom-call" and (t := CUSTOM_TARGET.search(line)):
                detail = t.group(1)
            elif opcode == "fusion" and (k := FUSION_KIND.search(line)):
                detail = k.group(1)
            frame = FRAME.search(line)
            table[op] = dict(opcode=opcode, detail=detail, where=frames.get(frame.group(1), "?") if frame else "?")
        modules[name] = table
    return modules


def modules_dumped() -> list[pathlib.Path]:
    return sorted((DUMP / "hlo").glob("*generate_loop*cpu_after_optimizations.txt"))


def thunk_events(trace_dir: pathlib.Path) -> list[dict]:
    """The trace's complete events that name an HLO op: {op, module, ms}."""
    (trace,) = trace_dir.rglob("perfetto_trace.json.gz")
    with gzip.open(trace) as f:
        events = json.load(f)
    events = events["traceEvents"] if isinstance(events, dict) else events
    out = []
    for e in events:
        args = e.get("args") or {}
        if e.get("ph") == "X" and "hlo_op" in args:
            out.append(dict(op=args["hlo_op"], module=args.get("hlo_module", ""), ms=e.get("dur", 0) / 1e3))
    return out


def kind_of(ins: dict) -> str:
    if ins["opcode"] == "custom-call":
        target = ins["detail"]
        if "attention" in target:
            return "attention kernel"
        if "dot" in target or "matmul" in target:
            return "few-row dot kernel"
        return f"custom-call {target}"
    if ins["opcode"] in ("dot", "convolution") or (ins["opcode"] == "fusion" and ins["detail"] == "kOutput"):
        return "XLA dots"
    return "small ops"


def profile(method: str, budget: int, generations: int, target, drafter, trace_dir: pathlib.Path,
            temperature: float = 0.0) -> dict:
    kw = dict(method=method, drafter=drafter if method != "ar" else None, chat=True, max_new_tokens=128,
              cpu_dots="kernel", temperature=temperature, seed=1)
    if method != "ar":
        kw["budget"] = budget
    first = api.generate(target, [cli.DEFAULT_REQUEST], **kw)  # compiles
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0  # XLA's thunks only: Python's frames would swell the trace past 2 GB
    with jax.profiler.trace(str(trace_dir), create_perfetto_trace=True, profiler_options=options):
        runs = [api.generate(target, [cli.DEFAULT_REQUEST], **kw) for _ in range(generations)]
    assert all(r.tokens == first.tokens for r in runs)
    rounds = sum(r.stats[0]["rounds"] for r in runs)
    return dict(method=method, budget=budget if method != "ar" else None, temperature=temperature, rounds=rounds,
                tokens=sum(len(r.tokens[0]) for r in runs), cpu_dots=first.cpu_dots,
                wall_ms_per_round=1e3 * sum(r.seconds for r in runs) / rounds)


def summarise(events: list[dict], modules: dict, rounds: int, top: int) -> dict:
    loop_events = [e for e in events if e["module"] in modules]
    by_kind, groups = collections.Counter(), collections.defaultdict(lambda: [0.0, 0])
    counts = collections.Counter()
    for e in loop_events:
        ins = modules[e["module"]].get(e["op"], dict(opcode="?", detail="", where="?"))
        kind = kind_of(ins)
        by_kind[kind] += e["ms"]
        counts[kind] += 1
        key = f"{ins['where']} {ins['opcode']}" + (f" {ins['detail']}" if ins["detail"] else "")
        groups[key][0] += e["ms"]
        groups[key][1] += 1
    largest = sorted(groups.items(), key=lambda kv: -kv[1][0])[:top]
    return dict(
        thunk_ms_per_round=sum(by_kind.values()) / rounds,
        by_kind={k: dict(ms_per_round=v / rounds, thunks_per_round=counts[k] / rounds) for k, v in by_kind.items()},
        largest=[dict(group=k, ms_per_round=ms / rounds, thunks_per_round=n / rounds) for k, (ms, n) in largest],
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", default="dominotree,ar", help="comma-separated methods (default: %(default)s)")
    parser.add_argument("--budget", type=int, default=8)
    parser.add_argument("--generations", type=int, default=3, help="traced generations per method")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy (the main job's)")
    parser.add_argument("--top", type=int, default=25, help="largest groups listed")
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS / "profile_round.json")
    parser.add_argument("--keep", action="store_true", help="keep the traces and the HLO dump (path printed)")
    args = parser.parse_args(argv)
    unknown = [m for m in args.methods.split(",") if m not in api.METHODS]
    if unknown:
        parser.error(f"unknown methods {unknown}; known: {', '.join(api.METHODS)}")
    target = api.load_model(smollm2_gguf())
    drafter = api.load_model(cli.shipped(cli.SHIPPED_DRAFTER))
    rows = []
    try:
        for method in args.methods.split(","):
            trace_dir, before = DUMP / f"trace-{method}", set(modules_dumped())
            row = profile(method, args.budget, args.generations, target, drafter, trace_dir, args.temperature)
            compiled = [p for p in modules_dumped() if p not in before]  # this method's generation loop
            row.update(summarise(thunk_events(trace_dir), hlo_instructions(compiled), row["rounds"], args.top))
            rows.append(row)
            print(f"{method}: {row['rounds']} rounds, {row['wall_ms_per_round']:.1f} ms wall and "
                  f"{row['thunk_ms_per_round']:.1f} ms of thunks a round ({row['cpu_dots']} dots)")
            for kind, v in sorted(row["by_kind"].items(), key=lambda kv: -kv[1]["ms_per_round"]):
                print(f"  {kind:22s} {v['ms_per_round']:7.2f} ms  {v['thunks_per_round']:7.1f} thunks")
            for g in row["largest"]:
                print(f"    {g['ms_per_round']:7.3f} ms  x{g['thunks_per_round']:6.1f}  {g['group']}")
            if not args.keep:
                shutil.rmtree(trace_dir)
    finally:
        if args.keep:
            print(f"kept the traces and the HLO dump in {DUMP}")
        else:
            shutil.rmtree(DUMP, ignore_errors=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(machine=machine(), rows=rows), indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
