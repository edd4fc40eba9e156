"""The bundled Gemma 3 270M: sliding-window layers stay transformers' own, global layers are compressed."""

import pytest
import torch

import kvsum
from kvsum.cache import KVSumSlidingLayer
from kvsum.methods import make_method
from tests.helpers import assert_full_is_dynamic_cache

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def gemma():
    return kvsum.load_model("gemma3-270m")


@pytest.fixture(scope="module")
def ctx(gemma):
    _, tok = gemma
    text = "Bit for bit: the uncompressed path is transformers' own cache, sliding windows included. " * 40
    return tok(text, return_tensors="pt").input_ids[:, :700]  # longer than the 512-token window


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_full_is_bit_identical_to_dynamic_cache(gemma, ctx, attn):
    model, tok = gemma
    q = tok(" In short,", return_tensors="pt", add_special_tokens=False).input_ids
    model.set_attn_implementation("kvsum_" + attn)
    try:
        cache, ref_cache = assert_full_is_dynamic_cache(model, ctx, q)
    finally:
        model.set_attn_implementation("kvsum_sdpa")
    for mine, theirs in zip(cache.layers, ref_cache.layers):
        assert type(theirs).__name__ in ("DynamicSlidingWindowLayer", "DynamicLayer")
        assert isinstance(mine, KVSumSlidingLayer) == (type(theirs).__name__ == "DynamicSlidingWindowLayer")
        assert torch.equal(mine.keys, theirs.keys)


def test_every_method_runs_on_gemma(gemma, ctx):
    """Every method compresses the three global layers within the budget and decodes (the calibrated ones
    with an artifact calibrated on Gemma itself, in chunks no longer than its sliding window)."""
    from kvsum.calibrate import calibrate

    model, tok = gemma
    art = calibrate(model, tok, tokens=600, progress=False)
    assert art.meta["knobs"]["seq_len"] <= 511
    pre = kvsum.prefill(model, ctx, surprisal=True)
    sliding = [i for i, layer in enumerate(pre.cache.layers) if isinstance(layer, KVSumSlidingLayer)]
    assert len(sliding) == 15 and all(pre.cache.layers[i].keys.shape[2] == 511 for i in sliding)
    q = tok(" In short,", return_tensors="pt", add_special_tokens=False).input_ids
    for name in kvsum.methods():
        budget = 0.5 if name in ("kivi", "turboquant") else 0.25  # fixed costs: fp16 window, 128 KiB rotation
        method = make_method(name, **({"artifact": art} if name in ("echokv", "lowrank") else {}))
        p = kvsum.prefill(model, ctx, **method.prefill_options()) if method.prefill_options().get("repeat") else pre
        cache = kvsum.compress_prefill(p, method, budget)
        assert all(cache.layers[i].state is None and cache.layers[i].keys.shape[2] == 511 for i in sliding)
        if name != "full":
            assert all(cache.layers[i].state is not None for i in (5, 11, 17))
            assert cache.budget_nbytes() <= (budget + 0.02) * cache.budget_reference_nbytes, name
        with torch.no_grad():
            logits = model(q, past_key_values=cache).logits
        assert torch.isfinite(logits).all(), name
    with pytest.raises(kvsum.KVSumError, match="share_layers=1"):
        kvsum.compress_prefill(pre, make_method("lowrank", artifact=art, share_layers=2), 0.25)
