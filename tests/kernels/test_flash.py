"""kvsum/kernels/flash.py: a decoding step over TurboQuant's codes in one fused pass (scores, online softmax, value
mix), joined with exact sinks and the tail: the PyTorch path's numbers, no logit materialised."""

import pytest

pytest.importorskip("triton")

import torch  # noqa: E402

from kvsum.attention import joint_attention  # noqa: E402
from kvsum.kernels import flash, online  # noqa: E402
from kvsum.methods.quant.state import TurboQuantState  # noqa: E402
from kvsum.methods.quant.turboquant import TurboQuant  # noqa: E402
from kvsum.state import ConcatState, EntryState  # noqa: E402


def rel(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def _coded(H, T, d, bits, device, center=False, rotation="qr"):
    torch.manual_seed(int(bits * 10) + T + d)
    keys, values = torch.randn(H, T, d, device=device) * 3, torch.randn(H, T, d, device=device)
    return TurboQuant(bits=bits, center=center, rotation=rotation).build(keys, values, bits, layer_idx=2)


def _sinks(H, n, d, dtype, device):
    return EntryState([torch.randn(n, d, device=device) * 4 for _ in range(H)],
                      [torch.randn(n, d, device=device) for _ in range(H)], dtype=dtype)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 1e-3)])
@pytest.mark.parametrize("bits,d,T,center,rotation", [(3.5, 64, 300, True, "qr"), (2.5, 64, 70, False, "hadamard"),
                                                      (4, 256, 40, True, "qr"), (3, 256, 33, False, "hadamard")])
def test_fused_step_matches_the_pytorch_path(kernel, reference, device, monkeypatch, dtype, tol, bits, d, T, center,
                                             rotation):
    """TurboQuant with exact sinks (ConcatState, as turboquant's sinks=4 builds it) and a tail, 3 query heads per KV
    head: the fused kernel's partial joined with the sinks' and the tail's in one softmax."""
    H, t = 2, 5
    state = ConcatState([_sinks(H, 4, d, dtype, device), _coded(H, T, d, bits, device, center, rotation)])
    q = torch.randn(1, 3 * H, 1, d, device=device).to(dtype)
    key, value = (torch.randn(1, H, t, d, device=device).to(dtype) for _ in range(2))
    with reference():
        ref = joint_attention(state, q, key, value, None, d ** -0.5)

    def no_logits(*a, **k):
        raise AssertionError("the fused path materialised the codes' logits")
    monkeypatch.setattr(TurboQuantState, "scores", no_logits)
    with kernel():
        out = joint_attention(state, q, key, value, None, d ** -0.5)
    assert out.dtype == dtype and out.shape == ref.shape
    assert rel(out, ref) <= tol


def test_excluded_tokens_and_empty_chunks(device):
    """`skip` masks tokens out of the softmax; a chunk whose tokens are all masked adds nothing (no NaN)."""
    H, T, d, M = 2, 300, 64, 2
    state = _coded(H, T, d, 3, device)
    kp = [(c, ix, lv) for ix, lv, _, c in state.k.parts]
    vp = [(c, ix, lv) for ix, lv, _, c in state.v.parts]
    qr = torch.randn(H, M, d, device=device)
    flat = torch.cat([torch.arange(0, 200, device=device), T + torch.arange(0, T, 3, device=device)])
    skip = flash.skip_mask(flat, H, T)
    m, total, acc = online.combine_stacked(*flash.coded(kp, vp, qr, state.k_norm, state.v_norm, 0.2, None, skip))
    s = 0.2 * state.k_norm.float()[:, None, :] * (qr @ state.k.lookup().transpose(1, 2))
    p = s.masked_fill(skip.bool()[:, None, :], float("-inf")).softmax(-1)
    ref = (p * state.v_norm.float()[:, None, :]) @ state.v.lookup()
    assert torch.isfinite(acc).all() and rel(acc / total[..., None], ref) <= 1e-5


def test_off_where_the_kernels_do_not_serve(reference, device):
    state = _coded(2, 40, 64, 3.5, device)
    with reference():
        assert state.online(torch.randn(1, 2, 3, 64, device=device), 0.1) is None


def test_online_leaves_out_skipped_tokens(kernel, reference, device):
    """TurboQuantState.online(skip=flat indices h * T + t): as summary's MaskedState masks its anchors."""
    H, T, d = 2, 90, 64
    state = _coded(H, T, d, 3.5, device, center=True)
    q = torch.randn(1, H, 3, d, device=device)
    flat = torch.tensor([0, 5, 89, T + 1, T + 40], device=device)
    with kernel():
        out = online.output(online.join(state.online(q, 0.125, skip=flat)))
    with reference():
        s = state.scores(q, 0.125)[0].clone()  # (H, M, T)
        s[flat // T, :, flat % T] = float("-inf")
        ref = state.mix(s.softmax(-1)[None])[0]
    assert rel(out, ref) <= 1e-5


@pytest.mark.parametrize("center", [True, False])
def test_runs_with_biases_match_each_heads_own_entries(kernel, device, center):
    """A composition's ragged heads (one store, head h's entries at runs[h]:runs[h + 1], a log-mass bias each) in
    the fused pass: each head's queries attend its own run only, as exact attention over the dequantized entries."""
    lengths, d, M = [7, 0, 45, 20], 64, 3
    H, N = len(lengths), sum(lengths)
    state = _coded(1, N, d, 3.5, device, center=center)
    runs = torch.tensor([0, *lengths]).cumsum(0)
    bias = (torch.randn(N, device=device) * 0.5).half()
    q = torch.randn(1, H, M, d, device=device)
    with kernel():
        out = online.output(online.join(state.online(q, 0.125, bias=bias, runs=runs)))
    keys, values = state.keys()[0], state.values()[0]
    for h, (a, b) in enumerate(zip(runs[:-1].tolist(), runs[1:].tolist())):
        if a == b:
            assert torch.equal(out[h], torch.zeros_like(out[h]))
            continue
        p = (q[0, h] @ keys[a:b].t() * 0.125 + bias[a:b].float()).softmax(-1)
        assert rel(out[h], p @ values[a:b]) <= 1e-5


def test_a_bf16_tail_beside_fp16_sinks(kernel, reference, device):
    """A bf16 model's tail and queries beside sinks stored in fp16: the exact entries and the tail are read in one
    product (promoted to fp32), as the PyTorch path reads them apart; the outputs differ by bf16 rounding only."""
    H, t, d = 2, 6, 64
    state = ConcatState([_sinks(H, 4, d, torch.float16, device), _coded(H, 120, d, 3.5, device, True)])
    q = torch.randn(1, 3 * H, 1, d, device=device).bfloat16()
    key, value = (torch.randn(1, H, t, d, device=device).bfloat16() for _ in range(2))
    with reference():
        ref = joint_attention(state, q, key, value, None, d ** -0.5)
    with kernel():
        out = joint_attention(state, q, key, value, None, d ** -0.5)
    assert out.dtype == torch.bfloat16 and rel(out, ref) <= 2 ** -7
