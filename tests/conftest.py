"""Eight host CPU devices for the whole suite (before any backend starts), so tests/test_sharding.py can split
generations over meshes of up to 8; everything else still runs on the first device."""

import jax

jax.config.update("jax_num_cpu_devices", 8)
