"""Sharded decoding on 8 host CPU devices (tests/conftest.py): the same tokens as on one device for every mesh
shape, leaves carrying the table's shardings, no weight gathered whole, and orbax restored into the mesh."""

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from dtree_jax import api, cli, convert, loop
from dtree_jax.models import qwen3_5, sharding
from tests.oracles import tiny_domino
from tests.oracles_hybrid import tiny_hybrid

PROMPTS = [[1, 5, 9, 3], [7, 8, 2, 4, 6, 11, 3, 40, 41], [12, 13, 14], [60, 61, 62, 63, 64]]
MESHES = ("data=1,model=8", "data=2,model=4", "data=8,model=1")


@pytest.fixture(autouse=True)
def fresh_compilations(monkeypatch):
    monkeypatch.setattr(api, "COMPILED", {})


@pytest.fixture(scope="module")
def dense():
    """The shipped tiny pair (4 query / 2 KV heads: on model = 8 heads stay whole, on 4 each shard picks its KV
    head, on 2 both split)."""
    root = cli.checkpoints_dir()
    return api.load_model(root / "tiny-target"), api.load_model(root / "tiny-domino")


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    root = tmp_path_factory.mktemp("hybrid")
    hf, _ = tiny_hybrid("qwen3_5", seed=5)
    hf.save_pretrained(root / "target")
    dom, _, _ = tiny_domino(shift_label=False, seed=6)
    dom.save_pretrained(root / "drafter")
    cfg = json.loads((root / "drafter" / "config.json").read_text())
    cfg["num_target_layers"] = hf.config.num_hidden_layers
    (root / "drafter" / "config.json").write_text(json.dumps(cfg))
    return api.load_model(root / "target"), api.load_model(root / "drafter")


def _run(target, drafter, method, mesh=None, **kw):
    kw = dict(dict(budget=8, max_new_tokens=16, stop_ids=(), attention_impl="pallas"), **kw)
    return api.generate(target, PROMPTS, method, drafter, mesh=mesh, **kw)


@pytest.mark.parametrize("method", ["ar", "dflash", "dominotree"])
@pytest.mark.parametrize("mesh", MESHES)
def test_sharded_greedy_equals_one_device(dense, method, mesh):
    one = _run(*dense, method)
    split = _run(*dense, method, mesh)
    assert split.tokens == one.tokens
    assert [s["rounds"] for s in split.stats] == [s["rounds"] for s in one.stats]


@pytest.mark.parametrize("mesh", MESHES + ("data=4,model=2",))
def test_sharded_sampling_equals_one_device(dense, mesh):
    one = _run(*dense, "dominotree", temperature=0.8, seed=3)
    split = _run(*dense, "dominotree", mesh, temperature=0.8, seed=3)
    assert split.tokens == one.tokens
    other = _run(*dense, "dominotree", mesh, temperature=0.8, seed=4)  # control: the seed matters
    assert other.tokens != one.tokens


@pytest.mark.parametrize("method", ["ar", "dominotree"])
@pytest.mark.parametrize("mesh", ["data=2,model=4", "data=1,model=2"])
def test_sharded_hybrid_equals_one_device(hybrid, method, mesh):
    """Gated DeltaNet layers (2 q/k and 4 value heads): on model = 4 each shard picks its q/k head, on 2 both
    split; the tree-GDN kernel runs per shard."""
    one = _run(*hybrid, method)
    split = _run(*hybrid, method, mesh)
    assert split.tokens == one.tokens


def test_sharded_hybrid_sampling_equals_one_device(hybrid):
    one = _run(*hybrid, "dominotree", temperature=1.0, seed=1)
    assert _run(*hybrid, "dominotree", "data=2,model=4", temperature=1.0, seed=1).tokens == one.tokens


