"""kvsum/eval/metrics.py: fidelity against the full cache, answer margins."""

import math

import pytest
import torch

from kvsum.eval.metrics import answer_margin, fidelity


def test_fidelity_identical_is_exactly_zero_and_known_kl():
    logits = torch.randn(10, 50, generator=torch.Generator().manual_seed(0))
    targets = torch.randint(0, 50, (9,))
    f = fidelity(logits, logits, targets)
    assert f["kl"] == 0.0 and f["top1"] == 1.0 and f["nll"] == f["nll_full"]
    p, q = torch.tensor([[0.0, 0.0]]), torch.tensor([[math.log(3.0), 0.0]])  # (1/2, 1/2) vs (3/4, 1/4)
    g = fidelity(p, q, torch.tensor([0]))
    assert g["kl"] == pytest.approx(0.5 * math.log(0.5 / 0.75) + 0.5 * math.log(0.5 / 0.25))
    assert g["top1"] == 1.0  # tie in p resolves to index 0, as in q
    assert g["nll"] == pytest.approx(-math.log(0.75))


def test_answer_margin_is_the_worst_steps_lead_over_the_best_other_token():
    logits = torch.tensor([[1.0, 4.0, 2.5], [3.0, 0.0, 3.5]])
    assert answer_margin(logits, torch.tensor([1, 2])) == pytest.approx(0.5)  # step 2: 3.5 - 3.0
    assert answer_margin(logits, torch.tensor([1, 0])) == pytest.approx(-0.5)  # step 2 would pick token 2
    assert answer_margin(logits, torch.tensor([2, 2])) == pytest.approx(-1.5)  # step 1: 2.5 - 4.0
