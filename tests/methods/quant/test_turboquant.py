"""kvsum/methods/quant/turboquant.py: centered keys, unbiased values, exact sinks and window, key/value skew, key
shift across layers."""

import pytest
import torch

import kvsum
from kvsum.methods import make_method
from tests.helpers import random_layer


def test_centered_keys_add_the_mean_logit_back_exactly_and_cut_the_error_of_offset_keys():
    H, T, d = 2, 300, 16
    x = random_layer(H, T, d)
    x.keys = x.keys + 4 * torch.randn(H, 1, d)  # a shared offset per head, as real keys have
    q = torch.randn(1, H, 5, d)
    knobs = dict(bits=2.5, sinks=0, key_shift=0)
    plain, ctr = (make_method("turboquant", center=c, **knobs).compress(x) for c in (False, True))
    logit_err = {k: (st.scores(q, 1.0) - q @ x.keys.transpose(-1, -2)).pow(2).mean() for k, st in
                 (("plain", plain), ("ctr", ctr))}
    assert logit_err["ctr"] < 0.5 * logit_err["plain"]
    assert torch.equal(ctr.values(), plain.values())  # values are coded as they are
    # the codes are those of the centered keys: shifting every key moves the reconstruction by as much (up to
    # the fp16 rounding of the mean, which flips a few codes), while the code error itself is far larger
    moved = random_layer(H, T, d)
    moved.keys = x.keys + 7
    st = make_method("turboquant", center=True, **knobs).compress(moved)
    assert (st.keys() - 7 - ctr.keys()).abs().mean() < 0.02 < (ctr.keys() - x.keys).abs().mean()
    # both attention paths agree, and the mean keys (fp16 per head) are counted
    p = torch.softmax(ctr.scores(q, 0.25), -1)
    rotated = ctr.scores(q, 0.25), ctr.mix(p)
    ctr.path = "dequant"
    assert torch.allclose(ctr.scores(q, 0.25), rotated[0], atol=1e-3)
    assert torch.allclose(ctr.mix(p), rotated[1], atol=1e-4)
    flags = H * 2  # an fp16 shrink a head; which keys were coded less the mean: their norms' sign bits
    assert ctr.nbytes() == plain.nbytes() + H * d * 2 + flags == make_method("turboquant", center=True,
                                                                             **knobs).nbytes(H, T, d, 2.5)


def test_keys_the_mean_would_lengthen_are_coded_as_they_are_in_every_read_path():
    # real heads attend most to a few small keys that point away from the head's mean (SmolLM2's " the"):
    # coded less the mean they would carry its norm's error as well
    H, T, d = 2, 300, 16
    x = random_layer(H, T, d)
    offset = 4 * torch.randn(H, 1, d, generator=torch.Generator().manual_seed(2))
    x.keys = x.keys + offset
    away = torch.arange(10, T, 30)
    x.keys[:, away] = -0.3 * offset + 0.3 * torch.randn(H, len(away), d, generator=torch.Generator().manual_seed(3))
    knobs = dict(bits=2.5, sinks=0, key_shift=0)
    plain, ctr = (make_method("turboquant", center=c, **knobs).compress(x) for c in (False, True))
    on = ~torch.signbit(ctr.k_norm)  # (H, T): the sign bit of each key's fp16 norm says which
    assert not on[:, away].any() and on.sum() == H * (T - len(away))
    # coded as they are, not from the mean's far side: their codes' error is the uncentered codes', and they get
    # back the share of the mean the codes shrink every key by (so they shrink toward the mean as the rest do)
    shrink = ctr.k_shrink.float()  # (H, 1)
    assert ((0.005 < shrink) & (shrink < 0.2)).all()
    back = ctr.keys()[:, away] - shrink[..., None] * ctr.k_mean.float()
    assert torch.allclose(back, plain.keys()[:, away], atol=1e-2)
    q = torch.randn(1, H, 5, d)
    want = q @ ctr.keys().transpose(-1, -2) * 0.25  # the dequantized keys carry the mean where it was taken
    assert torch.allclose(ctr.scores(q, 0.25), want, atol=1e-3)
    ctr.extend(x.keys[:, away], x.values[:, away])  # decoding-time keys get their own flags
    assert ctr.T == T + len(away) and torch.signbit(ctr.k_norm[:, T:]).all()