def test_the_table_knows_every_leaf(dense, hybrid):
    (target, drafter), (htarget, _) = dense, hybrid
    spec = api.make_spec(target, drafter, "dominotree", budget=8, node_topk=4, corr_topm=None, max_depth=None,
                         max_new_tokens=8, prompt_bucket=16, stop_ids=(), top_k=0, top_p=1.0)
    state = jax.eval_shape(lambda: loop.prefill(spec, target.params, drafter.params, jnp.zeros((2, 16), jnp.int32),
                                                jnp.ones((2,), jnp.int32), api.request_keys(0, 2), jnp.float32(0)))
    hcache = jax.eval_shape(lambda: qwen3_5.init_cache(htarget.cfg, 2, 64))
    for tree in (target.params, drafter.params, htarget.params, state, hcache):
        assert sharding.unknown_leaves(tree) == []
    assert drafter.params.head is not None


def test_leaves_carry_the_tables_shardings(dense):
    target, drafter = dense
    mesh = sharding.make_mesh(data=2, model=4)
    placed = api.load_model(target, mesh)
    layer = placed.params.layers[0]
    assert layer.wq.sharding.spec == P(None, "model")  # 4 query heads over model = 4
    assert layer.wk.sharding.spec == P()  # 2 KV heads: replicated over model = 4
    assert layer.w_down.sharding.spec == P("model")
    assert placed.params.embed.sharding.spec == P("model")  # vocabulary rows
    assert layer.wq.addressable_shards[0].data.shape == (target.cfg.hidden_size, layer.wq.shape[1] // 4)
    spec = api.make_spec(target, drafter, "dominotree", budget=8, node_topk=4, corr_topm=None, max_depth=None,
                         max_new_tokens=8, prompt_bucket=16, stop_ids=(), top_k=0, top_p=1.0, mesh=mesh)
    dparams = api.load_model(drafter, mesh).params
    with jax.set_mesh(mesh):
        state = loop.prefill_on_device(spec, placed.params, dparams, jnp.zeros((4, 16), jnp.int32),
                                       jnp.full((4,), 3, jnp.int32), api.request_keys(0, 4), jnp.float32(0))
    for tree, cfg in ((state.cache, target.cfg), (state.dcache, drafter.cfg)):
        want = sharding.shardings(tree, mesh, cfg)
        for x, s in zip(jax.tree.leaves(tree), jax.tree.leaves(want)):
            assert x.sharding.is_equivalent_to(s, x.ndim)
    assert state.cache.k[0].sharding.spec == P("data")  # requests over data, KV heads replicated
    assert state.out.sharding.spec == P("data")
    for x in jax.tree.leaves(placed.params):  # every leaf as the table says
        assert isinstance(x.sharding, NamedSharding)


def _full_weight_gathers(hlo: str, params) -> list[str]:
    """All-gathers in compiled HLO whose result is a whole param matrix (same dims and element type)."""
    names = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}
    weights = {(names[str(x.dtype)], tuple(x.shape)) for x in jax.tree.leaves(params) if x.ndim >= 2}
    found = []
    for ty, dims, line in re.findall(r"= (\w+)\[([\d,]*)\]\S* (all-gather(?:-start)?\(.*)", hlo):
        if (ty, tuple(int(d) for d in dims.split(",") if d)) in weights:
            found.append(line[:120])
    return found


def test_no_weight_is_gathered_whole_in_a_round(dense):
    target, drafter = dense
    mesh = sharding.make_mesh(data=2, model=4)
    t, d = api.load_model(target, mesh), api.load_model(drafter, mesh)
    _run(t, d, "dominotree", mesh)
    (compiled,) = api.COMPILED.values()
    hlo = compiled.as_text()
    assert "all-reduce" in hlo or "all-gather" in hlo  # it is really split
    assert _full_weight_gathers(hlo, (t.params, d.params)) == []
    # Control: the detector sees a weight gathered whole.
    w = t.params.layers[0].wq
    gathered = jax.jit(lambda w: jax.lax.with_sharding_constraint(w, NamedSharding(mesh, P())) * 2).lower(w)
    assert _full_weight_gathers(gathered.compile().as_text(), t.params)


