"""Builder invariants, DDTree's lazy enumeration, the Domino chain (§2.4), tracing, and argument checks."""

import heapq

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from dtree_jax.builders import DraftRound, build_tree, lane_widths
from dtree_jax.builders.methods import jitted_build
from dtree_jax.models.domino_head import DominoHead
from tests.build_oracles import V, assert_same_tree, random_round, tiny_model

MASK = 5


# ----------------------------------------------------------------------------------------------------------
# Invariants of the frontier trees
# ----------------------------------------------------------------------------------------------------------


def check_invariants(tree, budget, mask_token):
    fields = ("tokens", "parents", "depths", "scores", "mask")
    tok, par, dep, sc, mask = (np.asarray(getattr(tree, f)) for f in fields)
    assert tok.shape[1] == budget + 1
    for b in range(tok.shape[0]):
        assert par[b, 0] == -1 and dep[b, 0] == 0 and sc[b, 0] == 0
        valid = np.isfinite(sc[b])
        n_valid = int(valid.sum())
        assert valid[:n_valid].all(), "dead leaves come after all real nodes"
        assert np.all(np.diff(sc[b, 1:n_valid]) <= 0), "nodes in descending score (pop order)"
        for i in range(1, budget + 1):
            p = par[b, i]
            assert 0 <= p < i, "parents before children"
            if valid[i]:
                assert valid[p], "selected set is ancestor-closed"
                assert sc[b, i] <= sc[b, p], "scores non-increasing along paths"
                assert dep[b, i] == dep[b, p] + 1
            else:
                assert (tok[b, i], p, dep[b, i]) == (mask_token, 0, 1)
            anc, j = {i}, i
            while j > 0:
                j = par[b, j]
                anc.add(j)
            np.testing.assert_array_equal(np.nonzero(mask[b, i])[0], sorted(anc))
        for p in range(budget + 1):
            kids = [tok[b, c] for c in range(1, budget + 1) if valid[c] and par[b, c] == p]
            assert len(kids) == len(set(kids)), "no duplicate sibling tokens"


@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 10_000), method=st.sampled_from(["ddtree", "dominotree", "condstatic"]))
def test_invariants_random(seed, method):
    head, embed = tiny_model(seed % 3)
    rnd = random_round(head, embed, seed=seed, batch=3, depth=6)
    tree = build_tree(method, rnd, head, embed, budget=20, node_topk=4, corr_topm=16, pure_draft_prefix_len=1, mask_token_id=MASK)
    check_invariants(tree, 20, MASK)


@pytest.mark.parametrize("method", ["ddtree", "dominotree", "condstatic"])
@pytest.mark.parametrize("budget", [1, 3, 5])
def test_a_tree_needs_no_draft_row_deeper_than_its_budget(method, budget):
    """The loop hands the builder only the first ``min(K, budget)`` draft rows (``Spec.draft_depth``): a tree of
    ``budget`` nodes cannot reach deeper, so the tree is the one built from all K rows."""
    head, embed = tiny_model(1)
    rnd = random_round(head, embed, seed=budget, batch=3, depth=6)
    cut = DraftRound(ph=rnd.ph[:, :budget], base=rnd.base[:, :budget], root_state=rnd.root_state, root=rnd.root)
    kw = dict(budget=budget, node_topk=4, corr_topm=16, pure_draft_prefix_len=1, mask_token_id=MASK)
    assert_same_tree(build_tree(method, cut, head, embed, **kw), build_tree(method, rnd, head, embed, **kw))


