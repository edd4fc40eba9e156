import math

import pytest
import torch

import kvsum
from kvsum.errors import KVSumError
from kvsum.methods.base import LayerInput, make_method
from kvsum.methods.evict.allocation import ADAPTIVE_FLOOR, pyramid_budgets, select

from .conftest import tiny_llama

METHODS = ["snapkv", "h2o", "tova", "knorm", "expected_attention", "restkv"]
ALLOCATIONS = ["uniform", "pyramid", "adaptive"]


@pytest.fixture(scope="module")
def tiny_prefill():
    model = tiny_llama()
    ids = torch.randint(0, 128, (1, 300), generator=torch.Generator().manual_seed(1))
    return model, ids, kvsum.prefill(model, ids)


@pytest.mark.parametrize("budget", [0.5, 0.25, 0.125])
@pytest.mark.parametrize("allocation", ALLOCATIONS)
@pytest.mark.parametrize("method", METHODS)
def test_budget_is_met_and_generation_runs(tiny_prefill, method, allocation, budget):
    model, ids, pre = tiny_prefill
    cache = kvsum.compress_prefill(pre, make_method(method, allocation=allocation), budget)
    assert cache.nbytes() <= (budget + 0.02) * cache.reference_nbytes
    assert cache.nbytes() >= (budget - 0.02) * cache.reference_nbytes
    assert cache.get_seq_length() == ids.shape[1]
    out = model.generate(torch.cat([ids, ids[:, :3]], -1), cache=cache, max_new_tokens=4, min_new_tokens=4,
                         do_sample=False)
    assert out.shape[1] == ids.shape[1] + 3 + 4


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


def test_pyramid_gives_lower_layers_more_entries(tiny_prefill):
    _, _, pre = tiny_prefill
    cache = kvsum.compress_prefill(pre, make_method("h2o", allocation="pyramid"), 0.25)
    first, last = cache.layers[0].state.lengths()[0], cache.layers[-1].state.lengths()[0]
    assert first > 2 * last


# ---- scorers on hand-built layers -------------------------------------------------------------------------


def _layer(keys, values, queries, query_pos, keep: int, scale: float = 1.0) -> LayerInput:
    H, T, d = keys.shape
    x = LayerInput(keys=keys, values=values, queries=queries, query_pos=query_pos, scale=scale, layer_idx=0,
                   n_layers=1, budget_bytes=0.0, storage=torch.float32)
    x.budget_bytes = keep * H * x.entry_bytes()
    assert x.entries_per_head() == keep
    return x


def _kept(method: str, x: LayerInput, **knobs) -> set[int]:
    """Positions a method keeps in head 0 (the selection that compress hands to x.keep)."""
    m = make_method(method, **knobs)
    return set(select(x, m.score(x), m.allocation, m.protect)[0].tolist())


def _noise(*shape, seed=0, scale=0.1):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def _direction(d, i):
    u = torch.zeros(d)
    u[i] = 1.0
    return u


def test_snapkv_keeps_what_the_window_attends_and_the_window():
    T, d = 200, 8
    u = _direction(d, 0)
    keys = _noise(1, T, d)
    keys[0, 50] = u
    pos = torch.cat([torch.arange(0, 136, 10), torch.arange(136, T)])
    queries = _noise(2, len(pos), d, seed=1)
    queries[:, pos >= 136] += 10 * u  # the observation window looks at key 50
    x = _layer(keys, _noise(1, T, d, seed=2), queries, pos, keep=66)
    kept = _kept("snapkv", x)
    assert 50 in kept
    assert set(range(136, T)) <= kept
    # a budget smaller than the window keeps the newest positions
    small = _layer(keys, x.values, queries, pos, keep=10)
    assert _kept("snapkv", small) == set(range(T - 10, T))


def test_tova_keeps_what_the_last_query_attends():
    T, d = 120, 8
    keys = _noise(1, T, d)
    keys[0, 30], keys[0, 70] = _direction(d, 0), _direction(d, 1)
    pos = torch.arange(T - 20, T)
    queries = _noise(2, len(pos), d, seed=1)
    queries[:, :-1] += 10 * _direction(d, 1)  # every earlier query looks at key 70
    queries[:, -1] += 10 * _direction(d, 0)  # the last one at key 30
    x = _layer(keys, _noise(1, T, d, seed=2), queries, pos, keep=1)
    assert _kept("tova", x) == {30}
    assert 70 in _kept("h2o", x, recent=0.0)  # accumulated attention picks the other key