def test_orbax_restore_into_a_mesh_equals_one_device(tmp_path):
    out = tmp_path / "conv"
    convert.convert(cli.checkpoints_dir() / "tiny-target", cli.checkpoints_dir() / "tiny-domino", out_dir=out,
                    dtype="float32", progress=False)
    mesh = sharding.make_mesh(data=2, model=4)
    for role in ("target", "drafter"):
        one = api.load_model(out / role)
        split = api.load_model(out / role, mesh)
        want = sharding.shardings(one.params, mesh, one.cfg)
        for a, b, s in zip(jax.tree.leaves(one.params), jax.tree.leaves(split.params), jax.tree.leaves(want)):
            assert b.sharding == s
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_hf_directory_loads_into_a_mesh(dense):
    target, _ = dense
    mesh = sharding.make_mesh(data=1, model=4)
    split = api.load_model(cli.checkpoints_dir() / "tiny-target", mesh)
    assert split.params.layers[1].w_gate.sharding.spec == P(None, "model")
    for a, b in zip(jax.tree.leaves(target.params), jax.tree.leaves(split.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("text, sizes", [("data=2,model=4", (2, 4)), ("model=8", (1, 8)), ("data=8", (8, 1)),
                                         (" data = 2 , model = 2 ", (2, 2))])
def test_mesh_strings(text, sizes):
    assert tuple(sharding.parse_mesh(text).values()) == sizes
    assert tuple(sharding.as_mesh(text).shape.values()) == sizes


@pytest.mark.parametrize("text", ["data=2,model=4,pipe=2", "data=0", "data=2,data=2", "model", "", "x=1"])
def test_bad_mesh_strings(text):
    with pytest.raises(ValueError, match="mesh"):
        sharding.as_mesh(text)


def test_a_mesh_larger_than_the_machine_is_refused():
    with pytest.raises(ValueError, match="needs 16 devices; 8 are visible .on a CPU, XLA_FLAGS"):
        sharding.as_mesh("data=4,model=4")


@pytest.mark.parametrize("env, called", [
    ({}, None),
    ({"SLURM_NTASKS": "1"}, None),
    ({"SLURM_NTASKS": "4"}, ()),
    ({"TPU_WORKER_HOSTNAMES": "host-a,host-b"}, ()),
    ({"TPU_WORKER_HOSTNAMES": "host-a"}, None),
    ({"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "1"},
     ("10.0.0.1:1234", 2, 1)),
])
def test_distributed_initialisation_follows_the_environment(monkeypatch, env, called):
    calls = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda *a: calls.append(a))
    assert sharding.initialize_distributed(env) == (called is not None)
    assert calls == ([] if called is None else [called])


def test_a_coordinator_without_process_numbers_is_refused(monkeypatch):
    monkeypatch.setattr(jax.distributed, "initialize", lambda *a: pytest.fail("must not initialise"))
    with pytest.raises(ValueError, match="JAX_NUM_PROCESSES and JAX_PROCESS_ID"):
        sharding.initialize_distributed({"JAX_COORDINATOR_ADDRESS": "h:1"})


def test_two_processes_decode_as_one(tmp_path):
    """A real multi-host run on this machine: two processes of 4 host devices each (jax.distributed through
    JAX_COORDINATOR_ADDRESS, gloo between them), the same command in both, a data=2 x model=4 mesh over all 8
    devices; process 0 prints what one device gives, process 1 prints nothing."""
    import os
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    root = cli.checkpoints_dir()
    argv = [sys.executable, "-m", "dtree_jax.cli", "generate", "--target", str(root / "tiny-target"), "--drafter",
            str(root / "tiny-domino"), "--prompt-ids", "72,101,108,108,111", "--max-new-tokens", "16", "--budget", "4",
            "--json", "--no-compare-ar"]
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4",
               JAX_COORDINATOR_ADDRESS=f"localhost:{port}", JAX_NUM_PROCESSES="2")
    procs = [subprocess.Popen(argv + ["--mesh", "data=2,model=4"], env=dict(env, JAX_PROCESS_ID=str(i)),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
             for i in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in outs]
    one = subprocess.run(argv, capture_output=True, text=True, cwd=tmp_path, check=True,
                         env={k: v for k, v in os.environ.items() if not k.startswith("JAX_COORD")})
    results = [[json.loads(line) for line in out.splitlines() if line.startswith("{")] for out, _ in outs]
    assert [r["tokens"] for r in results[0]] == [json.loads(one.stdout)["tokens"]]
    assert results[1] == []  # (gloo's own connection lines go to stdout from C++; nothing of ours)
