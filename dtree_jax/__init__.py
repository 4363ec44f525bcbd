"""dtree-jax: tree-structured speculative decoding (DominoTree, DDTree, Domino, DFlash) in JAX/Pallas."""

__version__ = "0.1.0"
