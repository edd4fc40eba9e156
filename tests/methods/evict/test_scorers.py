"""The eviction scorers (snapkv, tova, h2o, knorm, expected_attention, restkv) on hand-built layers."""

import torch

from kvsum.methods import LayerInput, make_method
from kvsum.methods.evict.allocation import select


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
