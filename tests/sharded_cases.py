"""Sharded decoding on 8 host CPU devices: the same tokens as on one device for every mesh shape, leaves
carrying the table's shardings, no weight gathered whole, orbax restored into the mesh.

Not collected with the suite (the name does not match ``test_*.py``): ``tests/test_sharding.py`` runs this file in
its own process, where the 8 devices are set before JAX starts, so the rest of the suite keeps one device.
"""

import collections
import dataclasses
import json
import re

import jax

jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from dtree_jax import api, cli, convert, loop, running  # noqa: E402
from dtree_jax.models import qwen3_5, sharding  # noqa: E402
from tests.oracles import save_pair  # noqa: E402
from tests.oracles_hybrid import save_hybrid_pair  # noqa: E402

PROMPTS = [[1, 5, 9, 3], [7, 8, 2, 4, 6, 11, 3, 40, 41], [12, 13, 14], [60, 61, 62, 63, 64]]
MESHES = ("data=1,model=8", "data=2,model=4", "data=8,model=1")


@pytest.fixture(autouse=True)
def fresh_compilations(monkeypatch):
    monkeypatch.setattr(running, "COMPILED", collections.OrderedDict())


@pytest.fixture(scope="module")
def dense():
    """The shipped tiny pair (4 query / 2 KV heads: on model = 8 heads stay whole, on 4 the cache holds each KV
    head twice and splits with the query heads, on 2 both split)."""
    root = cli.checkpoints_dir()
    return api.load_model(root / "tiny-target"), api.load_model(root / "tiny-domino")


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    root = tmp_path_factory.mktemp("hybrid")
    save_hybrid_pair(root)
    return api.load_model(root / "target"), api.load_model(root / "drafter")


def _run(target, drafter, method, mesh=None, **kw):
    kw = dict(dict(budget=8, max_new_tokens=16, stop_ids=(), attention_impl="pallas"), **kw)
    return api.generate(target, PROMPTS, method, drafter, mesh=mesh, **kw)


_ONE_DEVICE = {}  # (id(target), method, knobs) -> (target, result): the target held, so its id is not reused


def _one_device(target, drafter, method, **kw):
    """The one-device generation the meshes are compared with, run once per pair, method and knobs."""
    key = (id(target), method, tuple(sorted(kw.items())))
    if key not in _ONE_DEVICE:
        _ONE_DEVICE[key] = (target, _run(target, drafter, method, **kw))
    return _ONE_DEVICE[key][1]


@pytest.mark.parametrize("method", ["ar", "dflash", "dominotree"])
@pytest.mark.parametrize("mesh", MESHES)
def test_sharded_greedy_equals_one_device(dense, method, mesh):
    one = _one_device(*dense, method)
    split = _run(*dense, method, mesh)
    assert split.tokens == one.tokens
    assert [s["rounds"] for s in split.stats] == [s["rounds"] for s in one.stats]


@pytest.mark.parametrize("mesh", MESHES + ("data=4,model=2",))
def test_sharded_sampling_equals_one_device(dense, mesh):
    one = _one_device(*dense, "dominotree", temperature=0.8, seed=3)
    split = _run(*dense, "dominotree", mesh, temperature=0.8, seed=3)
    assert split.tokens == one.tokens
    other = _run(*dense, "dominotree", mesh, temperature=0.8, seed=4)  # control: the seed matters
    assert other.tokens != one.tokens


@pytest.mark.parametrize("method", ["ar", "dominotree"])
@pytest.mark.parametrize("mesh", ["data=2,model=4", "data=1,model=2"])
def test_sharded_hybrid_equals_one_device(hybrid, method, mesh):
    """Gated DeltaNet layers (2 q/k and 4 value heads): on model = 4 each shard picks its q/k head, on 2 both
    split; the tree-GDN kernel runs per shard."""
    one = _one_device(*hybrid, method)
    split = _run(*hybrid, method, mesh)
    assert split.tokens == one.tokens


@pytest.fixture(scope="module", params=["qwen3_moe", "qwen3_5_moe"])
def moe_pair(request, tmp_path_factory):
    from tests.test_moe import tiny_hf

    root = tmp_path_factory.mktemp(request.param)
    save_pair(root, tiny_hf(request.param))
    return api.load_model(root / "target"), api.load_model(root / "drafter")


