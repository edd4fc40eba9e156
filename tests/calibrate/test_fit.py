"""kvsum/calibrate/fit.py: closed-form fits from calibrated moments."""

import torch

from kvsum.calibrate import greedy_channels


def test_greedy_selection_takes_one_of_each_correlated_pair():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(2, 5000, generator=g) * torch.tensor([[3.0], [2.0]])
    x = torch.stack([a, 2 * a + 0.01 * torch.randn(5000, generator=g), b, b + 0.01 * torch.randn(5000, generator=g)], 1)
    C = torch.cov(x.T).double()
    sel = greedy_channels(C, 2, torch.arange(4)[:, None]).tolist()
    assert sel[0] in (0, 1) and sel[1] in (2, 3)
    assert greedy_channels(C, 4, torch.arange(4)[:, None]).tolist() == [0, 1, 2, 3]
