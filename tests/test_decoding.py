"""Decoding-time eviction (kvsum.DecodingEviction): bounded entries while generating, exact until then."""

import pytest
import torch

import kvsum
from kvsum.cache import KVSumLayer
from kvsum.errors import KVSumError
from tests.helpers import tiny_llama

METHODS = ["snapkv", "h2o", "tova", "knorm", "expected_attention", "restkv", "streaming_llm", "random"]


def _generate_tracked(model, ids, cache, steps):
    """Greedy decoding one forward at a time; the entries per head and the bytes after every step."""
    lengths, nbytes, logits = [], [], []
    with torch.no_grad():
        out = model(ids, cache=cache)
        for _ in range(steps):
            logits.append(out.logits[0, -1])
            lengths.append([max(layer.lengths()) for layer in cache.layers])
            nbytes.append(cache.nbytes())
            out = model(out.logits[:, -1:].argmax(-1), cache=cache)
    return lengths, nbytes, logits


@pytest.mark.parametrize("method", METHODS)
def test_entries_stay_bounded_during_a_long_generation(method, ids):
    model = tiny_llama()
    target, every, steps = 48, 16, 160
    ev = kvsum.DecodingEviction(model, method, max_tokens=target, every=every)
    cache = kvsum.compress(model, ids[:, :40], method="full").attach(ev)
    lengths, nbytes, _ = _generate_tracked(model, ids[:, 40:44], cache, steps)
    assert max(max(x) for x in lengths) <= target + every
    assert cache.get_seq_length() == 44 + steps
    assert ev.compressions() >= 2 * (steps // every - 1)  # both layers, every `every` tokens
    # bound on bytes: target entries in fp16 + at most `every` tail tokens in the model's fp32, per head
    H, d = 2, 16
    bound = 2 * H * 2 * d * (target * 2 + every * 4)
    assert max(nbytes[steps // 2:]) <= bound
    full = kvsum.compress(model, ids[:, :40], method="full")
    _generate_tracked(model, ids[:, 40:44], full, steps)
    assert full.nbytes() > 3 * max(nbytes[steps // 2:])


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_identical_to_full_cache_while_under_the_target(attn, ids):
    model = tiny_llama(attn)
    ev = kvsum.DecodingEviction(model, "snapkv", max_tokens=200, every=8)
    ref = _generate_tracked(model, ids[:, 40:44], kvsum.compress(model, ids[:, :40], method="full"), 150)[2]
    ours = _generate_tracked(model, ids[:, 40:44], kvsum.compress(model, ids[:, :40], method="full").attach(ev),
                             150)[2]
    under = 200 - 44  # logits of step s come from 44 + s entries
    for a, b in zip(ours[:under], ref[:under]):
        assert torch.equal(a, b)
    assert ev.compressions() == 0
    # then it evicts, and the outputs move away from the full cache's
    ev2 = kvsum.DecodingEviction(model, "snapkv", max_tokens=64, every=8)
    ours2 = _generate_tracked(model, ids[:, 40:44], kvsum.compress(model, ids[:, :40], method="full").attach(ev2),
                              150)[2]
    assert ev2.compressions() > 0
    assert all(torch.equal(a, b) for a, b in zip(ours2[:64 - 44], ref[:64 - 44]))
    assert not torch.equal(ours2[-1], ref[-1])


def test_kept_positions_are_tracked_exactly(ids):
    """Layer 0's keys depend only on token and position, so the entries held after many compressions must
    equal the full cache's keys at the positions the stream says it kept (teacher-forced tokens)."""
    model = tiny_llama()
    ev = kvsum.DecodingEviction(model, "h2o", max_tokens=40, every=10, keep_first=4, keep_last=8)
    cache = kvsum.compress(model, ids[:, :20], method="full").attach(ev)
    full = kvsum.compress(model, ids[:, :20], method="full")
    with torch.no_grad():
        for t in range(20, 300):
            model(ids[:, t:t + 1], cache=cache)
            model(ids[:, t:t + 1], cache=full)
    layer, stream = cache.layers[0], ev.streams[0]
    assert stream.compressions > 10
    keys = layer.state.keys.float().split(layer.state.lengths())
    for h, pos in enumerate(stream.positions):
        assert pos[:4].tolist() == [0, 1, 2, 3]  # sinks
        assert (pos.diff() > 0).all()  # position order
        torch.testing.assert_close(keys[h], full.layers[0].keys[0, h, pos].half().float())
        # the newest `recent` tokens before the tail are kept
        assert pos[-8:].tolist() == list(range(layer.offset - 8, layer.offset))
    tail = full.layers[0].keys[0, :, layer.offset:]
    assert torch.equal(layer.keys[0], tail)


def test_scoring_is_causal_over_observed_queries():
    """h2o over observed queries: a query votes only for entries at or before its own position."""
    model = tiny_llama()
    g = torch.Generator().manual_seed(3)
    H, Hq, d, T, window, target = 2, 4, 16, 40, 8, 20
    ev = kvsum.DecodingEviction(model, "h2o", max_tokens=target, every=1, observe=window, keep_first=0, recent=0.0)
    layer = KVSumLayer()
    stream = ev(0)
    layer.stream = stream
    keys, values = torch.randn(1, H, T, d, generator=g), torch.randn(1, H, T, d, generator=g)
    q = torch.randn(1, Hq, T, d, generator=g)
    keys[0, :, -1] = 5 * q[0, ::2, T - window].mean(0)  # the newest key draws the oldest observed query
    layer.update(keys, values)
    stream.observe(q)
    layer.update(torch.randn(1, H, 1, d, generator=g), torch.randn(1, H, 1, d, generator=g))
    assert stream.compressions == 1 and layer.tail_length() == 1
    scale = d ** -0.5
    qpos = torch.arange(T - window, T)
    expected = []
    for h in range(H):
        qs = q[0, 2 * h:2 * h + 2, T - window:]  # (G, window, d)
        logits = qs @ keys[0, h].T * scale
        logits = logits.masked_fill(torch.arange(T)[None, None] > qpos[None, :, None], float("-inf"))
        score = torch.softmax(logits, -1).sum((0, 1))
        expected.append(score.topk(target - 1).indices.sort().values)
    kept = stream.positions
    for h in range(H):
        assert kept[h].tolist() == expected[h].tolist()


def test_starts_from_a_compressed_cache_and_keeps_its_entries_in_order(ids):
    model = tiny_llama()
    cache = kvsum.compress(model, ids, method="snapkv", budget=0.25, window=16)
    n0 = cache.layers[0].state.lengths()[0]
    first = cache.layers[0].state.keys[:4].clone()  # head 0's first entries: its oldest, kept as sinks
    ev = kvsum.DecodingEviction(model, "snapkv", max_tokens=n0 + 10, every=8, window=16, observe=16)
    cache.attach(ev)
    lengths, _, _ = _generate_tracked(model, ids[:, :3], cache, 60)
    assert max(max(x) for x in lengths) <= n0 + 10 + 8
    assert ev.compressions() > 0
    assert cache.get_seq_length() == 300 + 3 + 60
    assert torch.equal(cache.layers[0].state.keys[:4], first)
    assert (ev.streams[0].positions[0].diff() > 0).all()


def test_adaptive_allocation_shares_the_layer_budget(ids):
    model = tiny_llama()
    target, every = 48, 16
    ev = kvsum.DecodingEviction(model, "knorm", max_tokens=target, every=every, allocation="adaptive")
    cache = kvsum.compress(model, ids[:, :40], method="full").attach(ev)
    _generate_tracked(model, ids[:, 40:44], cache, 120)
    ragged = [layer.lengths() for layer in cache.layers if len(set(layer.lengths())) > 1]
    assert ragged  # knorm's scores differ across heads: heads hold different numbers of entries
    for layer in cache.layers:
        assert sum(layer.lengths()) <= 2 * (target + every)


def test_pyramid_gives_lower_layers_larger_targets():
    model = tiny_llama(layers=4)
    ev = kvsum.DecodingEviction(model, "snapkv", max_tokens=100, allocation="pyramid")
    assert ev.targets == sorted(ev.targets, reverse=True) and ev.targets[0] > 100 > ev.targets[-1]
    assert abs(sum(ev.targets) / 4 - 100) <= 1


def test_chunked_prefill_into_an_empty_cache_is_bounded(ids):
    model = tiny_llama()
    ev = kvsum.DecodingEviction(model, "tova", max_tokens=64, every=32)
    cache = kvsum.Cache(2).attach(ev)
    with torch.no_grad():
        for a in range(0, 300, 30):
            model(ids[:, a:a + 30], cache=cache)
            assert max(cache.layers[0].lengths()) <= 64 + 32 + 30
    assert cache.get_seq_length() == 300


def test_errors_name_the_argument(ids):
    model = tiny_llama()
    with pytest.raises(KVSumError, match="accepts: .*snapkv"):
        kvsum.DecodingEviction(model, "summary")
    with pytest.raises(KVSumError, match="unknown method"):
        kvsum.DecodingEviction(model, "nope")
    with pytest.raises(KVSumError, match="every"):
        kvsum.DecodingEviction(model, "snapkv", every=0)
    with pytest.raises(KVSumError, match="max_tokens"):
        kvsum.DecodingEviction(model, "snapkv", max_tokens=4, keep_first=4)
    with pytest.raises(KVSumError, match="observe"):
        kvsum.DecodingEviction(model, "snapkv", observe=1.5)
    with pytest.raises(KVSumError, match="no knob"):
        kvsum.DecodingEviction(model, "snapkv", kernel_size=3)
    cache = kvsum.compress(model, ids, method="summary", budget=0.25)
    cache.attach(kvsum.DecodingEviction(model, "snapkv", max_tokens=8, every=1))
    with pytest.raises(KVSumError, match="re-selects plain entries"):
        _generate_tracked(model, ids[:, :2], cache, 3)