@pytest.mark.parametrize("method", ["ar", "dominotree"])
def test_sharded_moe_equals_one_device_with_the_experts_split(moe_pair, method):
    """Qwen3-MoE and Qwen3.5-MoE on data=2,model=4: the same tokens as one device, and every device holds a
    quarter of every expert (the intermediate dimension split over ``model``; the router replicated)."""
    target, drafter = moe_pair
    assert _run(target, drafter, method, "data=2,model=4").tokens == _run(target, drafter, method).tokens
    placed = api.load_model(target, "data=2,model=4").params
    experts = [getattr(x, "moe", getattr(x, "mlp", None)) for x in placed.layers]
    experts = [e for e in experts if e is not None and hasattr(e, "router")]
    assert experts
    for e in experts:
        for w in (e.w_gate, e.w_up, e.w_down):
            per_device = {s.data.nbytes for s in w.addressable_shards}
            assert per_device == {w.nbytes // 4}, (w.shape, w.sharding.spec)
        assert e.router.sharding.spec == P()


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


def test_the_kv_cache_splits_with_the_query_heads(dense, hybrid):
    """``sharding.for_mesh``: where ``model`` is a multiple of the KV heads the cache repeats them to one per
    device (split, not replicated); the weights keep their shapes."""
    (target, drafter), (htarget, _) = dense, hybrid
    for mesh, repeat in (("data=2,model=4", 2), ("data=1,model=2", 1), ("data=1,model=8", 1), ("data=8", 1)):
        m = sharding.as_mesh(mesh)
        assert sharding.for_mesh(target.cfg, m).kv_head_repeat == repeat  # 4 query heads, 2 KV heads
        assert sharding.for_mesh(htarget.cfg, m).kv_head_repeat == repeat
    mesh = sharding.make_mesh(data=2, model=4)
    cfg = sharding.for_mesh(target.cfg, mesh)
    assert cfg.cache_kv_heads == 4 and sharding.for_mesh(drafter.cfg, mesh).model.kv_head_repeat == 2
    spec = api.make_spec(api.Model(target.kind, cfg, target.params), None, "ar", budget=1, node_topk=1,
                         corr_topm=None, max_depth=None, max_new_tokens=4, prompt_bucket=16, stop_ids=(), top_k=0,
                         top_p=1.0, mesh=mesh)
    with jax.set_mesh(mesh):
        state = loop.prefill_on_device(spec, api.load_model(target, mesh).params, None, jnp.zeros((4, 16), jnp.int32),
                                       jnp.full((4,), 3, jnp.int32), api.request_keys(0, 4), jnp.float32(0))
    k = state.cache.k[0]
    assert k.shape[2] == 4 and k.sharding.spec == P("data", None, "model")
    assert k.addressable_shards[0].data.shape == (2, k.shape[1], 1, k.shape[3])  # one KV head per device
    with pytest.raises(ValueError, match="kv_head_repeat"):
        dataclasses.replace(target.cfg, kv_head_repeat=3)  # 4 query heads do not split over 6


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
    ((compiled, *_),) = running.COMPILED.values()
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


def test_hf_reading_streams_each_leaf_into_its_shards(tmp_path, monkeypatch):
    """A Qwen3-Next checkpoint (MoE experts stacked, fused GDN projections regrouped) read into a 2x4 mesh:
    every leaf equals the one-device read and has its table sharding, and each leaf is placed as soon as its
    tensors are read: the reads between two placements never add up to more than twice the largest leaf (the
    whole model was read before the first placement until this streamed)."""
    from safetensors.numpy import save_file

    from tests.oracles_hybrid import checkpoint_state, tiny_hybrid

    hf, config = tiny_hybrid("qwen3_next", seed=5)
    (tmp_path / "config.json").write_text(json.dumps(config))
    save_file(checkpoint_state(hf), str(tmp_path / "model.safetensors"))
    _, _, one = convert.load_hf(tmp_path, "float32")
    events = []
    read, put = convert.CheckpointReader.read, sharding.put
    monkeypatch.setattr(convert.CheckpointReader, "read",
                        lambda self, raw: (x := read(self, raw), events.append(x.nbytes))[0])
    monkeypatch.setattr(sharding, "put", lambda x, s: events.append("put") or put(x, s))
    mesh = sharding.make_mesh(data=2, model=4)
    _, cfg, split = convert.load_hf(tmp_path, "float32", mesh=mesh)
    want = sharding.shardings(one, mesh, cfg)
    leaves = jax.tree.leaves(one)
    assert events.count("put") == len(leaves)
    segments, run = [], 0
    for e in events:
        if e == "put":
            segments.append(run)
            run = 0
        else:
            run += e
    assert max(segments) <= 2 * max(x.nbytes for x in leaves) < sum(x.nbytes for x in leaves) / 4
    assert split.layers[0].mlp.w_gate.sharding.spec == P(None, None, "model")
    for a, b, s in zip(leaves, jax.tree.leaves(split), jax.tree.leaves(want)):
        assert b.sharding == s
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_mesh_larger_than_the_machine_is_refused():
    with pytest.raises(ValueError, match="needs 16 devices; 8 are visible .on a CPU, XLA_FLAGS"):
        sharding.as_mesh("data=4,model=4")


@pytest.mark.parametrize("text, sizes", [("data=2,model=4", (2, 4)), ("model=8", (1, 8)), ("data=8", (8, 1))])
def test_mesh_strings_make_meshes(text, sizes):
    assert tuple(sharding.as_mesh(text).shape.values()) == sizes
    assert sharding.as_mesh(sharding.as_mesh(text)) is not None
