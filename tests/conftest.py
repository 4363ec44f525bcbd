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


@pytest.fixture(autouse=True, scope="module")
def release_compiled_programs():
    """Each module's compiled programs are freed after it: XLA:CPU maps ~700 memory regions per compiled
    generation and Linux allows 65,530 per process, so a whole suite's programs held at once abort the process."""
    yield
    import jax

    from dtree_jax import running

    running.COMPILED.clear()
    jax.clear_caches()
