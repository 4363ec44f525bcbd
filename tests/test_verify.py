import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from dtree_jax.demo import CARD_TREE_PATHS
from dtree_jax.tree import tree_from_paths
from dtree_jax.models.cache import compact_kv
from dtree_jax.verify import (accept_greedy, accept_rejection, accept_sampled, filter_logits, first_argmax, invert_cdf,
                              sample_categorical)


def walk(parents, tokens, target_next):
    """The card's sequential walk (first matching child wins): the reference when sibling tokens differ."""
    node, out, path = 0, [], [0]
    while True:
        kids = [c for c in range(len(parents)) if parents[c] == node]
        nxt = next((c for c in kids if tokens[c] == target_next[node]), None)
        out.append(int(target_next[node]))
        if nxt is None:
            return out, path
        node = nxt
        path.append(node)


def dfs_longest(parents, tokens, target_next):
    """Domino-Tree's rule: depth-first over matching children in index order; a strictly longer path
    replaces the best one.  Returns (emitted, path)."""
    best = [0]

    def visit(node, path):
        if len(path) > len(best):
            best[:] = path
        for c in range(len(parents)):
            if parents[c] == node and tokens[c] == target_next[node]:
                visit(c, path + [c])

    visit(0, [0])
    return [int(tokens[c]) for c in best[1:]] + [int(target_next[best[-1]])], best


def brute_force_longest(parents, tokens, target_next):
    """Longest root path whose every node matches its parent's target token."""
    n, best = len(parents), 0
    for leaf in range(n):
        path, j = [], leaf
        while j != -1:
            path.append(j)
            j = parents[j]
        if all(tokens[c] == target_next[parents[c]] for c in path[:-1]):
            best = max(best, len(path) - 1)
    return best + 1


tree_case = st.integers(1, 24).flatmap(
    lambda n: st.tuples(
        st.tuples(*[st.just(-1)] + [st.integers(0, i - 1) for i in range(1, n)]),
        st.lists(st.integers(0, 3), min_size=n, max_size=n),
        st.lists(st.integers(0, 3), min_size=n, max_size=n),
    )
)


@settings(max_examples=120, deadline=None)
@given(tree_case)
def test_greedy_equals_the_reference_dfs_and_brute_force(case):
    """Equal sibling tokens are frequent here (tokens drawn from 4 values)."""
    parents, tokens, target = (np.asarray(x, np.int32) for x in case)
    res = jax.jit(accept_greedy)(parents, tokens, target)
    out, path = dfs_longest(parents, tokens, target)
    k = int(res.num_emitted)
    assert k == len(out) == brute_force_longest(parents, tokens, target)
    assert list(np.asarray(res.emitted[:k])) == out and np.all(np.asarray(res.emitted[k:]) == -1)
    assert list(np.asarray(res.path[:k])) == path and np.all(np.asarray(res.path[k:]) == -1)
    distinct = all(
        len({tokens[c] for c in range(len(parents)) if parents[c] == p})
        == sum(1 for c in range(len(parents)) if parents[c] == p)
        for p in range(len(parents))
    )
    if distinct:  # then the plain walk is the same rule
        assert (out, path) == walk(parents, tokens, target)


def test_equal_siblings_follow_the_longer_branch():
    """The issue's case: two children of the root carry token 0; only the second has an accepted child."""
    parents, tokens, target = [-1, 0, 0, 2], [0, 0, 0, 2], [0, 4, 2, 2]
    res = accept_greedy(np.array(parents), np.array(tokens), np.array(target))
    assert int(res.num_emitted) == 3 and list(res.path[:3]) == [0, 2, 3] and list(res.emitted[:3]) == [0, 2, 2]
    assert len(walk(parents, tokens, target)[0]) == 2  # the first-child walk (the old rule) stops earlier
    # Equally deep branches: the first one in depth-first order wins, not the lowest node index.
    parents, tokens, target = [-1, 0, 0, 2, 1], [0, 5, 5, 6, 7], [5, 7, 6, 1, 2]
    res = accept_greedy(np.array(parents), np.array(tokens), np.array(target))
    assert list(res.path[:3]) == [0, 1, 4] and list(res.emitted[:3]) == [5, 7, 2]