def test_unbiased_values_make_each_projection_exact_and_remove_the_shrink_an_average_keeps():
    H, T, d = 2, 2000, 16
    x = random_layer(H, T, d, outlier=False)
    x.values = x.values + 0.5 * torch.randn(H, 1, d, generator=torch.Generator().manual_seed(1))  # a shared part
    knobs = dict(bits=2, sinks=0, key_shift=0, skew=0)
    plain, unb = (make_method("turboquant", unbiased=u, **knobs).compress(x) for u in ("none", "values"))
    v_plain, v_unb = plain.values(), unb.values()
    # the scale read is |v| / <y, y_hat>: each reconstruction's projection on its own vector is exact (fp16)
    proj = (v_unb * x.values).sum(-1) / x.values.pow(2).sum(-1)
    assert (proj - 1).abs().max() < 2e-3
    assert ((v_plain * x.values).sum(-1) / x.values.pow(2).sum(-1)).mean() < 0.95  # the MSE codes shrink
    # an attention average keeps that shrink with plain norms; unbiased, what remains is the code noise that
    # does not average out (a strong shared direction would make the tokens' code errors alike)
    err = {k: ((v.mean(1) - x.values.mean(1)).norm() / x.values.mean(1).norm()).item()
           for k, v in (("plain", v_plain), ("unb", v_unb))}
    assert err["plain"] > 0.05 and err["unb"] < 0.3 * err["plain"]
    # per token, the MSE-optimal plain norms stay the closer; keys and the bytes do not change
    assert (v_plain - x.values).pow(2).mean() < (v_unb - x.values).pow(2).mean()
    assert torch.equal(unb.keys(), plain.keys()) and unb.nbytes() == plain.nbytes()
    with pytest.raises(kvsum.KVSumError, match="unbiased='yes'; accepted: none, values, keys, both"):
        make_method("turboquant", unbiased="yes")
    with pytest.raises(kvsum.KVSumError, match="not the keys with qjl"):
        make_method("turboquant", unbiased="keys", qjl=True)


def test_turboquant_keeps_sinks_and_window_exact():
    H, T, d = 2, 300, 16
    x = random_layer(H, T, d)
    m = make_method("turboquant", bits=3, sinks=4, window=32)
    state = m.compress(x)
    sinks, coded, window = state.parts
    assert coded.T == T - 36 and sinks.lengths() == [4, 4] and window.lengths() == [32, 32]
    # the exact entries are the prompt's first 4 and last 32 tokens, in the storage dtype
    assert torch.equal(sinks.keys.view(H, 4, d), x.keys[:, :4].half())
    assert torch.equal(window.values.view(H, 32, d), x.values[:, T - 32:].half())
    assert state.nbytes() == m.nbytes(H, T - 36, d, 3) + 2 * H * 36 * d * 2
    # the columns follow the positions; only the coded tokens carry error
    q = torch.randn(1, H, 3, d)
    err = (state.scores(q, 0.25) - q @ x.keys[None].transpose(-1, -2) * 0.25).abs()
    assert err[..., :4].max() < 2e-2 and err[..., T - 32:].max() < 2e-2 and err[..., 4:T - 32].max() > 0.1
    # the budget counts the exact tokens: bits=3 fits 0.35 alone but not with 200 exact tokens
    make_method("turboquant", bits=3).compress(random_layer(H, T, d, budget=0.35))
    with pytest.raises(kvsum.KVSumError, match="bits=3 needs"):
        make_method("turboquant", bits=3, window=200).compress(random_layer(H, T, d, budget=0.35))
    with pytest.raises(kvsum.KVSumError, match="sinks must be an integer >= 0"):
        make_method("turboquant", sinks=-1)


