"""kvsum/methods/quant/codebook.py: Lloyd-Max codebooks of a rotated coordinate, nearest-level encoding."""

import math

import pytest
import torch
from scipy import integrate

from kvsum.methods.quant.codebook import codebook, coordinate_law, encode, lloyd_max
from kvsum.methods.quant.pca import gaussian_levels


@pytest.mark.parametrize("bits", range(1, 9))
def test_encode_picks_the_nearest_level(bits):
    # TurboQuant's codebooks up to 6 bits (7-8 take long to converge), pca's Gaussian ones beyond (bucketize)
    levels = codebook(bits, 64) if bits <= 6 else torch.tensor(gaussian_levels(bits)) / 8
    y = torch.cat([torch.randn(5000) / 8, levels, (levels[1:] + levels[:-1]) / 2])  # levels and cell edges too
    code = encode(y, levels)
    assert code.dtype == torch.uint8
    dist = (y[:, None] - levels).abs()
    assert (dist.gather(1, code.long()[:, None])[:, 0] <= dist.min(1).values + 1e-6).all()  # edges: either side
    assert torch.equal(code, torch.bucketize(y, (levels[1:] + levels[:-1]) / 2).to(torch.uint8))


def test_codebook_levels_match_lloyd_max_for_the_beta_law():
    d = 128
    levels = torch.tensor(lloyd_max(2, d)) * math.sqrt(d)
    assert torch.allclose(levels, torch.tensor([-1.51, -0.453, 0.453, 1.51]), rtol=0.01)
    # Lloyd's centroid condition, checked independently by quadrature of the density.
    law, lv = coordinate_law(64), lloyd_max(3, 64)
    edges = [-1.0] + [(a + b) / 2 for a, b in zip(lv, lv[1:])] + [1.0]
    for level, lo, hi in zip(lv, edges, edges[1:]):
        mass = integrate.quad(law.pdf, lo, hi)[0]
        mean = integrate.quad(lambda x: x * law.pdf(x), lo, hi)[0] / mass
        assert mean == pytest.approx(level, rel=1e-6)