def test_h2o_keeps_heavy_hitters_and_recent():
    T, d = 150, 8
    keys = _noise(1, T, d)
    keys[0, 20] = _direction(d, 0)
    pos = torch.linspace(25, T - 1, 40).round().long()
    queries = _noise(2, len(pos), d, seed=1) + 10 * _direction(d, 0)
    x = _layer(keys, _noise(1, T, d, seed=2), queries, pos, keep=10)
    kept = _kept("h2o", x)
    assert 20 in kept and set(range(T - 5, T)) <= kept


def test_knorm_keeps_the_smallest_keys():
    T, d = 80, 8
    keys = torch.randn(1, T, d, generator=torch.Generator().manual_seed(0)) * torch.rand(
        1, T, 1, generator=torch.Generator().manual_seed(1))
    x = _layer(keys, _noise(1, T, d), None, None, keep=12)
    assert _kept("knorm", x) == set(keys[0].norm(dim=-1).argsort()[:12].tolist())


def test_expected_attention_uses_mean_covariance_and_value_norm():
    T, d = 60, 8
    keys = _noise(1, T, d, scale=0.01)
    values = torch.ones(1, T, d)
    # mean term: queries point at direction 0; of two keys along it, only the one with a large value counts
    keys[0, 10], keys[0, 11] = 2 * _direction(d, 0), 2 * _direction(d, 0)
    values[0, 11] = 0
    # covariance term: zero-mean spread along direction 1, none along direction 2
    keys[0, 40], keys[0, 41] = 2 * _direction(d, 1), 2 * _direction(d, 2)
    g = torch.Generator().manual_seed(3)
    queries = 2 * _direction(d, 0) + torch.randn(2, 50, 1, generator=g) * 3 * _direction(d, 1)
    x = _layer(keys, values, queries, torch.arange(T - 50, T), keep=2)
    assert _kept("expected_attention", x, sinks=0) == {10, 40}
    assert 41 not in _kept("expected_attention", _layer(keys, values, queries, x.query_pos, keep=3), sinks=0)


def _restkv_layer():
    """Key 10 gets half the attention but its value equals the output; keys 20 and 30 move it most."""
    T, d = 50, 4
    keys = torch.zeros(1, T, d)
    keys[0, 10, 3] = 5.0
    keys[0, 20, 3] = keys[0, 30, 3] = 3.0
    values = torch.zeros(1, T, d)
    values[0, 20, 0], values[0, 30, 0] = 10.0, -10.0  # they cancel: the output is 0 = value of key 10
    queries = _direction(d, 3).expand(1, 1, d).clone()
    return keys, values, queries, torch.tensor([T - 1])


def test_restkv_ranks_output_change_above_raw_attention():
    keys, values, queries, pos = _restkv_layer()
    x = _layer(keys, values, queries, pos, keep=2)
    assert _kept("restkv", x, window=0, pool=1) == {20, 30}
    assert 10 in _kept("tova", x)  # raw attention keeps the heavily attended key instead


def test_restkv_moving_average_follows_query_time_not_row_order():
    T, d = 50, 4
    keys, values = torch.zeros(1, T, d), torch.zeros(1, T, d)
    keys[0, 20], keys[0, 40] = 5 * _direction(d, 3), 5 * _direction(d, 1)
    values[0, 20], values[0, 40] = 10 * _direction(d, 0), 10 * _direction(d, 2)  # symmetric: equal removal errors
    queries = torch.stack([_direction(d, 1), _direction(d, 3)])[None]  # rows: one looks at key 40, one at key 20
    newest_first = torch.tensor([49, 45])  # the row looking at key 40 is the newest
    x = _layer(keys, values, queries, newest_first, keep=1)
    assert _kept("restkv", x, window=0, pool=1, ema=0.5) == {40}
    x = _layer(keys, values, queries, newest_first.flip(0), keep=1)
    assert _kept("restkv", x, window=0, pool=1, ema=0.5) == {20}


@pytest.mark.parametrize("method,knobs,knob", [
    *[(m, {"allocation": "ada"}, "allocation") for m in METHODS],
    ("snapkv", {"window": 0}, "window"),
    ("snapkv", {"kernel": 4}, "kernel"),
    ("h2o", {"recent": 1.5}, "recent"),
    ("expected_attention", {"sinks": -1}, "sinks"),
    ("restkv", {"ema": 1.0}, "ema"),
    ("restkv", {"pool": 2}, "pool"),
    ("restkv", {"window": True}, "window"),
])
def test_bad_knobs_name_the_knob(method, knobs, knob):
    with pytest.raises(KVSumError, match=rf"{method}: {knob} must"):
        make_method(method, **knobs)
