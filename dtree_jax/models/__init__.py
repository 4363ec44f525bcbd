"""Target models (Qwen3 dense, Qwen3.5/Qwen3-Next hybrid) and the DFlash/Domino drafter, functional JAX."""