def card_tokens():
    """Draft token at each node of the card's tree: rank r at depth d -> token 10 * d + r."""
    t = tree_from_paths(CARD_TREE_PATHS)
    tokens = [0] + [10 * len(p) + p[-1] for p in t.paths]
    return t, np.asarray(tokens, np.int32)


def test_walk_takes_second_rank_branch():
    t, tokens = card_tokens()
    target = np.full(10, 99, np.int32)
    target[0] = 11  # the target picks the rank-1 candidate at depth 1 (node 2)
    target[2] = 20  # then rank-0 under it (node 5)
    res = accept_greedy(t.parents, tokens, target)
    assert list(res.path[:3]) == [0, 2, 5]
    assert list(res.emitted[:3]) == [11, 20, 99]


def test_walk_to_deepest_leaf_emits_all_four_plus_bonus():
    t, tokens = card_tokens()
    target = np.full(10, 99, np.int32)
    for node, nxt in ((0, 10), (1, 20), (3, 30), (6, 40)):
        target[node] = nxt
    target[9] = 77
    res = accept_greedy(t.parents, tokens, target)
    assert int(res.num_emitted) == 5
    assert list(res.emitted[:5]) == [10, 20, 30, 40, 77]
    assert list(res.path[:5]) == [0, 1, 3, 6, 9]


def test_greedy_batched_and_mismatched_lengths():
    parents = np.array([[-1, 0, 1], [-1, 0, 0]], np.int32)
    tokens = np.array([[0, 5, 6], [0, 5, 6]], np.int32)
    target = np.array([[5, 6, 7], [6, 1, 2]], np.int32)
    res = accept_greedy(parents, tokens, target)
    np.testing.assert_array_equal(res.num_emitted, [3, 2])
    np.testing.assert_array_equal(res.emitted, [[5, 6, 7], [6, 2, -1]])
    with pytest.raises(ValueError, match="mismatched"):
        accept_greedy(parents, tokens[:, :2], target)


# ------------------------------------------------------------------------------------------------
# Distribution tests (chi-square on a small vocabulary, fixed seeds)
# ------------------------------------------------------------------------------------------------

V, SAMPLES = 6, 12000


def chi2_pvalue(counts, probs):
    counts, probs = np.asarray(counts, float), np.asarray(probs, float)
    keep = probs > 0
    assert counts[~keep].sum() == 0, "sampled a zero-probability token"
    expected = probs[keep] * counts.sum()
    stat = ((counts[keep] - expected) ** 2 / expected).sum()
    df = keep.sum() - 1
    return float(jax.scipy.special.gammaincc(df / 2.0, stat / 2.0))


def softmax(x, t=1.0):
    e = np.exp((x - x.max()) / t)
    return e / e.sum()


PARENTS = np.array([-1, 0, 0, 1], np.int32)  # root -> {1, 2}; 1 -> 3
LOGITS = np.random.default_rng(0).normal(size=(4, V)).astype(np.float32) * 1.5


def test_accept_sampled_is_the_target_distribution():
    tokens = np.array([0, 2, 4, 1], np.int32)
    temperature = 0.8
    keys = jax.random.split(jax.random.key(1), SAMPLES)
    res = jax.jit(jax.vmap(lambda k: accept_sampled(PARENTS, tokens, LOGITS, k, temperature)))(keys)
    first = np.asarray(res.emitted[:, 0])
    assert chi2_pvalue(np.bincount(first, minlength=V), softmax(LOGITS[0], temperature)) > 1e-3
    # Given node 1 (token 2) accepted, the next token is the target's sample at node 1.
    second = np.asarray(res.emitted[:, 1])[first == 2]
    assert chi2_pvalue(np.bincount(second, minlength=V), softmax(LOGITS[1], temperature)) > 1e-3


