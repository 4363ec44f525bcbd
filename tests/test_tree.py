import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from dtree_jax.demo import CARD_CHAIN_PATHS, CARD_TREE_PATHS
from dtree_jax.tree import (
    ancestor_bits,
    ancestor_mask,
    chain_tree,
    check_parents,
    dfs_intervals,
    expected_accept_length,
    mask_from_bits,
    mask_from_intervals,
    position_ids,
    tree_from_paths,
    verify_mask,
)


def loop_mask(parents):
    n = len(parents)
    m = np.zeros((n, n), bool)
    for i in range(n):
        j = i
        while j != -1:
            m[i, j] = True
            j = parents[j]
    return m


random_parents = st.integers(1, 40).flatmap(
    lambda n: st.tuples(*[st.just(-1)] + [st.integers(0, i - 1) for i in range(1, n)])
).map(lambda t: np.asarray(t, np.int32))


def test_card_tree_mask_rows():
    t = tree_from_paths(CARD_TREE_PATHS)
    assert t.num_nodes == 10
    assert list(np.nonzero(t.mask[9])[0]) == [0, 1, 3, 6, 9]
    assert list(np.nonzero(t.mask[5])[0]) == [0, 2, 5]
    assert list(t.depths) == [0, 1, 1, 2, 2, 2, 3, 3, 3, 4]


def test_paths_sorted_and_deduplicated():
    t = tree_from_paths([(1,), (0, 0), (0,), (0,), ()])
    assert t.paths == ((0,), (1,), (0, 0))
    assert list(t.parents) == [-1, 0, 0, 1]


def test_card_expected_lengths():
    tau_chain = expected_accept_length(tree_from_paths(CARD_CHAIN_PATHS), [0.7, 0.15])
    tau_tree = expected_accept_length(tree_from_paths(CARD_TREE_PATHS), [0.7, 0.15])
    assert round(tau_chain, 2) == 2.77 and round(tau_tree, 2) == 3.28


def test_empty_tree_is_plain_decoding():
    t = tree_from_paths([])
    assert t.num_nodes == 1 and t.mask.shape == (1, 1) and t.mask[0, 0]
    assert list(t.parents) == [-1]
    assert expected_accept_length(t, [0.7]) == 1.0


def test_missing_parent_rejected():
    with pytest.raises(ValueError, match=r"\(0, 1\)"):
        tree_from_paths([(0,), (0, 1, 2)])


@pytest.mark.parametrize("bad", [[(-1,)], [(0.5,)], [(True,)]])
def test_bad_ranks_rejected(bad):
    with pytest.raises(ValueError):
        tree_from_paths(bad)


@pytest.mark.parametrize("probs", [[1.2], [-0.1, 0.5], [0.7, 0.5], [float("nan")]])
def test_rank_probs_validated(probs):
    with pytest.raises(ValueError):
        expected_accept_length(tree_from_paths([(0,)]), probs)


def test_rank_without_probability_rejected():
    with pytest.raises(ValueError, match="rank 1"):
        expected_accept_length(tree_from_paths([(0,), (1,)]), [0.7])


@pytest.mark.parametrize(
    "parents, msg",
    [
        ([-1, 0, 3, 2], "cycle"),
        ([-1, 2, 0], "precede"),
        ([0, 0], "root"),
        ([-1, 5], "out of range"),
        ([-1, 1], "cycle|precede"),
    ],
)
def test_bad_parents_rejected(parents, msg):
    with pytest.raises(ValueError, match=msg):
        check_parents(np.asarray(parents))
    with pytest.raises(ValueError):
        ancestor_mask(np.asarray(parents))


@settings(max_examples=60, deadline=None)
@given(random_parents)
def test_jit_ancestor_mask_equals_loop(parents):
    got = np.asarray(jax.jit(ancestor_mask)(parents))
    np.testing.assert_array_equal(got, loop_mask(parents))


@settings(max_examples=40, deadline=None)
@given(random_parents)
def test_compact_forms_roundtrip(parents):
    mask = loop_mask(parents)
    pre, end = jax.jit(dfs_intervals)(parents)
    np.testing.assert_array_equal(np.asarray(mask_from_intervals(pre, end)), mask)
    assert sorted(np.asarray(pre).tolist()) == list(range(len(parents)))  # a permutation
    bits = ancestor_bits(jnp.asarray(mask))
    np.testing.assert_array_equal(np.asarray(mask_from_bits(bits, len(parents))), mask)


def test_batched_helpers_and_positions():
    parents = np.array([[-1, 0, 0, 1], [-1, 0, 1, 2]], np.int32)
    mask = ancestor_mask(parents)
    assert mask.shape == (2, 4, 4)
    depths = jnp.sum(mask, -1) - 1
    pos = position_ids(depths, jnp.array([5, 9]))
    np.testing.assert_array_equal(pos, [[5, 6, 6, 7], [9, 10, 11, 12]])  # siblings share a position
    vm = verify_mask(mask, jnp.array([2, 0]), cache_len=3)
    assert vm.shape == (2, 4, 7)
    np.testing.assert_array_equal(vm[0, :, :3], [[1, 1, 0]] * 4)
    np.testing.assert_array_equal(vm[1, :, :3], [[0, 0, 0]] * 4)
    np.testing.assert_array_equal(vm[:, :, 3:], mask)


def test_chain_tree():
    t = chain_tree(jnp.array([[5, 6, 7]]))
    np.testing.assert_array_equal(t.parents, [[-1, 0, 1]])
    np.testing.assert_array_equal(t.mask[0], loop_mask([-1, 0, 1]))