@pytest.mark.parametrize("method,M,k,builder", [
    ("dominotree", 16, 4, "frontier"), ("dominotree", 16, 4, "heap"), ("dominotree", 0, 4, "frontier"),
    ("dominotree", 64, 4, "frontier"), ("dominotree", 0, 50, "frontier"), ("ddtree", 16, 4, "frontier"),
    ("ddtree", 16, 50, "heap"), ("condstatic", 16, 4, "frontier"), ("domino", 0, 4, "frontier"),
    ("dflash", 0, 4, "frontier"),
])
def test_a_draft_vocabulary_round_builds_the_tree_of_its_widened_round(method, M, k, builder):
    """A round over a draft vocabulary (base ``[B, K, V']`` and its ``vocab_ids``, what the drafter's own head
    gives) builds the tree of the same logits widened to ``V`` with -inf outside, the tokens mapped back to ids,
    also where k or M exceed the V' = 40 tokens (clamped: the rest score -inf); the control (ids not the
    columns' tokens) builds another tree."""
    head, embed = tiny_model(2)
    rnd = random_round(head, embed, seed=7, batch=3, depth=6)
    ids = np.sort(np.random.default_rng(0).choice(V, size=40, replace=False)).astype(np.int32)
    compact = DraftRound(rnd.ph, rnd.base[..., ids], rnd.root_state, rnd.root, vocab_ids=jnp.asarray(ids))
    widened = DraftRound(rnd.ph, jnp.full_like(rnd.base, -jnp.inf).at[..., ids].set(rnd.base[..., ids]),
                         rnd.root_state, rnd.root)
    kw = dict(budget=12, node_topk=k, corr_topm=M, pure_draft_prefix_len=1, mask_token_id=MASK, builder=builder)
    got = build_tree(method, compact, head, embed, **kw)
    assert_same_tree(got, build_tree(method, widened, head, embed, **kw))
    assert np.isin(np.asarray(got.tokens)[:, 1:], np.append(ids, MASK)).all()
    shifted = DraftRound(rnd.ph, compact.base, rnd.root_state, rnd.root, vocab_ids=jnp.asarray((ids + 1) % V))
    assert not np.array_equal(np.asarray(build_tree(method, shifted, head, embed, **kw).tokens),
                              np.asarray(got.tokens))


def test_draft_vocabulary_ids_must_match_the_columns():
    """Mismatched ids are one ValueError; k and M are still checked against the whole vocabulary V (only then
    clamped to V')."""
    head, embed = tiny_model(0)
    rnd = random_round(head, embed, seed=1, batch=1, depth=3)
    compact = DraftRound(rnd.ph, rnd.base[..., :10], rnd.root_state, rnd.root, vocab_ids=jnp.arange(10))
    with pytest.raises(ValueError, match=f"corr_topm = {V + 1} exceeds the vocabulary size {V}"):
        build_tree("dominotree", compact, head, embed, budget=4, corr_topm=V + 1, mask_token_id=MASK)
    with pytest.raises(ValueError, match=r"vocab_ids must be \[V'\] = \[10\] \(base's columns\), got \(9,\)"):
        build_tree("ddtree", DraftRound(rnd.ph, rnd.base[..., :10], rnd.root_state, rnd.root, vocab_ids=jnp.arange(9)),
                   budget=4, mask_token_id=MASK)


def test_lane_widths():
    assert lane_widths(16, 8, 16) == (1, 8, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1)
    assert lane_widths(2, 3, 5) == (1, 1)
    assert lane_widths(12, 2, 5) == (1, 2, 4, 8, 8)
    assert lane_widths(1, 8, 16) == (1,)


# ----------------------------------------------------------------------------------------------------------
# DDTree's lazy best-first enumeration (§4.9) equals the best-first builder with the marginal scorer
# ----------------------------------------------------------------------------------------------------------


def ddtree_lazy(base, budget, rank_cap, depth_limit):
    """DDTree: pop best; push the next sibling (rank + 1) and the first child (rank 0 one level deeper)."""
    top = base.max(-1, keepdims=True)
    lp = base - top - np.log(np.exp(base - top).sum(-1, keepdims=True))
    order = np.argsort(-lp, axis=-1, kind="stable")
    vals = np.take_along_axis(lp, order, axis=-1)
    heap = [(-vals[0, 0], (0,), -1, 1, 0, vals[0, 0])]
    nodes = []
    while heap and len(nodes) < budget:
        _, ranks, parent, depth, rank, logw = heapq.heappop(heap)
        nodes.append((order[depth - 1, rank], parent, depth, logw))
        if rank + 1 < rank_cap:
            w = logw - vals[depth - 1, rank] + vals[depth - 1, rank + 1]
            heapq.heappush(heap, (-w, ranks[:-1] + (rank + 1,), parent, depth, rank + 1, w))
        if depth < depth_limit:
            w = logw + vals[depth, 0]
            heapq.heappush(heap, (-w, ranks + (0,), len(nodes) - 1, depth + 1, 0, w))
    return nodes