def test_accept_sampled_topk_topp_support():
    keys = jax.random.split(jax.random.key(2), 2000)
    tokens = np.array([0, 2, 4, 1], np.int32)
    res = jax.vmap(lambda k: accept_sampled(PARENTS, tokens, LOGITS, k, 1.0, top_k=2))(keys)
    allowed = set(np.argsort(-LOGITS[0])[:2].tolist())
    assert set(np.asarray(res.emitted[:, 0]).tolist()) <= allowed
    filt = filter_logits(jnp.asarray(LOGITS[0]), 1.0, top_p=0.5)
    kept = np.isfinite(np.asarray(filt))
    p = softmax(LOGITS[0])
    order = np.argsort(-p)
    need = np.searchsorted(np.cumsum(p[order]), 0.5) + 1  # smallest nucleus reaching 0.5
    assert kept.sum() == need and kept[order[:need]].all()


DRAFT = np.random.default_rng(3).dirichlet(np.ones(V), size=4).astype(np.float32)


def sampled_draft_tokens(key):
    """Two i.i.d. children of the root from DRAFT[0], one grandchild under child 1 from DRAFT[1]."""
    k0, k1, k2 = jax.random.split(key, 3)
    c1 = jax.random.categorical(k0, jnp.log(DRAFT[0]))
    c2 = jax.random.categorical(k1, jnp.log(DRAFT[0]))
    g = jax.random.categorical(k2, jnp.log(DRAFT[1]))
    return jnp.stack([0, c1, c2, g]).astype(jnp.int32)


def run_rule(rule, seed):
    def one(key):
        kd, ka = jax.random.split(key)
        return rule(sampled_draft_tokens(kd), ka)

    res = jax.jit(jax.vmap(one))(jax.random.split(jax.random.key(seed), SAMPLES))
    return np.asarray(res.emitted[:, 0]), np.asarray(res.emitted[:, 1]), np.asarray(res.path[:, 1])


def test_accept_rejection_is_the_target_distribution():
    rule = lambda toks, key: accept_rejection(PARENTS, toks, DRAFT, LOGITS, key, 1.0)
    first, second, node = run_rule(rule, 4)
    assert chi2_pvalue(np.bincount(first, minlength=V), softmax(LOGITS[0])) > 1e-3
    given1 = second[node == 1]  # the second token after accepting child 1 follows the target at node 1
    assert len(given1) > 500
    assert chi2_pvalue(np.bincount(given1[given1 >= 0], minlength=V), softmax(LOGITS[1])) > 1e-3


def test_chi_square_harness_detects_a_biased_rule():
    """Control: accepting the first draft child unconditionally emits the draft's distribution."""

    def biased(toks, key):
        res = accept_rejection(PARENTS, toks, DRAFT, LOGITS, key, 1.0)
        return res._replace(emitted=res.emitted.at[0].set(toks[1]))

    first, _, _ = run_rule(biased, 4)
    assert chi2_pvalue(np.bincount(first, minlength=V), softmax(LOGITS[0])) < 1e-6


def test_accept_rejection_validates_probabilities():
    bad = DRAFT.copy()
    bad[0, 0] = 1.5
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        accept_rejection(PARENTS, np.zeros(4, np.int32), bad, LOGITS, jax.random.key(0), 1.0)
    with pytest.raises(ValueError):
        accept_rejection(PARENTS, np.zeros(4, np.int32), DRAFT[:3], LOGITS, jax.random.key(0), 1.0)


def test_accept_rejection_greedy_matches_greedy_walk():
    toks = np.array([0, 2, 4, 1], np.int32)
    target = np.argmax(LOGITS, -1).astype(np.int32)
    a = accept_rejection(PARENTS, toks, DRAFT, LOGITS, jax.random.key(0), 0.0)
    b = accept_greedy(PARENTS, toks, target)
    np.testing.assert_array_equal(a.emitted, b.emitted)


# ------------------------------------------------------------------------------------------------
# Compaction
# ------------------------------------------------------------------------------------------------


