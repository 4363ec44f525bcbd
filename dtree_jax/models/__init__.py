"""Target models (Qwen3 dense, Qwen3.5/Qwen3-Next hybrid) and the DFlash/Domino drafter, functional JAX.

``MODEL_MODULES`` is the one map from a model kind to its module (the converter and the API both use it).
"""

DENSE_MODEL_TYPES = ("qwen3", "qwen2", "llama")  # one module; the kind is the model_type
MODEL_MODULES = {
    **{kind: "dtree_jax.models.qwen3" for kind in DENSE_MODEL_TYPES},
    "qwen3_5": "dtree_jax.models.qwen3_5",
    "drafter": "dtree_jax.models.drafter",
}
TARGET_KINDS = DENSE_MODEL_TYPES + ("qwen3_5",)
