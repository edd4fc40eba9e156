"""kvsum/cache.py: the full cache is transformers' own, logical lengths, decoding over a compressed state, streams,
beams, byte references."""

import pytest
import torch
from transformers import DynamicCache

import kvsum
from kvsum.cache import KVSumSlidingLayer
from kvsum.state import BatchState, EntryState
from tests.helpers import (
    assert_full_is_dynamic_cache,
    greedy_logits,
    tiny_gemma,
    tiny_llama,
)


class _FoldAll:
    """A stream that moves the whole tail but its newest `keep` tokens into an exact fp32 EntryState."""

    def __init__(self, keep):
        self.keep, self.seen = keep, 0

    def observe(self, query):
        self.seen += query.shape[2]

    def step(self, layer, fresh):
        n = layer.keys.shape[2] - max(self.keep, fresh)
        if n <= 0:
            return
        k, v = layer.keys[0, :, :n].float(), layer.values[0, :, :n].float()
        new = EntryState(list(k), list(v), dtype=torch.float32)
        if layer.state is not None:
            old = layer.state
            new = EntryState([torch.cat([old.keys.view(old.H, -1, k.shape[-1])[h], k[h]]) for h in range(old.H)],
                             [torch.cat([old.values.view(old.H, -1, k.shape[-1])[h], v[h]]) for h in range(old.H)],
                             dtype=torch.float32)
        layer.state, layer.offset = new, layer.offset + n
        layer.keys, layer.values = layer.keys[:, :, n:], layer.values[:, :, n:]


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_full_is_bit_identical_to_dynamic_cache_tiny(attn, ids):
    assert_full_is_dynamic_cache(tiny_llama(attn), ids, ids[:, :7])


@pytest.mark.parametrize("method", ["streaming_llm", "random"])
@pytest.mark.parametrize("budget", [0.5, 0.25, 0.125])
def test_budget_is_met_and_lengths_stay_logical(tiny, ids, method, budget):
    cache = kvsum.compress(tiny, ids, method=method, budget=budget)
    assert cache.nbytes() <= (budget + 0.02) * cache.reference_nbytes
    assert cache.nbytes() >= (budget - 0.02) * cache.reference_nbytes  # the budget is used, not wasted
    assert cache.get_seq_length() == ids.shape[1]
    full_ids = torch.cat([ids, ids[:, :5]], -1)
    out = tiny.generate(full_ids, cache=cache, max_new_tokens=6, min_new_tokens=6, do_sample=False)
    assert out.shape[1] == ids.shape[1] + 5 + 6
    assert cache.get_seq_length() == ids.shape[1] + 5 + 5  # the last generated token is not cached yet
    rows = cache.stats()
    assert {r["layer"] for r in rows} == {0, 1} and all(r["entries"] > 0 for r in rows)


