"""kvsum/kernels/ragged.py: ragged per-head entries with additive biases, one launch per layer, the PyTorch
path's numbers."""

import pytest

pytest.importorskip("triton")

import torch  # noqa: E402

from kvsum.attention import joint_attention  # noqa: E402
from kvsum.state import EntryState  # noqa: E402

TOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1e-3}


def rel(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def _state(lengths, d, dtype, bias, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    keys = [torch.randn(n, d, generator=g).to(device) for n in lengths]
    values = [torch.randn(n, d, generator=g).to(device) for n in lengths]
    biases = [torch.randn(n, generator=g).to(device) for n in lengths] if bias else None
    return EntryState(keys, values, biases, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("lengths,d,M", [([5, 0, 40, 17], 64, 3), ([33, 1], 256, 1), ([2, 70, 9], 64, 16)])
@pytest.mark.parametrize("bias", [True, False])
def test_scores_and_attention_match_the_pytorch_path(kernel, reference, device, dtype, lengths, d, M, bias):
    state = _state(lengths, d, dtype, bias, device, seed=len(lengths) + d)
    H = len(lengths)
    q = torch.randn(1, H, M, d, device=device)
    with kernel():
        s = state.scores(q, 0.3)
        o = state.mix(s.softmax(-1).nan_to_num(0.0))
    with reference():
        s0 = state.scores(q, 0.3)
        o0 = state.mix(s0.softmax(-1).nan_to_num(0.0))
    assert s.shape == (1, H, M, max(lengths))  # per head, padded to the longest: not the masked (1, H, M, N)
    assert o.shape == o0.shape == (1, H, M, d)
    start = 0
    for h, n in enumerate(lengths):
        assert (s[0, h, :, n:] == float("-inf")).all()
        if n:  # the PyTorch path's layout is either padded per head or masked over all N: compare the values
            ref = s0[0, h, :, :n] if s0.shape[-1] == max(lengths) else s0[0, h, :, start:start + n]
            assert rel(s[0, h, :, :n], ref) <= 1e-5
        start += n
    assert rel(o, o0) <= 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("d", [64, 256])
def test_joint_attention_with_a_tail_matches(kernel, reference, device, dtype, d):
    """A decoding step of 2 query heads per KV head over ragged summary entries (with log-mass biases) and a
    full-precision tail, in the model's dtype."""
    lengths, t = [12, 3, 30], 4
    state = _state(lengths, d, dtype, True, device, seed=d)
    H = len(lengths)
    q = torch.randn(1, 2 * H, 1, d, device=device).to(dtype)
    key, value = (torch.randn(1, H, t, d, device=device).to(dtype) for _ in range(2))
    with kernel():
        out = joint_attention(state, q, key, value, None, d ** -0.5)
    with reference():
        ref = joint_attention(state, q, key, value, None, d ** -0.5)
    assert out.dtype == dtype and rel(out, ref) <= TOL[dtype]


def test_uniform_heads_and_prefill_rows_stay_on_pytorch(kernel, device, monkeypatch):
    """Equal lengths are one batched matmul already, and a prefill chunk's many rows a matmul: no kernel."""
    from kvsum.kernels import ragged

    monkeypatch.setattr(ragged, "scores", lambda *a: (_ for _ in ()).throw(AssertionError("kernel used")))
    with kernel():
        _state([8, 8], 64, torch.float16, True, device).scores(torch.randn(1, 2, 3, 64, device=device), 0.1)
        _state([8, 3], 64, torch.float16, True, device).scores(torch.randn(1, 2, 17, 64, device=device), 0.1)
