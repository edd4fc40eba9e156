"""kvsum/methods/quant/state.py: TurboQuantState's rotated and dequant attention paths agree."""

import pytest
import torch

import kvsum
from tests.helpers import teacher_forced


@pytest.mark.parametrize("knobs", [dict(bits=3.5), dict(bits=2.5, qjl=True), dict(bits=3, rotation="hadamard"),
                                   dict(bits=2.5, unbiased="both")])
def test_rotated_and_dequant_paths_agree(tiny, ids, knobs):
    cont = ids[:, :12]
    out = {}
    for path in ("rotated", "dequant"):
        cache = kvsum.compress(tiny, ids, method="turboquant", budget=1.0, path=path, **knobs)
        out[path] = teacher_forced(tiny, cache, cont)
        state = cache.layers[0].state
    q = torch.randn(1, 2, 5, 16)
    logits = state.scores(q, 0.25)
    state.path = "rotated"
    assert torch.allclose(state.scores(q, 0.25), logits, atol=1e-4)
    assert torch.allclose(out["rotated"], out["dequant"], atol=1e-4)