@pytest.mark.parametrize("budget, k, max_depth", [(16, 16, 6), (24, 3, 6), (10, 4, 3)])
def test_marginal_tree_equals_ddtree_lazy_enumeration(budget, k, max_depth):
    head, embed = tiny_model(0)
    rnd = random_round(head, embed, seed=budget + k, batch=4, depth=6)
    kw = dict(budget=budget, node_topk=k, max_depth=max_depth, mask_token_id=MASK)
    trees = [build_tree("ddtree", rnd, builder=b, **kw) for b in ("frontier", "heap")]
    assert_same_tree(trees[0], trees[1])
    base = np.asarray(rnd.base, np.float64)
    for b in range(4):
        nodes = ddtree_lazy(base[b], budget, k, max_depth)
        assert len(nodes) == budget
        for tree in trees:
            np.testing.assert_array_equal(np.asarray(tree.tokens[b, 1:]), [n[0] for n in nodes])
            np.testing.assert_array_equal(np.asarray(tree.parents[b, 1:]), [n[1] + 1 for n in nodes])
            np.testing.assert_array_equal(np.asarray(tree.depths[b, 1:]), [n[2] for n in nodes])
            np.testing.assert_allclose(np.asarray(tree.scores[b, 1:]), [n[3] for n in nodes], atol=1e-4)


def test_zero_correction_dominotree_equals_ddtree():
    """With W2 = 0 and full-vocabulary correction the Domino scorer is the marginal scorer."""
    head, embed = tiny_model(1)
    head = DominoHead(head.w_ih, head.w_hh, head.w1, jnp.zeros_like(head.w2))
    rnd = random_round(head, embed, seed=9, batch=3, depth=5)
    kw = dict(budget=12, node_topk=3, corr_topm=0, pure_draft_prefix_len=1, mask_token_id=MASK)
    assert_same_tree(build_tree("dominotree", rnd, head, embed, **kw), build_tree("ddtree", rnd, **kw))


# ----------------------------------------------------------------------------------------------------------
# Chains
# ----------------------------------------------------------------------------------------------------------


def _sigmoid(x):
    return 1 / (1 + np.exp(-x))


def domino_chain_direct(head, embed, ph, base, root, M, P):
    """§2.4 written out sequentially in float64 numpy for one request (M > 0: argmax over base's top-M)."""
    w_ih, w_hh, w1, w2 = (np.asarray(w, np.float64) for w in (head.w_ih, head.w_hh, head.w1, head.w2))
    emb = np.asarray(embed, np.float64)
    g = w_hh.shape[0]

    def gru(s, tok):
        gi, gh = emb[tok] @ w_ih, s @ w_hh
        r, z = _sigmoid(gi[:g] + gh[:g]), _sigmoid(gi[g : 2 * g] + gh[g : 2 * g])
        n = np.tanh(gi[2 * g :] + r * gh[2 * g :])
        return (1 - z) * n + z * s

    k_rows = base.shape[0]
    verify = [int(root)]
    for i in range(min(P, k_rows)):
        verify.append(int(np.argmax(base[i])))
    s = np.zeros(g)
    for t in verify:
        s = gru(s, t)
    for i in range(P, k_rows):
        pre = np.concatenate([ph[i], s]) @ w1
        logits = base[i] + w2 @ (pre / (1 + np.exp(-pre)))
        cand = np.argsort(-base[i], kind="stable")[:M] if M > 0 else np.arange(len(logits))
        verify.append(int(cand[np.argmax(logits[cand])]))
        if i + 1 < k_rows:
            s = gru(s, verify[-1])
    return verify


@pytest.mark.parametrize("M, P", [(0, 1), (8, 1), (8, 0), (0, 2)])
def test_domino_chain_equals_direct_sequential(M, P):
    head, embed = tiny_model(2)
    rnd = random_round(head, embed, seed=M + P, batch=3, depth=6)
    tree = build_tree("domino", rnd, head, embed, corr_topm=M, pure_draft_prefix_len=P)
    assert tree.tokens.shape == (3, 7)
    np.testing.assert_array_equal(np.asarray(tree.parents[0]), np.arange(7) - 1)
    for b in range(3):
        ph, base = np.asarray(rnd.ph[b], np.float64), np.asarray(rnd.base[b], np.float64)
        want = domino_chain_direct(head, embed, ph, base, rnd.root[b], M, P)
        np.testing.assert_array_equal(np.asarray(tree.tokens[b]), want)


