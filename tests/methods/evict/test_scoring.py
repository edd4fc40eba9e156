"""kvsum/methods/evict/scoring.py: the eviction base; every scorer under every allocation meets the budget, knob
checks."""

import pytest
import torch

import kvsum
from kvsum.errors import KVSumError
from kvsum.methods import make_method

METHODS = ["snapkv", "h2o", "tova", "knorm", "expected_attention", "restkv"]


ALLOCATIONS = ["uniform", "pyramid", "adaptive"]


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
