"""kvsum/methods/quant/qjl.py: the 1-bit QJL sketch, unbiased inner products, and what it costs TurboQuant."""

import math

import pytest
import torch

from kvsum.methods import make_method
from kvsum.methods.quant.qjl import qjl_encode, qjl_estimate
from kvsum.methods.quant.rotation import gaussian
from tests.helpers import random_layer


def test_qjl_estimate_is_unbiased_within_its_variance():
    d, draws = 64, 3000
    g = torch.Generator().manual_seed(0)
    q, r = torch.randn(1, d, generator=g), torch.randn(1, d, generator=g) * 0.3
    est = torch.empty(draws)
    for i in range(draws):
        S = gaussian(d, 1000 + i).float()
        signs, r_norm = qjl_encode(r, S)
        est[i] = qjl_estimate(q, signs, r_norm, S)[0, 0]
    true = (q @ r.t()).item()
    qn, rn = q.norm().item(), r.norm().item()
    var_exact = (math.pi / 2 * qn ** 2 * rn ** 2 - true ** 2) / d
    assert abs(est.mean().item() - true) < 4 * math.sqrt(var_exact / draws)
    assert est.var().item() <= 1.1 * math.pi / (2 * d) * qn ** 2 * rn ** 2  # the published bound
    assert est.var().item() == pytest.approx(var_exact, rel=0.15)


def test_qjl_makes_turboquant_logits_unbiased():
    x = random_layer(H=1, T=6, d=16, budget=10.0, outlier=False)  # rotation and S dwarf 6 tokens
    q = torch.randn(1, 1, 4, 16, generator=torch.Generator().manual_seed(5))
    exact = q @ x.keys.transpose(-1, -2)
    err = {}
    for qjl, bits in [(True, 2), (False, 1)]:
        est = torch.stack([make_method("turboquant", bits=bits, qjl=qjl, seed=s, sinks=0).compress(x).scores(q, 1.0)
                           for s in range(400)])
        err[qjl] = (est.mean(0) - exact, est.std(0) / math.sqrt(len(est)))
    mean, se = err[True]
    assert (mean.abs() < 4.5 * se).all()
    mean, se = err[False]  # the MSE quantizer alone shrinks inner products (by about 2/pi at 1 bit)
    assert (mean.abs() > 4.5 * se).any()


def test_qjl_pays_for_unbiased_logits_with_their_spread():
    """The price of the sketch, why qjl is off by default: in the same key bits (1-bit MSE codes + 1 QJL bit
    against 2-bit MSE codes) the logits' error is larger (its spread about doubles, here and on SmolLM2's keys)."""
    x = random_layer(H=2, T=256, d=64, budget=10.0, outlier=False)
    q = torch.randn(1, 2, 8, 64, generator=torch.Generator().manual_seed(5))
    exact = q @ x.keys.transpose(-1, -2)
    mse = {qjl: (make_method("turboquant", bits=2, qjl=qjl, skew=0, sinks=0, key_shift=0).compress(x).scores(q, 1.0)
                 - exact).pow(2).mean().item() for qjl in (True, False)}
    assert mse[True] > 1.5 * mse[False]
