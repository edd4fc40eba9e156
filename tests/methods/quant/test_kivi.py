"""kvsum/methods/quant/kivi.py: KIVI's per-channel key and per-token value codes, exact sinks."""

import pytest
import torch

import kvsum
from kvsum.methods import make_method
from tests.helpers import random_layer


def test_kivi_sinks_stay_exact_and_no_longer_widen_the_first_group():
    """sinks=4: the first tokens are held in the storage dtype (counted as the planner counts them), the codes
    and the window follow; an outlier sink key no longer sets the first key group's channel scales."""
    x = random_layer(T=300)
    x.keys[:, 0] *= 50  # an attention sink's key: an outlier in every channel of its group
    plain = make_method("kivi", bits=2, group=8, residual=128).compress(x)
    m = make_method("kivi", bits=2, group=8, residual=128, sinks=4)
    s = m.compress(x)
    assert s.n_q == 168 and s.pending() == 300 - 4 - 168 and s.lengths() == [300] * x.H  # (300 - 4 - 128) // 8 * 8
    assert torch.equal(s.keys()[:, :4], x.keys[:, :4].half().float())
    assert torch.equal(s.values()[:, :4], x.values[:, :4].half().float())
    assert torch.equal(s.keys()[:, 4 + 168:], x.keys[:, 4 + 168:].half().float())
    assert s.nbytes() == m.nbytes(x.H, 300, x.d, 2, storage=x.storage)

    def err(state, lo):  # mean key error over one group's tokens after the sink
        return (state.keys()[:, lo:lo + 7] - x.keys[:, lo:lo + 7]).abs().mean()

    assert 4 * err(s, 4) < err(plain, 1)  # 6.5x here
    with pytest.raises(kvsum.KVSumError, match="kivi: sinks must be an integer >= 0"):
        make_method("kivi", sinks=-1)


@pytest.mark.parametrize("bits", [2, 4])
def test_kivi_error_within_half_a_scale(bits):
    x = random_layer(T=300)
    # groups whose range is below fp16 resolution at their magnitude: a near-constant key channel, a value token
    x.keys[:, :, 5] = 5 + 1e-4 * x.keys[:, :, 5]
    x.values[:, 10] = -3 + 1e-4 * x.values[:, 10]
    s = make_method("kivi", bits=bits, group=8, residual=128).compress(x)
    n_q, H, d = s.n_q, x.H, x.d
    assert n_q == 168  # (300 - 128) // 8 * 8
    k_err = (s.keys()[:, :n_q] - x.keys[:, :n_q]).view(H, n_q // 8, 8, d).abs()
    assert (k_err <= s.k_scale.float().transpose(0, 1) / 2 + 1e-5).all()  # scales are held token-major
    v_err = (s.values()[:, :n_q] - x.values[:, :n_q]).view(H, n_q, d // 8, 8).abs()
    assert (v_err <= s.v_scale.float().transpose(0, 1) / 2 + 1e-5).all()
    assert k_err.max() > s.k_scale.float().min() / 8  # it does quantize
    assert torch.equal(s.keys()[:, n_q:], x.keys[:, n_q:].half().float())
    # keys are grouped per channel: the outlier channel has its own, larger scale
    assert s.k_scale[..., 3].float().mean() > 4 * s.k_scale[..., :3].float().mean()
