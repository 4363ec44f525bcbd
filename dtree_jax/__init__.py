"""dtree-jax: tree-structured speculative decoding (DominoTree, DDTree, Domino, DFlash) in JAX/Pallas.

``dtree_jax.generate`` and ``dtree_jax.load_model`` are ``dtree_jax.api``'s; importing the package has no
side effects (the API is imported on first use).
"""

__version__ = "0.1.0"
__all__ = ["generate", "load_model"]


def __getattr__(name):
    if name in __all__:
        from dtree_jax import api

        return getattr(api, name)
    raise AttributeError(f"module 'dtree_jax' has no attribute {name!r}")
