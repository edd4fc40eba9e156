"""kvsum/kernels/codes.py: TurboQuant's packed codes scored and mixed in place, the PyTorch path's numbers."""

import pytest

pytest.importorskip("triton")

import torch  # noqa: E402

from kvsum.attention import joint_attention  # noqa: E402
from kvsum.methods.quant import native  # noqa: E402
from kvsum.methods.quant.packing import Packed  # noqa: E402
from kvsum.methods.quant.turboquant import TurboQuant  # noqa: E402


def rel(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def _state(H, T, d, bits, device, center=False):
    torch.manual_seed(int(bits * 10) + T)
    keys, values = torch.randn(H, T, d, device=device) * 3, torch.randn(H, T, d, device=device)
    return TurboQuant(bits=bits, center=center).build(keys, values, bits, layer_idx=1)


@pytest.mark.parametrize("bits", [1, 1.5, 2, 2.5, 3, 3.5, 4])
@pytest.mark.parametrize("H,T,d,M", [(2, 70, 64, 3), (1, 40, 256, 1)])
def test_scores_and_mix_match_the_pytorch_path(kernel, reference, device, bits, H, T, d, M):
    state = _state(H, T, d, bits, device, center=bits == 3.5)
    q = torch.randn(1, H, M, d, device=device)
    p = torch.rand(1, H, M, T, device=device).softmax(-1)
    with kernel():
        assert state.k._native(M) is not None  # the kernels serve this state
        s, o = state.scores(q, 0.125), state.mix(p)
    with reference():
        assert state.k._native(M) is None
        s0, o0 = state.scores(q, 0.125), state.mix(p)
    assert s.shape == s0.shape and o.shape == o0.shape
    assert rel(s, s0) <= 1e-5 and rel(o, o0) <= 1e-5


def test_codes_are_read_packed(kernel, device, monkeypatch):
    """The kernels read the packed bytes: nothing expands the codes to levels in memory."""
    state = _state(2, 50, 64, 2.5, device)
    q, p = torch.randn(1, 2, 3, 64, device=device), torch.rand(1, 2, 3, 50, device=device)

    def expand(self):
        raise AssertionError("codes expanded")
    monkeypatch.setattr(Packed, "lookup", expand)
    monkeypatch.setattr(Packed, "codes", expand)
    with kernel():
        state.scores(q, 0.1), state.mix(p)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 1e-3)])
@pytest.mark.parametrize("d", [64, 256])
def test_joint_attention_with_a_tail_matches(kernel, reference, device, dtype, tol, d):
    """A decoding step over the codes and a full-precision tail, in the model's dtype (Hq = 3 query heads per KV
    head), end to end through kvsum's attention function (a bare coded state: the fused kernel, flash.py)."""
    H, T, t = 2, 60, 5
    state = _state(H, T, d, 3.5, device, center=True)
    q = torch.randn(1, 3 * H, 1, d, device=device).to(dtype)
    key, value = (torch.randn(1, H, t, d, device=device).to(dtype) for _ in range(2))
    with kernel():
        out = joint_attention(state, q, key, value, None, d ** -0.5)
    with reference():
        ref = joint_attention(state, q, key, value, None, d ** -0.5)
    assert out.dtype == dtype and out.shape == (1, 1, 3 * H, d)
    assert rel(out, ref) <= tol


@pytest.mark.parametrize("bits", [3, 3.5])
@pytest.mark.parametrize("lengths", [[40, 0, 25, 9], [1, 70]])
def test_runs_of_one_head(kernel, device, bits, lengths):
    """A one-head store of several heads' entries (composition's ragged heads): query head h reads its own run,
    plus `add`, -inf past the run's end; the mix reads each run with its own head's weights."""
    torch.manual_seed(len(lengths))
    T, H, d, M = sum(lengths), len(lengths), 64, 3
    state = TurboQuant(bits=bits).build(torch.randn(1, T, d, device=device), torch.randn(1, T, d, device=device),
                                        bits, layer_idx=0)
    runs = torch.tensor([0, *lengths]).cumsum(0)
    q, add, p = torch.randn(H, M, d, device=device), torch.randn(T, device=device), torch.rand(H, M, max(lengths),
                                                                                               device=device)
    with kernel():
        s = native.score(state.k._native(M), q, state.k_norm, 0.5, add, runs)
        o = native.mix(state.v._native(M), p, state.v_norm, d, runs)
    assert s.shape == (H, M, max(lengths)) and o.shape == (H, M, d)
    keys, values = state.k.lookup()[0], state.v.lookup()[0]
    kn, vn = state.k_norm[0].float(), state.v_norm[0].float()
    for h, (a, n) in enumerate(zip(runs[:-1].tolist(), lengths)):
        assert (s[h, :, n:] == float("-inf")).all()
        if n:
            assert rel(s[h, :, :n], 0.5 * kn[a:a + n] * (q[h] @ keys[a:a + n].t()) + add[a:a + n]) <= 1e-5
            assert rel(o[h], (p[h, :, :n] * vn[a:a + n]) @ values[a:a + n]) <= 1e-5


def test_runs_of_a_centered_store_add_the_mean_logit_to_the_keys_coded_less_it(kernel, device):
    """A centered one-head store read in runs (a centered composition's ragged heads): each run's logits are its
    dequantized keys' (the mean where it was taken off, none where the key was coded as it is), plus `bias`."""
    lengths, d, M = [30, 0, 45], 64, 2
    T, H = sum(lengths), len(lengths)
    torch.manual_seed(5)
    keys = torch.randn(1, T, d, device=device) + 2.0
    keys[0, ::7] = -0.5 * keys[0].mean(0)  # pointing away from the mean: coded as they are
    state = TurboQuant(bits=3, center=True).build(keys, torch.randn(1, T, d, device=device), 3, layer_idx=0)
    on = ~torch.signbit(state.k_norm)[0]
    assert not on[::7].any() and on.sum() == T - len(range(0, T, 7))
    runs = torch.tensor([0, *lengths]).cumsum(0)
    q, bias = torch.randn(1, H, M, d, device=device), torch.randn(T, device=device)
    with kernel():
        s = state.run_scores(q, 0.5, bias, runs)
    dense = state.keys()[0]
    for h, (a, n) in enumerate(zip(runs[:-1].tolist(), lengths)):
        assert (s[0, h, :, n:] == float("-inf")).all()
        if n:
            assert rel(s[0, h, :, :n], 0.5 * q[0, h] @ dense[a:a + n].t() + bias[a:a + n]) <= 1e-4


def test_a_part_of_all_channels_and_a_split_part_are_not_read_together():
    """The kernels read the channels of every part of a pair from its index, or of none: a mix is refused."""
    from kvsum.kernels.codes import _side

    whole = (Packed(torch.zeros(4, 1, 8, dtype=torch.uint8), 2), None, torch.zeros(4))
    split = (whole[0], torch.arange(8, dtype=torch.uint8)[None], torch.zeros(4))
    assert len(_side([whole])) == len(_side([split, split])) == 6
    with pytest.raises(ValueError, match="name their channels"):
        _side([whole, split])
