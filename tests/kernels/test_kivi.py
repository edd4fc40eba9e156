"""kvsum/kernels/kivi.py: KIVI's packed key groups and value runs, the PyTorch path's numbers."""

import pytest

pytest.importorskip("triton")

import torch  # noqa: E402

from kvsum.attention import joint_attention  # noqa: E402
from kvsum.methods.quant.kivi import KIVI  # noqa: E402


def rel(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def _state(bits, H, T, d, n_q, sinks, device):
    torch.manual_seed(bits + T)
    keys, values = torch.randn(H, T, d, device=device) * 2, torch.randn(H, T, d, device=device)
    return KIVI(bits=bits, sinks=sinks).build(keys, values, bits, storage=torch.float16, n_q=n_q)


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("H,T,d,M,n_q,sinks", [(2, 110, 64, 3, 96, 4), (1, 70, 256, 1, 64, 0)])
def test_scores_and_mix_match_the_pytorch_path(kernel, reference, device, bits, H, T, d, M, n_q, sinks):
    state = _state(bits, H, T, d, n_q, sinks, device)
    q = torch.randn(1, H, M, d, device=device)
    p = torch.rand(1, H, M, T, device=device).softmax(-1)
    with kernel():
        assert state._native(M)
        s, o = state.scores(q, 0.125), state.mix(p)
    with reference():
        assert not state._native(M)
        s0, o0 = state.scores(q, 0.125), state.mix(p)
    assert s.shape == s0.shape and o.shape == o0.shape
    assert rel(s, s0) <= 1e-5 and rel(o, o0) <= 1e-5


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 1e-3)])
@pytest.mark.parametrize("bits,T,d,n_q,sinks", [(4, 100, 64, 64, 4), (2, 300, 256, 256, 0), (4, 70, 64, 64, 6)])
def test_fused_step_matches_the_pytorch_path(kernel, reference, device, monkeypatch, dtype, tol, bits, T, d, n_q,
                                             sinks):
    """A decoding step over the codes in one fused pass (keys' and values' scales and minima applied while decoding),
    joined with the exact sinks, the full-precision window and the tail in one softmax."""
    from kvsum.methods.quant import native

    H, t = 2, 4
    state = _state(bits, H, T, d, n_q, sinks, device)
    q = torch.randn(1, 3 * H, 1, d, device=device).to(dtype)
    key, value = (torch.randn(1, H, t, d, device=device).to(dtype) for _ in range(2))
    with reference():
        ref = joint_attention(state, q, key, value, None, d ** -0.5)

    def unfused(*a, **k):
        raise AssertionError("scores and mix ran instead of the fused kernel")
    monkeypatch.setattr(native, "score_groups", unfused)
    monkeypatch.setattr(native, "mix_runs", unfused)
    with kernel():
        out = joint_attention(state, q, key, value, None, d ** -0.5)
    assert out.dtype == dtype and rel(out, ref) <= tol
