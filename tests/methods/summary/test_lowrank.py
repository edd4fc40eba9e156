"""kvsum/methods/summary/lowrank.py: the low-rank tier of summary entries."""

import torch


def test_lowrank_tier_full_rank_is_exact():
    from kvsum.methods.summary.lowrank import LowRankState

    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(30, 8, generator=g), torch.randn(30, 8, generator=g)
    st = LowRankState([(k, v, 8)], dtype=torch.float32)
    q = torch.randn(1, 1, 3, 8, generator=g)
    torch.testing.assert_close(st.scores(q, 0.3)[0, 0], q[0, 0] @ k.t() * 0.3, rtol=1e-4, atol=1e-4)
    p = torch.softmax(torch.randn(1, 1, 3, 30, generator=g), -1)
    torch.testing.assert_close(st.mix(p)[0, 0], p[0, 0] @ v, rtol=1e-4, atol=1e-4)