def test_compressed_decode_equals_attention_over_kept_entries(tiny, ids):
    """A compressed cache must give the logits of a model that only ever saw the kept entries."""
    cache = kvsum.compress(tiny, ids, method="random", budget=0.5, storage_dtype=torch.float32)
    nxt = ids[:, :3]
    with torch.no_grad():
        ours = tiny(nxt, cache=cache, position_ids=torch.arange(300, 303)[None]).logits
    # rebuild the same situation with a DynamicCache holding exactly the kept entries
    ref = DynamicCache()
    for i, layer in enumerate(cache.layers):
        n = layer.state.lengths()[0]
        H = len(layer.state.lengths())
        ref.update(layer.state.keys.view(1, H, n, -1), layer.state.values.view(1, H, n, -1), i)
    mask = torch.ones(1, n + 3, dtype=torch.long)
    with torch.no_grad():
        exp = tiny(nxt, cache=ref, attention_mask=mask, position_ids=torch.arange(300, 303)[None]).logits
    torch.testing.assert_close(ours, exp, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("keep", [0, 3])
def test_stream_folding_tail_into_state_keeps_outputs(attn, keep, ids):
    """Decoding-time streams may move tail tokens into the state mid-generation; mask, positions and
    attention stay right: folding exactly (fp32) reproduces the full cache's logits to fp32 rounding."""
    model = tiny_llama(attn)
    ctx, q = ids, ids[:, :7]
    full_ids = torch.cat([ctx, q], -1)
    ref = greedy_logits(model, full_ids, kvsum.compress(model, ctx, method="full"))
    streams = {}
    cache = kvsum.compress(model, ctx, method="full").attach(lambda i: streams.setdefault(i, _FoldAll(keep)))
    ours = greedy_logits(model, full_ids, cache)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    assert all(layer.tail_length() <= keep + 1 for layer in cache.layers)
    assert cache.layers[0].get_seq_length() == full_ids.shape[1] + 19
    assert streams[0].seen == 7 + 19  # the question's queries, then one per generated token after the first


@pytest.mark.parametrize("dtype, bits", [(torch.float32, 32), (torch.bfloat16, 16)])
def test_references_name_what_they_compare_with(ids, dtype, bits):
    """reference_nbytes is the full cache at 16 bits whatever the model's dtype; model_reference_nbytes is the
    full cache in the model's own dtype, which is what the full cache holds."""
    model = tiny_llama(dtype=dtype)
    full = kvsum.compress(model, ids, method="full")
    T, layers, kv_heads, d = ids.shape[1], 2, 2, 16
    assert full.reference_nbytes == full.budget_reference_nbytes == 2 * layers * kv_heads * d * T * 2
    assert full.model_reference_nbytes == full.reference_nbytes * bits // 16 == full.nbytes()
    small = kvsum.compress(model, ids, method="streaming_llm", budget=0.5)
    assert (small.reference_nbytes, small.model_reference_nbytes) == (full.reference_nbytes,
                                                                       full.model_reference_nbytes)
    assert small.ratio() == small.nbytes() / small.reference_nbytes


def test_beam_search_reorders_states(tiny, ids):
    """Beam search reorders the batch (transformers leaves a passed cache's expansion to the caller:
    batch_repeat_interleave); states follow. With the whole prompt kept in the state the beams equal
    those over transformers' own cache."""
    full_ids = torch.cat([ids, ids[:, :4]], -1)
    kw = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, num_beams=3, num_return_sequences=2)
    cache = kvsum.compress(tiny, ids, method="streaming_llm", budget=1.0)
    assert cache.layers[0].state.lengths() == [300, 300]
    cache.batch_repeat_interleave(3)
    one = cache.layers[0].state.states[0]
    assert cache.batch_size == 3 and cache.nbytes() == sum(layer.state.states[0].nbytes() for layer in cache.layers)
    out = tiny.generate(full_ids, past_key_values=cache, **kw)
    assert isinstance(cache.layers[0].state, BatchState) and cache.layers[0].state.states == [one] * 3
    ref_cache = kvsum.compress(tiny, ids, method="full")
    ref_cache.batch_repeat_interleave(3)
    ref = tiny.generate(full_ids, past_key_values=ref_cache, **kw)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_gemma_full_is_bit_identical_to_dynamic_cache(attn):
    model = tiny_gemma(attn)
    ctx = torch.randint(0, 128, (1, 100), generator=torch.Generator().manual_seed(1))
    cache, _ = assert_full_is_dynamic_cache(model, ctx, ctx[:, :7], steps=40)
    assert [isinstance(layer, KVSumSlidingLayer) for layer in cache.layers] == [True, True, False] * 2
    # the window layers hold what transformers holds: window - 1 tokens
    assert [layer.keys.shape[2] for layer in cache.layers] == [31, 31, 146] * 2


def test_failed_decoding_step_leaves_the_cache_as_it_was(tiny, ids):
    """A bad input to a compressed cache is refused before any layer changes."""
    cache = kvsum.compress(tiny, ids, method="streaming_llm")
    held, seen = cache.nbytes(), cache.get_seq_length()
    with pytest.raises(kvsum.KVSumError, match="the cache holds 1 sequence"):
        with torch.no_grad():
            tiny(ids[:, :2].expand(2, -1), past_key_values=cache)
    assert cache.nbytes() == held and cache.get_seq_length() == seen
