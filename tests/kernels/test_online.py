"""kvsum/kernels/online.py: partial softmax results joined into the softmax over all tokens (no triton needed)."""

import torch

from kvsum.kernels import online


def test_partials_join_to_one_softmax():
    torch.manual_seed(0)
    H, M, d = 3, 2, 8
    s = torch.randn(H, M, 50) * 5
    s[0, 0, :30] = float("-inf")  # a part a row attends nothing of
    v = torch.randn(H, 50, d)
    parts = [online.from_scores(s[..., a:b], lambda w, a=a, b=b: w @ v[:, a:b]) for a, b in ((0, 30), (30, 31),
                                                                                          (31, 31), (31, 50))]
    out = online.output(online.join(parts))
    assert torch.allclose(out, s.softmax(-1) @ v, rtol=1e-5, atol=1e-6)


def test_a_row_with_nothing_to_attend_gives_zeros():
    s = torch.full((1, 1, 4), float("-inf"))
    out = online.output(online.join([online.from_scores(s, lambda w: w @ torch.ones(1, 4, 2))] * 2))
    assert torch.equal(out, torch.zeros(1, 1, 2))
