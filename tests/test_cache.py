import pytest
import torch
from transformers import DynamicCache

import kvsum
from kvsum.attention import joint_attention
from kvsum.methods.base import make_method
from kvsum.state import EntryState

from .conftest import assert_full_is_dynamic_cache, greedy_logits, tiny_llama


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_full_is_bit_identical_to_dynamic_cache_tiny(attn, ids):
    assert_full_is_dynamic_cache(tiny_llama(attn), ids, ids[:, :7])


@pytest.mark.model
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_full_is_bit_identical_to_dynamic_cache_smollm2(attn, smollm2):
    model, tok = smollm2
    ctx = tok("Bit for bit: the uncompressed path is transformers' own cache. " * 30, return_tensors="pt").input_ids
    q = tok(" In short,", return_tensors="pt").input_ids
    model.set_attn_implementation("kvsum_" + attn)
    try:
        assert_full_is_dynamic_cache(model, ctx, q)
    finally:
        model.set_attn_implementation("kvsum_sdpa")


def _naive(state_k, state_v, state_b, q, k, v, mask, scale):
    """Reference: concatenate [state | tail] per KV head and run a plain softmax with an additive mask."""
    G = q.shape[1] // k.shape[1]
    outs = []
    for j in range(q.shape[1]):
        h = j // G
        keys = torch.cat([state_k[h], k[0, h]])
        vals = torch.cat([state_v[h], v[0, h]])
        s = q[0, j] @ keys.T * scale
        s[:, : len(state_k[h])] += state_b[h]
        s[:, len(state_k[h]):] += mask
        outs.append(torch.softmax(s, -1) @ vals)
    return torch.stack(outs, 1)[None]  # (1, q, Hq, d)


@pytest.mark.parametrize("lengths", [[5, 5, 5], [3, 7, 1], [0, 4, 2], [700, 0, 400]])  # the last: per-head reads
@pytest.mark.parametrize("q_len", [1, 4])
def test_joint_attention_matches_concatenation(lengths, q_len):
    g = torch.Generator().manual_seed(0)
    H, G, d, t = 3, 3, 8, 6
    sk = [torch.randn(n, d, generator=g) for n in lengths]
    sv = [torch.randn(n, d, generator=g) for n in lengths]
    sb = [torch.randn(n, generator=g) for n in lengths]
    state = EntryState(sk, sv, sb, dtype=torch.float32)
    q = torch.randn(1, H * G, q_len, d, generator=g)
    k = torch.randn(1, H, t, d, generator=g)
    v = torch.randn(1, H, t, d, generator=g)
    causal = torch.ones(q_len, t, dtype=torch.bool).tril(t - q_len)
    additive = torch.zeros(q_len, t).masked_fill(~causal, float("-inf"))
    ref = _naive(sk, sv, sb, q, k, v, additive, 0.3)
    for mask in (causal[None, None], additive[None, None], None if q_len == 1 else causal[None, None]):
        out = joint_attention(state, q, k, v, mask, 0.3)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_ragged_state_holds_only_its_entries():
    d = 8
    lengths = [2, 9, 4]
    state = EntryState([torch.zeros(n, d) for n in lengths], [torch.zeros(n, d) for n in lengths])
    assert state.lengths() == lengths
    # 15 entries x (K + V) x 8 dims x fp16, plus one int8 head index per entry
    assert state.nbytes() == 15 * 2 * d * 2 + 15


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


def test_streaming_llm_keeps_sinks_and_window(tiny, ids):
    pre = kvsum.prefill(tiny, ids)
    cache = kvsum.compress_prefill(pre, make_method("streaming_llm", sinks=4), 0.25)
    state = cache.layers[0].state
    n = state.lengths()[0]
    full_k = pre.cache.layers[0].keys[0, 0]
    kept = state.keys[:n].float()
    torch.testing.assert_close(kept[:4], full_k[:4].half().float())
    torch.testing.assert_close(kept[4:], full_k[-(n - 4):].half().float())


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
