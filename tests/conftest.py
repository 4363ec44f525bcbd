"""Suite-wide setup: no persistent compilation cache in this process (the CLI turns it on for real runs;
in-process CLI tests would point it at temporary directories that are gone by the next compilation; subprocess
tests still use it).  The mesh cases run in their own process with 8 host devices (tests/test_sharding.py)."""

import pytest


@pytest.fixture(autouse=True)
def no_persistent_compilation_cache(monkeypatch):
    from dtree_jax import cli

    monkeypatch.setattr(cli, "compilation_cache", lambda: None)
