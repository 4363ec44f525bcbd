"""Suite-wide setup: every process of the suite runs on the CPU backend (with the chip compilers installed,
``.[chips]``, JAX would look for a TPU first), and may compile for chips it does not have
(``chips.allow_compile_only()``, before JAX starts its backends; tests/test_chips.py); no persistent compilation
cache in this process (the CLI turns it on for real runs; in-process CLI tests would point it at temporary
directories that are gone by the next compilation; subprocess tests still use it).  The mesh cases run in their
own process with 8 host devices (tests/test_sharding.py)."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest  # noqa: E402

from dtree_jax import chips  # noqa: E402

chips.allow_compile_only()


@pytest.fixture(autouse=True)
def no_persistent_compilation_cache(monkeypatch):
    from dtree_jax import cli

    monkeypatch.setattr(cli, "compilation_cache", lambda: None)
