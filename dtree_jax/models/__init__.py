"""Target models (Qwen3 / Llama / Qwen2 dense, Qwen3.5 / Qwen3-Next hybrid) and the DFlash/Domino drafter,
functional JAX.  ``families`` is the one registry of model families (which configs each reads, its module,
its checkpoint key names); the converter and the API both use it.
"""
