import math

import pytest

from dtree_jax.cost import DEVICES, QWEN3_8B, break_even_batch, choose_budget, ridge_tokens, step_cost


def test_card_ridge_and_break_even():
    h100 = DEVICES["h100-sxm"]
    ridge = ridge_tokens(h100.peak_flops, h100.hbm_bandwidth)
    assert 294 < ridge < 296
    assert break_even_batch(10, ridge) == 29
    assert break_even_batch(5, ridge) == 59


def test_presets_cover_devices():
    for name in ("h100-sxm", "h200-sxm", "a100-sxm-80gb", "rtx-5090", "tpu-v5e", "tpu-v5p", "tpu-v6e"):
        d = DEVICES[name]
        assert d.peak_flops > 1e14 and d.hbm_bandwidth > 5e11 and d.source


@pytest.mark.parametrize("args", [(0, 1e12), (1e15, -1), (float("nan"), 1e12)])
def test_bad_ridge_inputs(args):
    with pytest.raises(ValueError):
        ridge_tokens(*args)


def test_step_cost_memory_then_compute_bound():
    h100 = DEVICES["h100-sxm"]
    small = step_cost(QWEN3_8B, h100, batch=1, tree_nodes=16, context=1024)
    big = step_cost(QWEN3_8B, h100, batch=64, tree_nodes=64, context=1024)
    assert small.bound == "memory" and big.bound == "compute"
    assert small.weight_bytes == pytest.approx(2 * QWEN3_8B.params)
    assert 7.5e9 < QWEN3_8B.params < 8.5e9


def test_choose_budget_shrinks_with_batch():
    h100 = DEVICES["h100-sxm"]
    taus = {0: 1.0, 4: 3.0, 16: 4.2, 32: 4.8, 64: 5.2}
    verify = lambda b, n: step_cost(QWEN3_8B, h100, batch=b, tree_nodes=n, context=2048).seconds
    chosen = [choose_budget(b, taus, verify) for b in (1, 4, 16, 64, 256)]
    assert chosen[0] == 64  # wide tree at batch 1
    assert all(a >= b for a, b in zip(chosen, chosen[1:]))  # never widens as the batch grows
    assert chosen[-1] < chosen[0]


def test_choose_budget_validates():
    with pytest.raises(ValueError):
        choose_budget(1, {}, lambda b, n: 1.0)
    with pytest.raises(ValueError):
        choose_budget(1, {4: 0.5}, lambda b, n: 1.0)
    with pytest.raises(ValueError):
        choose_budget(0, {4: 2.0}, lambda b, n: 1.0)
    assert math.isfinite(choose_budget(2, {4: 2.0}, lambda b, n: 1.0, draft_seconds=0.1))
