"""kvsum/methods/reconstruct/echokv.py: stored channels and the ones rebuilt from them, cache modes."""

import pytest
import torch

import kvsum
from kvsum.calibrate import Artifact
from tests.helpers import cached_logits, compress_with_plan, random_ids, rebuild_errors


def test_echokv_keep_all_is_exact(tiny, tiny_art, ids):
    q = random_ids(7, 3)
    ref = cached_logits(tiny, kvsum.compress(tiny, ids, method="streaming_llm", budget=1.0), q)  # every entry, fp16
    for knobs in (dict(keep=1.0), dict(mode="full"), dict()):
        cache = kvsum.compress(tiny, ids, method="echokv", budget=1.0, artifact=tiny_art, **knobs)
        assert cache.nbytes() == cache.reference_nbytes
        assert torch.equal(cached_logits(tiny, cache, q), ref)
    full = cached_logits(tiny, kvsum.compress(tiny, ids, method="full"), q)
    cache = compress_with_plan(tiny, ids, "echokv", 1.0, torch.float32, layer_budget=2.0, artifact=tiny_art,
                               mode="full")
    assert (cached_logits(tiny, cache, q) - full).abs().max() < 1e-4


def test_echokv_error_decreases_with_keep(tiny, tiny_art, ids):
    errs = [rebuild_errors(tiny, ids, "echokv", artifact=tiny_art, keep=k) for k in (0.25, 0.5, 0.75, 1.0)]
    for w in "kv":
        e = [x[w] for x in errs]
        assert all(a > b for a, b in zip(e, e[1:])) and e[0] < 1 and e[-1] < 1e-3, (w, e)


def test_echokv_previous_layer_helps(tiny, tiny_art, ids):
    """Zeroing the cross-layer moments leaves only this layer's channels as predictors: the error goes up."""
    alone = Artifact(tiny_art.meta, {k: dict(v, cross=torch.zeros_like(v["cross"])) for k, v in tiny_art.stats.items()},
                     tiny_art.rope)
    for keep in (0.25, 0.5):
        both, own = (rebuild_errors(tiny, ids, "echokv", artifact=a, keep=keep) for a in (tiny_art, alone))
        assert both["k"] < own["k"] - 0.02 and both["v"] < own["v"] - 0.02, (keep, both, own)


def test_echokv_mixes_values_without_rebuilding_them(tiny, tiny_art, ids):
    """The weights go through the stored channels and then the map: the rebuilt values' mix up to float order."""
    cache = kvsum.compress(tiny, ids, method="echokv", budget=0.25, artifact=tiny_art)
    states = [layer.state for layer in cache.layers]
    assert all(len(st.plans["v"].rest) for st in states) and any(len(st.plans["v"].prev) for st in states)
    for st in states:
        H, T = st.H, st.T
        p = torch.randn(2, H, 5, T, generator=torch.Generator().manual_seed(st.layer_idx)).softmax(-1)
        torch.testing.assert_close(st.mix(p), p @ st.rebuilt("v")[None], rtol=1e-5, atol=1e-6)


def test_echokv_cache_switches_between_full_and_compressed_mode(tiny, tiny_art, ids):
    """One cache, two modes: "full" holds the rebuilt channels (more bytes, no rebuild per step) and gives the
    same logits up to fp16 storage; "compressed" drops them again, bit for bit what it was."""
    q = random_ids(7, 3)
    cache = kvsum.compress(tiny, ids, method="echokv", budget=0.25, artifact=tiny_art)
    small = cache.nbytes()
    ref = cached_logits(tiny, cache, q)
    cache.crop(-7)
    assert cache.set_mode("full") is cache and cache.nbytes() >= small + 0.7 * cache.reference_nbytes
    torch.testing.assert_close(cached_logits(tiny, cache, q), ref, atol=2e-2, rtol=0)
    cache.crop(-7)
    cache.set_mode("compressed")
    assert cache.nbytes() == small
    assert torch.equal(cached_logits(tiny, cache, q), ref)
    with pytest.raises(kvsum.KVSumError, match="accepted: compressed, full"):
        cache.set_mode("fast")
    with pytest.raises(kvsum.KVSumError, match="no full/compressed modes"):
        kvsum.compress(tiny, ids, method="streaming_llm", budget=0.5).set_mode("full")
