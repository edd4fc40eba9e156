"""kvsum/methods/evict/allocation.py: uniform, pyramid and adaptive budget allocation."""

import math

import pytest

import kvsum
from kvsum.methods import make_method
from kvsum.methods.evict.allocation import ADAPTIVE_FLOOR, pyramid_budgets


def test_compress_entry_point_takes_allocation(tiny_prefill):
    model, ids, _ = tiny_prefill
    cache = kvsum.compress(model, ids, method="snapkv", budget=0.25, allocation="adaptive", window=16)
    assert cache.nbytes() <= 0.27 * cache.reference_nbytes


@pytest.mark.parametrize("method", ["tova", "knorm", "expected_attention"])
def test_adaptive_is_ragged_and_packed_without_padding(tiny_prefill, method):
    _, _, pre = tiny_prefill
    budget = 0.25
    cache = kvsum.compress_prefill(pre, make_method(method, allocation="adaptive"), budget)
    uniform = kvsum.compress_prefill(pre, make_method(method), budget)
    layer_budget = budget * cache.reference_nbytes / len(cache.layers)
    d = pre.cache.layers[0].keys.shape[-1]
    entry = 2 * d * 2  # fp16 key + value
    ragged = 0
    for layer, ref in zip(cache.layers, uniform.layers):
        lengths = layer.state.lengths()
        share = ref.state.lengths()[0]
        assert min(lengths) >= math.ceil(ADAPTIVE_FLOOR * share)
        if len(set(lengths)) > 1:
            ragged += 1
            # packed: every entry costs its key, value and one int8 head index, nothing is padded
            assert layer.state.nbytes() == sum(lengths) * (entry + 1)
            assert layer.state.nbytes() < max(lengths) * len(lengths) * entry
        assert layer.state.nbytes() <= layer_budget
    assert ragged >= 1


def test_pyramid_layer_budgets_decrease_and_keep_the_mean():
    f = pyramid_budgets(6, 0.25)
    assert all(a > b for a, b in zip(f, f[1:]))
    assert sum(f) / 6 == pytest.approx(0.25)
    capped = pyramid_budgets(4, 0.9)
    assert max(capped) <= 1 and sum(capped) / 4 == pytest.approx(0.9)
    assert pyramid_budgets(1, 0.3) == [0.3]


def test_pyramid_allocation_is_the_plan():
    """Eviction's plan holds the layer fractions (uniform: the budget everywhere); the method holds nothing."""
    inputs = [None] * 6  # the plan reads only how many layers there are
    assert make_method("snapkv", allocation="pyramid").plan(inputs, 0.25).fractions == tuple(pyramid_budgets(6, 0.25))
    for allocation in ("uniform", "adaptive"):
        assert make_method("snapkv", allocation=allocation).plan(inputs, 0.25).fractions == (0.25,) * 6


def test_pyramid_gives_lower_layers_more_entries(tiny_prefill):
    _, _, pre = tiny_prefill
    cache = kvsum.compress_prefill(pre, make_method("h2o", allocation="pyramid"), 0.25)
    first, last = cache.layers[0].state.lengths()[0], cache.layers[-1].state.lengths()[0]
    assert first > 2 * last
