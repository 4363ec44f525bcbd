"""Shared fixtures for the builder tests: a tiny random Domino model and its rounds (no tests here)."""

import jax
import jax.numpy as jnp
import numpy as np

from dtree_jax.builders import DraftRound
from dtree_jax.models.domino_head import DominoHead, gru_step

V, H, G, E = 89, 12, 10, 24


def tiny_model(seed: int = 0) -> tuple[DominoHead, jax.Array]:
    ks = jax.random.split(jax.random.key(seed), 5)
    head = DominoHead(
        w_ih=jax.random.normal(ks[0], (H, 3 * G)) * 0.5,
        w_hh=jax.random.normal(ks[1], (G, 3 * G)) * 0.5,
        w1=jax.random.normal(ks[2], (H + G, E)) * 0.5,
        w2=jax.random.normal(ks[3], (V, E)) * 0.5,
    )
    return head, jax.random.normal(ks[4], (V, H))


def random_round(head: DominoHead, embed: jax.Array, seed: int, batch: int, depth: int) -> DraftRound:
    """Continuous random draft rows and logits (tie-free with probability 1)."""
    ks = jax.random.split(jax.random.key(1000 + seed), 3)
    ph = jax.random.normal(ks[0], (batch, depth, H))
    base = jax.random.normal(ks[1], (batch, depth, V)) * 2.0
    root = jax.random.randint(ks[2], (batch,), 0, V, dtype=jnp.int32)
    root_state = gru_step(head, jnp.zeros((batch, G)), embed[root])
    return DraftRound(ph, base, root_state, root)


def tree_arrays(tree) -> dict:
    return {f: np.asarray(getattr(tree, f)) for f in ("tokens", "parents", "depths", "scores", "mask")}


def assert_same_tree(got, want, atol: float = 1e-5) -> None:
    a, b = tree_arrays(got), tree_arrays(want)
    for f in ("tokens", "parents", "depths", "mask"):
        np.testing.assert_array_equal(a[f], b[f], err_msg=f)
    np.testing.assert_array_equal(np.isfinite(a["scores"]), np.isfinite(b["scores"]))
    fin = np.isfinite(b["scores"])
    np.testing.assert_allclose(a["scores"][fin], b["scores"][fin], atol=atol, rtol=0)