@settings(max_examples=25, deadline=None)
@given(tree_case, st.integers(0, 5), st.integers(0, 5))
def test_compaction_moves_exactly_the_accepted_entries(case, len0, len1):
    parents, tokens, target = (np.asarray(x, np.int32) for x in case)
    n = len(parents)
    b_parents = np.stack([parents, parents])
    b_target = np.stack([target, np.roll(target, 1)])
    res = jax.jit(accept_greedy)(b_parents, np.stack([tokens, tokens]), b_target)
    lens = np.array([len0, len1], np.int32)
    length = 6 + n
    rng = np.random.default_rng(0)
    cache = {"k": rng.normal(size=(2, length, 3)).astype(np.float32), "v": rng.normal(size=(2, length)).astype(np.float32)}
    out = jax.jit(compact_kv)(cache, lens, res.path, res.num_emitted)
    for name in cache:
        before, after = cache[name], np.asarray(out[name])
        for b in range(2):
            k = int(res.num_emitted[b])
            path = np.asarray(res.path[b, :k])
            expect = before[b].copy()
            expect[lens[b] : lens[b] + k] = before[b][lens[b] + path]
            np.testing.assert_array_equal(after[b], expect)


def test_compaction_shape_errors():
    with pytest.raises(ValueError):
        compact_kv({"k": np.zeros((2, 8))}, np.zeros(3, np.int32), np.zeros((2, 4), np.int32), np.ones(2, np.int32))


def test_first_argmax_is_jnp_argmax_with_ties_nans_and_infinities():
    """The CPU's two-reduction argmax gives ``jnp.argmax``'s index: the first of tied maxima, the first NaN, 0
    for a row of -inf (control: ties are really there, so a last-index rule would differ)."""
    rng = np.random.default_rng(0)
    x = rng.integers(-3, 4, (6, 9, 300)).astype(np.float32)  # many ties
    x[0, 0, 5] = x[0, 0, 200] = np.nan
    x[1, 1] = -np.inf
    x[2, 2, [7, 99]] = np.inf
    got = jax.jit(first_argmax)(jnp.asarray(x))
    np.testing.assert_array_equal(got, jnp.argmax(jnp.asarray(x), -1))
    assert got.dtype == jnp.int32 and got[0, 0] == 5 and got[1, 1] == 0 and got[2, 2] == 7
    last = x.shape[-1] - 1 - np.argmax(x[..., ::-1], -1)
    assert (last != np.asarray(got)).any()


@pytest.mark.parametrize("v", [6, 300])  # one block; three blocks of 128, the last padded
def test_sample_categorical_draws_the_softmax(v):
    """``jax.random.categorical``'s distribution from one uniform number a row (chi-square; -inf never drawn);
    control: the same harness rejects draws from logits scaled by 1.3."""
    rng = np.random.default_rng(v)
    logits = rng.normal(size=v).astype(np.float32) * 2
    logits[rng.choice(v, v // 3, replace=False)] = -np.inf
    keys = jax.random.split(jax.random.key(v), 60000)
    draw = jax.jit(jax.vmap(sample_categorical, in_axes=(0, None)))
    counts = np.bincount(np.asarray(draw(keys, jnp.asarray(logits))), minlength=v)
    assert chi2_pvalue(counts, softmax(logits)) > 1e-3
    biased = np.bincount(np.asarray(draw(keys, jnp.asarray(logits * 1.3))), minlength=v)
    assert chi2_pvalue(biased, softmax(logits)) < 1e-6


def test_invert_cdf_lands_on_tokens_with_mass_only():
    """Targets at the edges (0, just under 1, exactly at block boundaries) with whole blocks and the first and last
    tokens at -inf: every result has positive probability and is the exact inverse where rounding cannot decide."""
    v = 512
    logits = np.zeros(v, np.float32)
    logits[:128] = -np.inf                       # the first block empty
    logits[256:384] = -np.inf                    # an empty block in the middle
    logits[[128, 511]] = -np.inf                 # the first and last tokens of blocks with mass
    mass = np.isfinite(logits)
    n = mass.sum()
    inside = np.array([0.5, 126.5, 127.5, 200.5, n - 0.5]) / n  # halfway through a token's share: no rounding
    u = np.concatenate([[0.0, 1 - 2**-24, 0.5, 127 / n, 128 / n], inside]).astype(np.float32)  # then the edges
    got = np.asarray(invert_cdf(jnp.broadcast_to(jnp.asarray(logits), (len(u), v)), jnp.asarray(u)))
    assert mass[got].all()
    assert got[0] == 129 and got[1] == 510  # the first and the last token with mass
    np.testing.assert_array_equal(got[5:], np.flatnonzero(mass)[np.floor(inside * n).astype(int)])
