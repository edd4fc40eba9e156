"""kvsum/methods/summary/fit.py: chunk summaries fitted to the reference attention."""

import math

import torch

from kvsum.methods.attention_stats import causal_logits, pool1d
from kvsum.methods.summary.fit import fit_chunk_summaries


def test_identical_keys_chunk_is_summarized_exactly():
    """A chunk of m copies of one key: one entry with bias log(m) and the chunk's mean value is exact."""
    g = torch.Generator().manual_seed(0)
    d, m = 8, 5
    key = torch.randn(d, generator=g)
    keys = key.repeat(m, 1)
    values = torch.randn(m, d, generator=g)
    q = torch.randn(12, d, generator=g)
    pos = torch.full((12,), 100)
    logits = causal_logits(q, pos, keys, 0.5)
    ck, bias, cv = fit_chunk_summaries(logits, q, 0.5, keys, values, torch.zeros(m, dtype=torch.long), 1, ridge=0.0)
    assert torch.allclose(bias, torch.tensor([math.log(m)]), atol=1e-5)
    torch.testing.assert_close(cv[0], values.mean(0))
    torch.testing.assert_close(ck[0], key)


def test_pool1d_keeps_the_length_and_averages_only_real_positions_at_the_edges():
    s = torch.tensor([[3.0, 0.0, 0.0, 0.0, 6.0]])
    for k in (2, 3, 4, 5):  # an even kernel pads one position more than it pools away
        assert pool1d(s, k).shape == s.shape and pool1d(s, k, edges=True).shape == s.shape
    assert torch.allclose(pool1d(s, 3, edges=True), torch.tensor([[1.5, 1.0, 0.0, 2.0, 3.0]]))
    assert torch.allclose(pool1d(s, 3), torch.tensor([[1.0, 1.0, 0.0, 2.0, 2.0]]))  # padding counted as zeros
    assert torch.equal(pool1d(s, 3, "max"), torch.tensor([[3.0, 3.0, 0.0, 6.0, 6.0]]))
