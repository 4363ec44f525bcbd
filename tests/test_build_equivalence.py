"""Frontier builder == sequential heap builder (§4.5 vs §4.3) on tie-free random inputs."""

import pytest

from dtree_jax.builders import build_tree
from tests.build_oracles import assert_same_tree, random_round, tiny_model

# (M, P, K, k, budget): the §7.4 frontier equivalence suite.
CASES = [
    (8, 1, 5, 3, 12),
    (8, 0, 5, 3, 12),
    (0, 0, 5, 3, 12),
    (0, 2, 5, 3, 12),
    (3, 5, 5, 3, 12),
    (8, 1, 2, 2, 12),  # fewer candidates than budget: dead-leaf padding
    (8, 1, 5, 3, 2),  # W < k
    (8, 1, 12, 3, 24),  # deep: depths 3-10 run as the frontier's lax.scan at one lane width
    (0, 2, 14, 2, 20),  # deep, full vocabulary, two uncorrected depths before the scan
]


V_MASK = 7


def check(method, case, batch, rounds=2):
    M, P, K, k, budget = case
    head, embed = tiny_model(seed=sum(case))
    for r in range(rounds):
        rnd = random_round(head, embed, seed=31 * r + batch + sum(case), batch=batch, depth=K)
        kw = dict(budget=budget, node_topk=k, corr_topm=M, pure_draft_prefix_len=P, mask_token_id=V_MASK)
        got = build_tree(method, rnd, head, embed, builder="frontier", **kw)
        want = build_tree(method, rnd, head, embed, builder="heap", **kw)
        assert_same_tree(got, want)
        assert got.tokens.shape == (batch, budget + 1)


@pytest.mark.parametrize("case", CASES, ids=[str(c) for c in CASES])
def test_dominotree_frontier_equals_heap(case):
    check("dominotree", case, batch=5)


@pytest.mark.parametrize("batch", [1, 32])
def test_dominotree_frontier_equals_heap_batch_sizes(batch):
    check("dominotree", CASES[0], batch=batch)


@pytest.mark.parametrize(
    "method, case", [("ddtree", CASES[0]), ("condstatic", CASES[5]), ("ddtree", CASES[7])],
    ids=["ddtree", "condstatic", "ddtree-scan"]
)
def test_menu_scorers_frontier_equals_heap(method, case):
    check(method, case, batch=3)


def test_dead_leaf_padding_layout():
    M, P, K, k, budget = CASES[5]  # 2 + 4 = 6 real candidates for 12 slots
    head, embed = tiny_model(seed=sum(CASES[5]))
    rnd = random_round(head, embed, seed=3, batch=5, depth=K)
    tree = build_tree("dominotree", rnd, head, embed, budget=budget, node_topk=k, corr_topm=M, pure_draft_prefix_len=P, mask_token_id=V_MASK)
    dead = ~(tree.scores > -float("inf"))
    assert int(dead.sum(axis=1).min()) == budget - 6 and int(dead.sum(axis=1).max()) == budget - 6
    assert (tree.tokens[dead] == V_MASK).all()
    assert (tree.parents[dead] == 0).all() and (tree.depths[dead] == 1).all()
    assert not dead[:, : 1 + 6].any()  # real nodes first


@pytest.mark.slow
@pytest.mark.parametrize("batch", [1, 2, 5, 32])
@pytest.mark.parametrize("case", CASES, ids=[str(c) for c in CASES])
def test_dominotree_frontier_equals_heap_full_suite(case, batch):
    check("dominotree", case, batch=batch)
