"""kvsum/attention.py: joint attention over state and tail, eager and sdpa alike, repeat scoring."""

import pytest
import torch

import kvsum
from kvsum.attention import joint_attention
from kvsum.prefill import prefill
from kvsum.state import EntryState
from tests.helpers import tiny_llama


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


def test_repeat_scores_do_not_depend_on_the_chunk_size(tiny, ids, monkeypatch):
    from kvsum import attention

    results = []
    for chunk in (7, 4096):
        monkeypatch.setattr(attention.RepeatScorer, "__init__",
                            lambda self, T, c=chunk: (setattr(self, "T", T), setattr(self, "chunk", c),
                                                      setattr(self, "scores", {}))[-1])
        results.append(prefill(tiny, ids, repeat=True).repeat_scores[1])
    torch.testing.assert_close(results[0], results[1])


def test_biased_entries_agree_between_eager_and_sdpa(ids):
    """Summary entries carry additive log-mass biases; both attention paths must apply them identically."""
    logits = {}
    for attn in ("eager", "sdpa"):
        model = tiny_llama(attn)
        cache = kvsum.compress(model, ids, method="summary", budget=0.25, anchor_share=0.5)
        assert any(float(layer.state.bias.abs().max()) > 0 for layer in cache.layers)
        with torch.no_grad():
            logits[attn] = model(ids[:, :6], cache=cache).logits
    torch.testing.assert_close(logits["eager"], logits["sdpa"], rtol=1e-5, atol=1e-5)


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
