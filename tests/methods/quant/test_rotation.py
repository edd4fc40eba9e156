"""kvsum/methods/quant/rotation.py: dense and Hadamard rotations, and the fallback where the dense one does not fit."""

import pytest
import torch

import kvsum
from kvsum.methods import LayerInput, make_method
from kvsum.methods.quant.rotation import Rotation
from tests.helpers import random_layer


def test_hadamard_rotation_is_orthogonal_holds_d_sign_bytes_and_refuses_other_head_dims():
    x = torch.randn(3, 50, 64, generator=torch.Generator().manual_seed(0))
    R = Rotation(64, 1, "hadamard", "cpu")
    y = R.apply(x)
    assert torch.allclose(y.norm(dim=-1), x.norm(dim=-1), rtol=1e-5)
    assert torch.allclose(R.undo(y), x, atol=1e-5)
    assert R.nbytes() == 64 and Rotation(64, 1, "qr", "cpu").nbytes() == 64 * 64 * 2
    assert not torch.equal(Rotation(64, 2, "hadamard", "cpu").apply(x), y)  # the signs follow the seed
    layer = random_layer(d=16)
    qr = make_method("turboquant", bits=3.5).compress(layer)
    had = make_method("turboquant", bits=3.5, rotation="hadamard").compress(layer)
    assert qr.nbytes() - had.nbytes() == 16 * 16 * 2 - 16  # one layer's fp16 matrix against its sign bytes
    H, T, d = 1, 256, 64  # one KV head, few tokens: the dense rotation is 1/8 of the layer's 16-bit bytes
    g = torch.Generator().manual_seed(0)
    one = LayerInput(torch.randn(H, T, d, generator=g), torch.randn(H, T, d, generator=g), None, None, d ** -0.5, 0, 1,
                     0.25 * 2 * H * T * d * 2, torch.float16)
    # the dense rotation does not fit: the layer falls back to the seeded-sign Hadamard rotation, and says so
    fell, had = make_method("turboquant", bits=3).compress(one), make_method("turboquant", bits=3,
                                                                              rotation="hadamard").compress(one)
    assert fell.nbytes() == had.nbytes() <= 0.25 * 2 * H * T * d * 2 and fell.parts[1].R.kind == "hadamard"
    assert torch.equal(fell.parts[1].keys(), had.parts[1].keys()) and "rotation='hadamard'" in fell.note
    assert make_method("turboquant", bits=3).compress(random_layer(d=16)).note == ""  # where the dense one fits: kept
    d = 48  # no Hadamard rotation at this head dim: the refusal names the rotation's share and the smallest budget
    odd = LayerInput(torch.randn(H, T, d, generator=g), torch.randn(H, T, d, generator=g), None, None, d ** -0.5, 0, 1,
                     0.25 * 2 * H * T * d * 2, torch.float16)
    with pytest.raises(kvsum.KVSumError, match=r"rotation alone takes 0\.094 of the layer \(head dim 48 has no "
                                               r"Hadamard rotation\); the smallest budget that fits: 0\.3"):
        make_method("turboquant", bits=3).compress(odd)
    with pytest.raises(kvsum.KVSumError) as small:  # 0.2% of 2,000 tokens: the rotation is not worth naming
        make_method("turboquant", bits=4).compress(random_layer(T=2000, budget=0.2))
    assert "rotation" not in str(small.value)
    with pytest.raises(kvsum.KVSumError, match="power-of-2 head dim, got 24"):
        make_method("turboquant", bits=3.5, rotation="hadamard").compress(random_layer(d=24))
    with pytest.raises(kvsum.KVSumError, match="rotation='givens'; accepted: qr, hadamard"):
        make_method("turboquant", rotation="givens")
