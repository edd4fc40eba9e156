"""kvsum/methods/quant/codes.py: scalar codes of rotated unit directions, within the published MSE bound."""

import math

import pytest
import torch

from kvsum.methods.quant.codes import Coded
from kvsum.methods.quant.rotation import Rotation


@pytest.mark.parametrize("kind", ["qr", "hadamard"])
@pytest.mark.parametrize("bits", [1, 1.5, 2, 2.5, 3, 3.5, 4])
def test_mse_distortion_within_published_bound(bits, kind):
    d, n = 64, 4000
    u = torch.randn(n, d, generator=torch.Generator().manual_seed(7))
    u = u / u.norm(dim=-1, keepdim=True)
    R = Rotation(d, 3, kind, "cpu")
    y = R.apply(u)[None]
    coded = Coded(y, bits)
    coded.extend(y)
    x_hat = R.undo(coded.lookup()[0])  # read back from the packed codes
    mse = (u - x_hat).pow(2).sum(-1).mean().item()
    assert 4.0 ** -bits < mse <= math.sqrt(3) * math.pi / 2 * 4.0 ** -bits