def test_turboquant_by_budget_takes_1_5_bits_where_2_do_not_fit():
    H, T, d = 2, 300, 64
    m = make_method("turboquant")
    full, sinks = 2 * H * T * d * 2, 2 * H * 4 * d * 2
    need = {b: m.nbytes(H, T - 4, d, b) + sinks for b in (1, 1.5, 2)}
    assert need[1] < need[1.5] < need[2]
    assert m.compress(random_layer(H, T, d, budget=(need[1.5] + need[2]) / 2 / full)).nbytes() == need[1.5]
    assert m.compress(random_layer(H, T, d, budget=(need[1] + need[1.5]) / 2 / full)).nbytes() == need[1]


def test_turboquant_skew_gives_keys_more_bits_within_1_to_4():
    m = make_method("turboquant")  # skew 0.5 by default
    assert [m.widths(b) for b in (1, 1.5, 2, 2.5, 3.5, 4)] == [(1, 1), (2, 1), (2.5, 1.5), (3, 2), (4, 3), (4, 4)]
    assert make_method("turboquant", skew=0).widths(3.5) == (3.5, 3.5)
    assert make_method("turboquant", qjl=True).widths(3) == (2.5, 2.5)  # keys: 3.5 = 2.5 MSE + 1 QJL
    x = random_layer(2, 300, 16)
    st = make_method("turboquant", bits=3.5, sinks=0).compress(x)
    assert (st.k.parts[0][2], st.v.parts[0][2]) == (4, 3)
    # the keys' extra bit buys lower key error at the values' expense
    err = {skew: make_method("turboquant", bits=3.5, sinks=0, skew=skew).compress(x) for skew in (0, 0.5)}
    kerr = {s: (st.keys() - x.keys).norm() for s, st in err.items()}
    verr = {s: (st.values() - x.values).norm() for s, st in err.items()}
    assert kerr[0.5] < 0.8 * kerr[0] and verr[0.5] > verr[0]


def test_turboquant_key_shift_widens_the_keys_of_sharp_layers():
    H, T, d = 2, 300, 16
    sharp, diffuse = random_layer(H, T, d, seed=1), random_layer(H, T, d, seed=2)
    sharp.layer_idx, diffuse.layer_idx = 0, 1
    pos = torch.arange(T - 8, T)
    for x, q in ((sharp, 6 * sharp.keys[:, 10:11].expand(H, 8, d)), (diffuse, torch.zeros(H, 8, d))):
        x.queries, x.query_pos = q.clone(), pos  # the sharp layer's queries all point at token 10
    m = make_method("turboquant", bits=3.5, sinks=0)
    plan = m.plan([diffuse, sharp], 1.0)
    assert plan.fractions == (1.0, 1.0) and plan.shifts == {0: 1, 1: -1}
    states = [m.compress(x, plan) for x in (sharp, diffuse)]
    assert [s.widths for s in states] == [(5, 3), (3, 3)]  # keys 4 +- 1, values untouched
    # the two layers hold what two unshifted layers would (but for the codebooks' sizes): the average is kept
    assert sum(s.nbytes() for s in states) == m.nbytes(H, T, d, 3.5, shift=1) + m.nbytes(H, T, d, 3.5, shift=-1)
    assert abs(sum(s.nbytes() for s in states) - 2 * m.nbytes(H, T, d, 3.5)) <= 4 * (2 ** 5 + 2 ** 3 - 2 * 2 ** 4)
    # no queries (or key_shift=0): no shift; a shift that would leave 1..8 bits is dropped
    assert make_method("turboquant", bits=3.5, sinks=0, key_shift=0).compress(sharp).widths == (4, 3)
    pca = make_method("turboquant", bits=3.5, sinks=0, key_basis="pca")  # its allocation follows the queries
    assert pca.compress(sharp, pca.plan([diffuse, sharp], 1.0)).widths == (4, 3)
    assert m.compress(sharp).widths == (4, 3)  # a layer compressed alone (no plan): no shift
    assert m.widths(1, 1) == (1, 1) and m.widths(4, -1) == (3, 4)
    with pytest.raises(kvsum.KVSumError, match="key_shift must be an integer >= 0"):
        make_method("turboquant", key_shift=-1)
