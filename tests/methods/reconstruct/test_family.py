"""The reconstruction family as a whole (echokv and lowrank): budgets, refusals, sinks, layer order."""

import pytest
import torch

import kvsum
from kvsum.methods import make_method
from tests.helpers import cached_logits, random_ids


@pytest.mark.parametrize("budget", [0.5, 0.25])
@pytest.mark.parametrize("method,knobs", [("echokv", {}), ("lowrank", {}), ("lowrank", dict(space="post")),
                                          ("lowrank", dict(share_layers=2))])
def test_budget_respected(tiny, tiny_art, ids, method, knobs, budget):
    cache = kvsum.compress(tiny, ids, method=method, budget=budget, artifact=tiny_art, **knobs)
    assert (budget - 0.05) * cache.reference_nbytes <= cache.nbytes() <= (budget + 0.02) * cache.reference_nbytes
    out = cached_logits(tiny, cache, random_ids(5, 3))
    assert torch.isfinite(out).all()


def test_explicit_knobs_beyond_the_budget_are_refused(tiny, tiny_art, ids, tmp_path, monkeypatch):
    monkeypatch.setenv("KVSUM_CACHE", str(tmp_path))  # no calibrated artifact to find
    with pytest.raises(kvsum.KVSumError, match="rank=40 needs"):
        kvsum.compress(tiny, ids, method="lowrank", budget=0.5, artifact=tiny_art, rank=40)
    with pytest.raises(kvsum.KVSumError, match="keep=0.75 needs"):
        kvsum.compress(tiny, ids, method="echokv", budget=0.5, artifact=tiny_art, keep=0.75)
    with pytest.raises(kvsum.KVSumError, match="mode='fast'"):
        kvsum.compress(tiny, ids, method="echokv", budget=0.5, artifact=tiny_art, mode="fast")
    with pytest.raises(kvsum.KVSumError, match="share_layers=3"):
        kvsum.compress(tiny, ids, method="lowrank", budget=0.5, artifact=tiny_art, share_layers=3)
    with pytest.raises(kvsum.KVSumError, match="needs artifact="):
        kvsum.compress(tiny, ids, method="lowrank", budget=0.5)


@pytest.mark.parametrize("method", ["echokv", "lowrank"])
def test_sinks_stored_whole_and_keys_get_their_share(tiny, tiny_art, ids, method):
    pre = kvsum.prefill(tiny, ids)
    cache = kvsum.compress_prefill(pre, make_method(method, artifact=tiny_art, sinks=3, key_share=0.25), 0.5)
    for src, layer in zip(pre.cache.layers, cache.layers):
        for w, ref in (("k", src.keys[0]), ("v", src.values[0])):
            assert torch.equal(layer.state.rebuilt(w)[:, :3], ref[:, :3].half().float())
            assert not torch.equal(layer.state.rebuilt(w)[:, 3:], ref[:, 3:].half().float())
    st = cache.layers[1].state
    kk, kv = (st.stored["k"].shape[1], st.stored["v"].shape[1]) if method == "echokv" else \
        (st.coef.k.shape[1], st.coef.v.shape[1])
    assert kk + kv == 31 and abs(kk - 0.25 * (kk + kv)) <= 2  # 0.5 of 2 x 32 numbers per token, less the sinks


def test_layers_come_in_order_or_rebuild_from_their_own_channels(tiny_art, ids, tiny):
    pre = kvsum.prefill(tiny, ids)
    layer = pre.cache.layers[1]
    x = kvsum.LayerInput(layer.keys[0].float(), layer.values[0].float(), None, None, 0.25, 1, 2, 1e9, torch.float16)
    with pytest.raises(kvsum.KVSumError, match="in order"):
        make_method("lowrank", artifact=tiny_art, share_layers=2).compress(x)
    # echokv without the previous layer's state (out of order, or after an uncompressed sliding-window layer)
    # rebuilds from this layer's own stored channels: a plan with no previous-layer inputs
    state = make_method("echokv", artifact=tiny_art, keep=0.5).compress(x)
    assert state.prev is None and all(len(p.prev) == 0 for p in state.plans.values())
    assert torch.isfinite(state.rebuilt("k")).all() and torch.isfinite(state.rebuilt("v")).all()
