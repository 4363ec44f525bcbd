"""Pallas kernels for tree verification, each beside a pure-jnp ``reference_*`` with the same signature."""
