"""The summarization family as a whole (summary and hae): budgets, low-precision models."""

import pytest
import torch

import kvsum
from tests.helpers import tiny_llama

BUDGETS = [0.5, 0.25, 0.125, 0.0625]


@pytest.mark.parametrize("method", ["summary", "hae"])
@pytest.mark.parametrize("budget", BUDGETS)
def test_budget_compliance(tiny, ids, method, budget):
    cache = kvsum.compress(tiny, ids, method=method, budget=budget)
    assert cache.nbytes() <= (budget + 0.02) * cache.reference_nbytes
    out = tiny.generate(torch.cat([ids, ids[:, :4]], -1), cache=cache, max_new_tokens=4, min_new_tokens=4,
                        do_sample=False)
    assert out.shape[1] == ids.shape[1] + 8


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("method", ["summary", "hae"])
def test_low_precision_models_stay_finite(dtype, method, ids):
    model = tiny_llama(dtype=dtype)
    cache = kvsum.compress(model, ids, method=method, budget=0.125, lowrank_share=0.2) if method == "summary" \
        else kvsum.compress(model, ids, method=method, budget=0.125)
    with torch.no_grad():
        logits = model(ids[:, :5], cache=cache).logits
    assert torch.isfinite(logits).all()