def test_dflash_chain_is_argmax_and_domino_chain_is_k1_frontier():
    head, embed = tiny_model(2)
    rnd = random_round(head, embed, seed=4, batch=3, depth=6)
    tree = build_tree("dflash", rnd)
    np.testing.assert_array_equal(np.asarray(tree.tokens[:, 1:]), np.argmax(np.asarray(rnd.base), axis=-1))
    chain = build_tree("domino", rnd, head, embed, corr_topm=8, pure_draft_prefix_len=1)
    frontier = build_tree("dominotree", rnd, head, embed, budget=6, node_topk=1, corr_topm=8, pure_draft_prefix_len=1, mask_token_id=MASK)
    assert_same_tree(frontier, chain)
    short = build_tree("domino", rnd, head, embed, corr_topm=8, pure_draft_prefix_len=1, max_depth=3)
    np.testing.assert_array_equal(np.asarray(short.tokens), np.asarray(chain.tokens[:, :4]))


# ----------------------------------------------------------------------------------------------------------
# Tracing: one jaxpr, no host callbacks, no recompilation on new values
# ----------------------------------------------------------------------------------------------------------


def _primitives(jaxpr, out):
    for eqn in jaxpr.eqns:
        out.add(eqn.primitive.name)
        for p in eqn.params.values():
            for sub in p if isinstance(p, (list, tuple)) else [p]:
                sub = getattr(sub, "jaxpr", sub)  # ClosedJaxpr -> Jaxpr
                if hasattr(sub, "eqns"):
                    _primitives(sub, out)
    return out


def test_frontier_is_one_jaxpr_without_callbacks_and_does_not_recompile():
    head, embed = tiny_model(0)
    kw = dict(budget=12, node_topk=3, corr_topm=8, pure_draft_prefix_len=1, mask_token_id=MASK)
    traces = []

    def fn(r, h, e):
        traces.append(1)
        return build_tree("dominotree", r, h, e, **kw)

    rnd = random_round(head, embed, seed=0, batch=2, depth=5)
    prims = _primitives(jax.make_jaxpr(fn)(rnd, head, embed).jaxpr, set())
    assert "sort" in prims and "top_k" in prims  # the real thing was traced
    assert not [p for p in prims if "callback" in p or "debug" in p], prims

    traces.clear()
    jitted = jax.jit(lambda r, h, e: fn(r, h, e))
    first = jitted(rnd, head, embed)
    second = jitted(random_round(head, embed, seed=1, batch=2, depth=5), head, embed)
    assert len(traces) == 1  # new values did not retrace
    assert not np.array_equal(np.asarray(first.tokens), np.asarray(second.tokens))
    # Direct (un-jitted) calls reuse the one compiled builder too.
    cache_size = getattr(jitted_build, "_cache_size", None)
    build_tree("dominotree", rnd, head, embed, **kw)
    size = cache_size() if cache_size else None
    build_tree("dominotree", random_round(head, embed, seed=2, batch=2, depth=5), head, embed, **kw)
    assert cache_size is None or cache_size() == size


# ----------------------------------------------------------------------------------------------------------
# Argument checks
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(budget=0), "budget"),
        (dict(node_topk=0), "node_topk must"),
        (dict(max_depth=0), "max_depth"),
        (dict(corr_topm=-1), "corr_topm must"),
        (dict(corr_topm=V + 1), "exceeds"),
        (dict(method="eagle"), "unknown method"),
        (dict(builder="fast"), "unknown builder"),
        (dict(mask_token_id=None), "mask_token_id"),
        (dict(mask_token_id=V), "mask_token_id"),
        (dict(head=None), "DominoHead"),
    ],
)
def test_bad_arguments(kw, match):
    head, embed = tiny_model(0)
    rnd = random_round(head, embed, seed=0, batch=2, depth=5)
    args = dict(method="dominotree", head=head, budget=4, mask_token_id=MASK) | kw
    method, h = args.pop("method"), args.pop("head")
    with pytest.raises(ValueError, match=match):
        build_tree(method, rnd, h, embed, **args)


def test_bad_shapes():
    head, embed = tiny_model(0)
    rnd = random_round(head, embed, seed=0, batch=2, depth=5)
    bad = [
        DraftRound(rnd.ph[:, :4], rnd.base, rnd.root_state, rnd.root),
        DraftRound(rnd.ph, rnd.base, rnd.root_state, rnd.root[:1]),
        DraftRound(rnd.ph, rnd.base, rnd.root_state[:, :3], rnd.root),
        DraftRound(rnd.ph[..., :5], rnd.base, rnd.root_state, rnd.root),
    ]
    for r in bad:
        with pytest.raises(ValueError):
            build_tree("dominotree", r, head, embed, budget=4, mask_token_id=MASK)
    with pytest.raises(ValueError, match="embed"):
        build_tree("dominotree", rnd, head, embed[:, :5], budget=4, mask_token_id=MASK)
