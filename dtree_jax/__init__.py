"""dtree-jax: tree-structured speculative decoding (DominoTree, DDTree, Domino, DFlash) in JAX/Pallas.

``dtree_jax.generate`` is ``dtree_jax.decode.generate``; importing the package has no side effects (the
decode machinery is imported on first use).
"""

__version__ = "0.1.0"
__all__ = ["generate"]


def __getattr__(name):
    if name == "generate":
        from dtree_jax.decode import generate

        return generate
    raise AttributeError(f"module 'dtree_jax' has no attribute {name!r}")
