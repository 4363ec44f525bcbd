"""The mesh: ``tests/sharded_cases.py`` (sharded decoding on 8 host CPU devices) in its own process, a real
two-process run, and the mesh / multi-host plumbing that needs no devices."""

import json
import re
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from dtree_jax import cli
from dtree_jax.models import sharding

ROOT = Path(__file__).resolve().parent.parent


def test_sharded_cases_on_eight_host_devices():
    """Runs tests/sharded_cases.py under pytest in a fresh process (8 host devices need a fresh JAX)."""
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-o", "addopts=", "-p", "no:cacheprovider",
                          "tests/sharded_cases.py"], cwd=ROOT, capture_output=True, text=True, timeout=1800)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    assert re.search(r"\b\d+ passed", run.stdout) and "failed" not in run.stdout, run.stdout[-2000:]


def test_axes_are_declared_next_to_the_leaves_and_an_undeclared_leaf_is_an_error():
    import dataclasses

    import jax.numpy as jnp

    @jax.tree_util.register_dataclass
    @dataclasses.dataclass(frozen=True)
    class Toy:
        table: jax.Array = sharding.axes("vocab", None)  # [V, H]
        layers: tuple  # of dicts, whose leaves no field declares
        scale: jax.Array = sharding.axes(None, default=None)  # [H]

    toy = Toy(jnp.zeros((8, 4)), ({"w": jnp.zeros((4, 4))},), jnp.ones(4))
    assert sharding.leaf_axes(toy) == [(".table", ("vocab", None)), (".layers[0]['w']", None), (".scale", (None,))]
    assert sharding.unknown_leaves(toy) == [".layers[0]['w']"]
    mesh = sharding.make_mesh(devices=jax.devices()[:1])
    with pytest.raises(ValueError, match=r"\.layers\[0\]\['w'\] declares no logical axes"):
        sharding.shardings(toy, mesh)
    declared = dataclasses.replace(toy, layers=())
    assert sharding.shardings(declared, mesh).table.spec == jax.sharding.PartitionSpec()  # one device: replicated
    with pytest.raises(ValueError, match="rank-1"):
        sharding.shardings(dataclasses.replace(declared, table=jnp.zeros(8)), mesh)
    assert sharding.per_device_bytes(toy, mesh) == 4 * (32 + 16 + 4)  # one device holds it all, declared or not


@pytest.mark.parametrize("text, sizes", [("data=2,model=4", (2, 4)), ("model=8", (1, 8)), ("data=8", (8, 1)),
                                         (" data = 2 , model = 2 ", (2, 2))])
def test_mesh_strings(text, sizes):
    assert tuple(sharding.parse_mesh(text).values()) == sizes


@pytest.mark.parametrize("text", ["data=2,model=4,pipe=2", "data=0", "data=2,data=2", "model", "", "x=1"])
def test_bad_mesh_strings(text):
    with pytest.raises(ValueError, match="mesh"):
        sharding.as_mesh(text)


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


def test_distributed_can_be_forced(monkeypatch):
    calls = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda *a: calls.append(a))
    assert sharding.initialize_distributed({}, force=True) and calls == [()]


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
