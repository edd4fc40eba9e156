"""Quantization methods: packing, Lloyd-Max codebooks, QJL, KIVI error bounds, byte counts, attention paths."""

import math
import sys

import pytest
import torch
from scipy import integrate

import kvsum
from kvsum.methods.base import LayerInput, make_method
from kvsum.methods.quant.codebook import codebook, coordinate_law, encode, lloyd_max
from kvsum.methods.quant.packing import Packed, pack, packed_nbytes, unpack
from kvsum.methods.quant.pca import gaussian_levels
from kvsum.methods.quant.turboquant import Coded, Rotation, gaussian, qjl_encode, qjl_estimate

from .conftest import tiny_llama


def _layer(H=2, T=300, d=16, budget=1.0, seed=0, outlier=True):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(H, T, d, generator=g)
    if outlier:
        keys[:, :, 3] = keys[:, :, 3] * 8 + 5  # a fixed outlier channel, as real keys have
    values = torch.randn(H, T, d, generator=g)
    full = 2 * H * T * d * 2
    return LayerInput(keys, values, None, None, d ** -0.5, 0, 1, budget * full, torch.float16)


@pytest.mark.parametrize("bits", range(1, 9))
def test_encode_picks_the_nearest_level(bits):
    # TurboQuant's codebooks up to 6 bits (7-8 take long to converge), pca's Gaussian ones beyond (bucketize)
    levels = codebook(bits, 64) if bits <= 6 else torch.tensor(gaussian_levels(bits)) / 8
    y = torch.cat([torch.randn(5000) / 8, levels, (levels[1:] + levels[:-1]) / 2])  # levels and cell edges too
    code = encode(y, levels)
    assert code.dtype == torch.uint8
    dist = (y[:, None] - levels).abs()
    assert (dist.gather(1, code.long()[:, None])[:, 0] <= dist.min(1).values + 1e-6).all()  # edges: either side
    assert torch.equal(code, torch.bucketize(y, (levels[1:] + levels[:-1]) / 2).to(torch.uint8))


@pytest.mark.parametrize("bits", range(1, 9))
def test_pack_round_trip(bits):
    n = 3 * 7 * 5  # not a multiple of 8: exercises the padding
    codes = torch.randint(0, 2 ** bits, (3, 7, 5), generator=torch.Generator().manual_seed(bits))
    codes[0, 0, 0] = 2 ** bits - 1
    packed = pack(codes, bits)
    assert packed.dtype == torch.uint8 and packed.numel() == packed_nbytes(n, bits) == math.ceil(n / 8) * bits
    assert torch.equal(unpack(packed, bits, n).view(3, 7, 5).long(), codes)
    # decoding through the word tables gives levels[code] for every width (3 bits: 12-bit words)
    levels = tuple(float(v) for v in torch.randn(2 ** bits, generator=torch.Generator().manual_seed(9)))
    assert torch.equal(Packed(codes, bits, levels).lookup(), torch.tensor(levels)[codes])


def test_codebook_levels_match_lloyd_max_for_the_beta_law():
    d = 128
    levels = torch.tensor(lloyd_max(2, d)) * math.sqrt(d)
    assert torch.allclose(levels, torch.tensor([-1.51, -0.453, 0.453, 1.51]), rtol=0.01)
    # Lloyd's centroid condition, checked independently by quadrature of the density.
    law, lv = coordinate_law(64), lloyd_max(3, 64)
    edges = [-1.0] + [(a + b) / 2 for a, b in zip(lv, lv[1:])] + [1.0]
    for level, lo, hi in zip(lv, edges, edges[1:]):
        mass = integrate.quad(law.pdf, lo, hi)[0]
        mean = integrate.quad(lambda x: x * law.pdf(x), lo, hi)[0] / mass
        assert mean == pytest.approx(level, rel=1e-6)


@pytest.mark.parametrize("kind", ["qr", "hadamard"])
@pytest.mark.parametrize("bits", [1, 2, 2.5, 3, 3.5, 4])
def test_mse_distortion_within_published_bound(bits, kind):
    d, n = 64, 4000
    u = torch.randn(n, d, generator=torch.Generator().manual_seed(7))
    u = u / u.norm(dim=-1, keepdim=True)
    R = Rotation(d, 3, kind, "cpu")
    y = R.apply(u)[None]
    coded = Coded(y, bits)
    coded.extend(y)
    x_hat = R.undo(coded.lookup()[0])  # read back from the packed codes
    mse = (u - x_hat).pow(2).sum(-1).mean().item()
    assert 4.0 ** -bits < mse <= math.sqrt(3) * math.pi / 2 * 4.0 ** -bits


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
    x = _layer(H=1, T=6, d=16, budget=10.0, outlier=False)  # rotation and S dwarf 6 tokens
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
    x = _layer(H=2, T=256, d=64, budget=10.0, outlier=False)
    q = torch.randn(1, 2, 8, 64, generator=torch.Generator().manual_seed(5))
    exact = q @ x.keys.transpose(-1, -2)
    mse = {qjl: (make_method("turboquant", bits=2, qjl=qjl, skew=0, sinks=0, key_shift=0).compress(x).scores(q, 1.0)
                 - exact).pow(2).mean().item() for qjl in (True, False)}
    assert mse[True] > 1.5 * mse[False]


def test_kivi_sinks_stay_exact_and_no_longer_widen_the_first_group():
    """sinks=4: the first tokens are held in the storage dtype (counted as the planner counts them), the codes
    and the window follow; an outlier sink key no longer sets the first key group's channel scales."""
    x = _layer(T=300)
    x.keys[:, 0] *= 50  # an attention sink's key: an outlier in every channel of its group
    plain = make_method("kivi", bits=2, group=8, residual=128).compress(x)
    m = make_method("kivi", bits=2, group=8, residual=128, sinks=4)
    s = m.compress(x)
    assert s.n_q == 168 and s.pending() == 300 - 4 - 168 and s.lengths() == [300] * x.H  # (300 - 4 - 128) // 8 * 8
    assert torch.equal(s.keys()[:, :4], x.keys[:, :4].half().float())
    assert torch.equal(s.values()[:, :4], x.values[:, :4].half().float())
    assert torch.equal(s.keys()[:, 4 + 168:], x.keys[:, 4 + 168:].half().float())
    assert s.nbytes() == m.nbytes(x.H, 300, x.d, 2, x.storage)

    def err(state, lo):  # mean key error over one group's tokens after the sink
        return (state.keys()[:, lo:lo + 7] - x.keys[:, lo:lo + 7]).abs().mean()

    assert 4 * err(s, 4) < err(plain, 1)  # 6.5x here
    with pytest.raises(kvsum.KVSumError, match="kivi: sinks must be an integer >= 0"):
        make_method("kivi", sinks=-1)


@pytest.mark.parametrize("bits", [2, 4])
def test_kivi_error_within_half_a_scale(bits):
    x = _layer(T=300)
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


def test_centered_keys_add_the_mean_logit_back_exactly_and_cut_the_error_of_offset_keys():
    H, T, d = 2, 300, 16
    x = _layer(H, T, d)
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
    moved = _layer(H, T, d)
    moved.keys = x.keys + 7
    st = make_method("turboquant", center=True, **knobs).compress(moved)
    assert (st.keys() - 7 - ctr.keys()).abs().mean() < 0.02 < (ctr.keys() - x.keys).abs().mean()
    # both attention paths agree, and the mean keys (fp16 per head) are counted
    p = torch.softmax(ctr.scores(q, 0.25), -1)
    rotated = ctr.scores(q, 0.25), ctr.mix(p)
    ctr.path = "dequant"
    assert torch.allclose(ctr.scores(q, 0.25), rotated[0], atol=1e-3)
    assert torch.allclose(ctr.mix(p), rotated[1], atol=1e-4)
    assert ctr.nbytes() == plain.nbytes() + H * d * 2 == make_method("turboquant", center=True, **knobs).nbytes(
        H, T, d, 2.5)


def test_unbiased_values_make_each_projection_exact_and_remove_the_shrink_an_average_keeps():
    H, T, d = 2, 2000, 16
    x = _layer(H, T, d, outlier=False)
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


def test_nbytes_is_the_analytic_count():
    H, T, d = 2, 300, 16
    x = _layer(H, T, d)
    tokens = H * T
    # turboquant 3.5 bits: half the channels at 4 bits, half at 3, for K and V; fp16 norms and rotation;
    # fp32 codebooks; uint8 outlier channel indices per head.
    per = tokens * (d // 2) * 4 / 8 + tokens * (d // 2) * 3 / 8 + 4 * (16 + 8) + H * d
    plain = dict(skew=0, sinks=0)  # the layout alone: no key/value skew, no exact sinks
    assert make_method("turboquant", bits=3.5, **plain).compress(x).nbytes() == 2 * per + 2 * tokens * 2 + d * d * 2
    # with qjl at 2.5 bits, keys: 1.5-bit MSE codes + sign bits + fp16 |r| + fp16 S
    keys = tokens * (d // 2) * (2 + 1) / 8 + 4 * (4 + 2) + H * d + tokens * d / 8 + tokens * 2 + d * d * 2
    vals = tokens * (d // 2) * (3 + 2) / 8 + 4 * (8 + 4) + H * d
    state = make_method("turboquant", bits=2.5, qjl=True, **plain).compress(x)
    assert state.nbytes() == keys + vals + 2 * tokens * 2 + d * d * 2
    # kivi: codes, fp16 scale + min per (32 tokens, channel) for keys and per (token, 16 channels) for values,
    # fp16 residual of T - n_q tokens
    n_q = (T - 128) // 32 * 32
    for bits in (2, 4):
        want = 2 * H * n_q * d * bits / 8 + 4 * H * (n_q // 32) * d + 4 * H * n_q * (d // 16) + 4 * H * (T - n_q) * d
        assert make_method("kivi", bits=bits).compress(x).nbytes() == want


def test_hadamard_rotation_is_orthogonal_holds_d_sign_bytes_and_refuses_other_head_dims():
    x = torch.randn(3, 50, 64, generator=torch.Generator().manual_seed(0))
    R = Rotation(64, 1, "hadamard", "cpu")
    y = R.apply(x)
    assert torch.allclose(y.norm(dim=-1), x.norm(dim=-1), rtol=1e-5)
    assert torch.allclose(R.undo(y), x, atol=1e-5)
    assert R.nbytes() == 64 and Rotation(64, 1, "qr", "cpu").nbytes() == 64 * 64 * 2
    assert not torch.equal(Rotation(64, 2, "hadamard", "cpu").apply(x), y)  # the signs follow the seed
    layer = _layer(d=16)
    qr = make_method("turboquant", bits=3.5).compress(layer)
    had = make_method("turboquant", bits=3.5, rotation="hadamard").compress(layer)
    assert qr.nbytes() - had.nbytes() == 16 * 16 * 2 - 16  # one layer's fp16 matrix against its sign bytes
    H, T, d = 1, 256, 64  # one KV head, few tokens: the dense rotation is 1/8 of the layer's 16-bit bytes
    g = torch.Generator().manual_seed(0)
    one = LayerInput(torch.randn(H, T, d, generator=g), torch.randn(H, T, d, generator=g), None, None, d ** -0.5, 0, 1,
                     0.25 * 2 * H * T * d * 2, torch.float16)
    with pytest.raises(kvsum.KVSumError, match=r"rotation alone takes 0\.125 of the layer, rotation='hadamard'"):
        make_method("turboquant", bits=3).compress(one)
    assert make_method("turboquant", bits=3, rotation="hadamard").compress(one).nbytes() <= 0.25 * 2 * H * T * d * 2
    with pytest.raises(kvsum.KVSumError) as small:  # 0.2% of 2,000 tokens: the rotation is not worth naming
        make_method("turboquant", bits=4).compress(_layer(T=2000, budget=0.2))
    assert "rotation" not in str(small.value)
    with pytest.raises(kvsum.KVSumError, match="power-of-2 head dim, got 24"):
        make_method("turboquant", bits=3.5, rotation="hadamard").compress(_layer(d=24))
    with pytest.raises(kvsum.KVSumError, match="rotation='givens'; accepted: qr, hadamard"):
        make_method("turboquant", rotation="givens")


def test_budget_picks_or_refuses_bits():
    x = _layer(budget=0.31)  # no exact sinks: 3.5 bits take 0.301 at head dim 16 (norms, rotation), 4 bits 0.329
    with pytest.raises(kvsum.KVSumError, match=r"bits=4 needs 0\.329 .* bits that fit: 3\.5, 3, 2\.5, 2, 1"):
        make_method("turboquant", sinks=0, bits=4).compress(x)
    assert make_method("turboquant", sinks=0).compress(x).bits == 3.5
    assert make_method("turboquant", sinks=0, skew=0, qjl=True).compress(x).bits == 3  # |r|, S: half a bit
    with pytest.raises(kvsum.KVSumError, match="not supported"):
        make_method("turboquant", sinks=0, bits=5).compress(x)
    with pytest.raises(kvsum.KVSumError, match="no supported bit width fits"):
        make_method("turboquant", sinks=0).compress(_layer(budget=0.05))
    with pytest.raises(kvsum.KVSumError, match="kivi: bits=4 needs .* 140 of 300 tokens stay in full precision"):
        make_method("kivi", bits=4).compress(_layer(budget=0.6))
    assert make_method("kivi").compress(_layer(budget=0.6)).bits == 2


def _teacher_forced(model, cache, cont):
    with torch.no_grad():
        return model(cont, past_key_values=cache).logits[0].float()


@pytest.mark.parametrize("knobs", [dict(bits=3.5), dict(bits=2.5, qjl=True), dict(bits=3, rotation="hadamard"),
                                   dict(bits=2.5, unbiased="both")])
def test_rotated_and_dequant_paths_agree(tiny, ids, knobs):
    cont = ids[:, :12]
    out = {}
    for path in ("rotated", "dequant"):
        cache = kvsum.compress(tiny, ids, method="turboquant", budget=1.0, path=path, **knobs)
        out[path] = _teacher_forced(tiny, cache, cont)
        state = cache.layers[0].state
    q = torch.randn(1, 2, 5, 16)
    logits = state.scores(q, 0.25)
    state.path = "rotated"
    assert torch.allclose(state.scores(q, 0.25), logits, atol=1e-4)
    assert torch.allclose(out["rotated"], out["dequant"], atol=1e-4)


def _kl(ref, other):
    return torch.nn.functional.kl_div(other.log_softmax(-1), ref.log_softmax(-1), log_target=True,
                                      reduction="batchmean").item()


@pytest.mark.parametrize("method,budget", [("turboquant", 0.35), ("kivi", 0.7)])
def test_compress_and_generate_at_4_and_2_bits(method, budget):
    model = tiny_llama()
    ids = torch.randint(0, 128, (1, 400), generator=torch.Generator().manual_seed(2))
    ctx, cont = ids[:, :360], ids[:, 360:]
    full = _teacher_forced(model, kvsum.compress(model, ctx, method="full"), cont)
    kl = {}
    for bits in (4, 2):
        cache = kvsum.compress(model, ctx, method=method, budget=budget, bits=bits)
        assert cache.nbytes() <= (budget + 0.02) * cache.reference_nbytes
        assert all(n == 360 for n in cache.layers[0].lengths())
        kl[bits] = _kl(full, _teacher_forced(model, cache, cont))
        cache = kvsum.compress(model, ctx, method=method, budget=budget, bits=bits)
        out = model.generate(ids[:, :362], cache=cache, max_new_tokens=5, min_new_tokens=5, do_sample=False)
        assert out.shape == (1, 367) and cache.get_seq_length() == 366
    assert 0 < kl[4] < kl[2]


@pytest.mark.model
def test_quantized_smollm2_tracks_the_full_cache(smollm2):
    from pydoc_data.topics import topics

    model, tok = smollm2
    ids = tok(topics["assignment"], return_tensors="pt").input_ids[:, :448]
    ctx, cont = ids[:, :384], ids[:, 384:]
    pre = kvsum.prefill(model, ctx)
    full = _teacher_forced(model, kvsum.compress_prefill(pre, make_method("full"), 1.0), cont)
    kl = {}
    for name, bits in [("turboquant", 4), ("turboquant", 2), ("kivi", 4)]:
        cache = kvsum.compress_prefill(pre, make_method(name, bits=bits), 1.0)
        kl[name, bits] = _kl(full, _teacher_forced(model, cache, cont))
    assert kl["turboquant", 4] < 0.05 and kl["kivi", 4] < 0.05
    assert kl["turboquant", 4] < kl["turboquant", 2]


def _stepwise(model, cache, cont):
    """Next-token logits when `cont` is fed one token at a time, as generation does."""
    with torch.no_grad():
        return torch.stack([model(cont[:, t:t + 1], past_key_values=cache).logits[0, -1].float()
                            for t in range(cont.shape[1])])


@pytest.mark.parametrize("method,knobs", [("turboquant", dict(bits=4, sinks=0)),
                                          ("turboquant", dict(bits=3, qjl=True, sinks=0)),
                                          ("turboquant", dict(bits=3, key_basis="pca", sinks=0)),
                                          ("turboquant", dict(bits=3, key_basis="pca", pre_rope=True, sinks=0)),
                                          ("turboquant", dict(bits=3, center=True, sinks=0)),
                                          ("turboquant", dict(bits=3, unbiased="both", sinks=0)),
                                          ("kivi", dict(bits=2)), ("kivi", dict(bits=2, sinks=4))])
def test_decoded_tokens_are_quantized_in_groups(method, knobs):
    model = tiny_llama()
    ids = torch.randint(0, 128, (1, 500), generator=torch.Generator().manual_seed(2))
    ctx, cont = ids[:, :300], ids[:, 300:]
    full = _stepwise(model, kvsum.compress(model, ctx, method="full"), cont)
    plain = kvsum.compress(model, ctx, method=method, budget=1.0, **knobs).attach(lambda i: None)
    ref = _stepwise(model, plain, cont)  # the same quantized prompt, decoded tokens kept in full precision
    cache = kvsum.compress(model, ctx, method=method, budget=1.0, **knobs)
    state0, start = cache.layers[0].state, cache.nbytes()
    coded0 = state0.T - state0.pending()
    ours = _stepwise(model, cache, cont)
    m = make_method(method, **knobs)
    for layer in cache.layers:
        assert layer.state is state0 or type(layer.state) is type(state0)  # one store, extended in place
        assert layer.get_seq_length() == 500 and layer.state.T == layer.offset
        pending = layer.state.pending() + layer.tail_length()
        assert m.residual <= pending <= m.residual + m.group  # the window is kept, whole groups are folded
    assert cache.get_seq_length() == 500
    H, d = 2, 16
    if method == "turboquant":  # the state is exactly a prompt-time state of all its tokens
        shift = cache.layers[0].state.widths[0] - m.widths(knobs["bits"])[0]  # key bits by layer entropy
        want = m.nbytes(H, cache.layers[0].offset, d, knobs["bits"], shift)
        held = cache.layers[0].state.nbytes()
        assert held <= want if m.key_basis == "pca" else held == want  # pca: within the same bytes
    # memory grows by the quantized size: per decoded token well under the 2 x H x d fp16 elements
    tail = sum(layer.keys.numel() + layer.values.numel() for layer in cache.layers) * 4  # fp32 model
    grown = (cache.nbytes() - tail - start) / (2 * 200)  # per token per layer
    assert grown < {4: 0.35, 3: 0.3, 2: 0.35}[knobs["bits"]] * 2 * H * d * 2
    coded = cache.layers[0].state.T - cache.layers[0].state.pending()
    assert coded - coded0 >= 200 - m.residual - m.group  # the decoded tokens were quantized
    # outputs: the extra quantization of 200 decoded tokens costs less than quantizing the 300-token prompt
    assert 0 < _kl(ref, ours) < _kl(full, ref)
    out = model.generate(ids[:, :305], cache=kvsum.compress(model, ctx, method=method, budget=1.0, **knobs),
                         max_new_tokens=60, min_new_tokens=60, do_sample=False)
    assert out.shape == (1, 365)


def test_turboquant_keeps_sinks_and_window_exact():
    H, T, d = 2, 300, 16
    x = _layer(H, T, d)
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
    make_method("turboquant", bits=3).compress(_layer(H, T, d, budget=0.35))
    with pytest.raises(kvsum.KVSumError, match="bits=3 needs"):
        make_method("turboquant", bits=3, window=200).compress(_layer(H, T, d, budget=0.35))
    with pytest.raises(kvsum.KVSumError, match="sinks must be an integer >= 0"):
        make_method("turboquant", sinks=-1)


def test_turboquant_skew_gives_keys_more_bits_within_1_to_4():
    m = make_method("turboquant")  # skew 0.5 by default
    assert [m.widths(b) for b in (1, 2, 2.5, 3.5, 4)] == [(1, 1), (2.5, 1.5), (3, 2), (4, 3), (4, 4)]
    assert make_method("turboquant", skew=0).widths(3.5) == (3.5, 3.5)
    assert make_method("turboquant", qjl=True).widths(3) == (2.5, 2.5)  # keys: 3.5 = 2.5 MSE + 1 QJL
    x = _layer(2, 300, 16)
    st = make_method("turboquant", bits=3.5, sinks=0).compress(x)
    assert (st.k.parts[0][2], st.v.parts[0][2]) == (4, 3)
    # the keys' extra bit buys lower key error at the values' expense
    err = {skew: make_method("turboquant", bits=3.5, sinks=0, skew=skew).compress(x) for skew in (0, 0.5)}
    kerr = {s: (st.keys() - x.keys).norm() for s, st in err.items()}
    verr = {s: (st.values() - x.values).norm() for s, st in err.items()}
    assert kerr[0.5] < 0.8 * kerr[0] and verr[0.5] > verr[0]


def test_turboquant_with_exact_tokens_streams_decoded_tokens_into_its_codes():
    model = tiny_llama()
    ids = torch.randint(0, 128, (1, 400), generator=torch.Generator().manual_seed(3))
    cache = kvsum.compress(model, ids[:, :300], method="turboquant", budget=1.0, bits=4, sinks=4, window=16)
    coded = cache.layers[0].state.parts[1]
    _stepwise(model, cache, ids[:, 300:])
    assert coded.T == 300 - 20 + 100 - cache.layers[0].tail_length()  # decoded tokens joined the codes
    assert cache.layers[0].tail_length() <= 32


def test_turboquant_key_shift_widens_the_keys_of_sharp_layers():
    H, T, d = 2, 300, 16
    sharp, diffuse = _layer(H, T, d, seed=1), _layer(H, T, d, seed=2)
    sharp.layer_idx, diffuse.layer_idx = 0, 1
    pos = torch.arange(T - 8, T)
    for x, q in ((sharp, 6 * sharp.keys[:, 10:11].expand(H, 8, d)), (diffuse, torch.zeros(H, 8, d))):
        x.queries, x.query_pos = q.clone(), pos  # the sharp layer's queries all point at token 10
    m = make_method("turboquant", bits=3.5, sinks=0)
    assert m.layer_budgets([diffuse, sharp], 1.0) == [1.0, 1.0]
    states = [m.compress(x) for x in (sharp, diffuse)]
    assert [s.widths for s in states] == [(5, 3), (3, 3)]  # keys 4 +- 1, values untouched
    # the two layers hold what two unshifted layers would (but for the codebooks' sizes): the average is kept
    assert sum(s.nbytes() for s in states) == m.nbytes(H, T, d, 3.5, 1) + m.nbytes(H, T, d, 3.5, -1)
    assert abs(sum(s.nbytes() for s in states) - 2 * m.nbytes(H, T, d, 3.5)) <= 4 * (2 ** 5 + 2 ** 3 - 2 * 2 ** 4)
    # no queries (or key_shift=0): no shift; a shift that would leave 1..8 bits is dropped
    assert make_method("turboquant", bits=3.5, sinks=0, key_shift=0).compress(sharp).widths == (4, 3)
    pca = make_method("turboquant", bits=3.5, sinks=0, key_basis="pca")  # its allocation follows the queries
    pca.layer_budgets([diffuse, sharp], 1.0)
    assert pca.compress(sharp).widths == (4, 3)
    assert m.widths(1, 1) == (1, 1) and m.widths(4, -1) == (3, 4)
    with pytest.raises(kvsum.KVSumError, match="key_shift must be an integer >= 0"):
        make_method("turboquant", key_shift=-1)



def test_pca_allocation_and_gaussian_levels():
    from kvsum.methods.quant.pca import MAX_BITS, allocate, gaussian_levels, gaussian_lloyd_max
    assert gaussian_levels(2) == pytest.approx((-1.510, -0.4528, 0.4528, 1.510), abs=2e-3)  # Max (1960)
    mse = [gaussian_lloyd_max(b)[1] for b in (1, 2, 3, 4)]
    assert mse == pytest.approx([0.3634, 0.1175, 0.03454, 0.009497], rel=1e-3)  # Max's table
    b = allocate(torch.tensor([100.0, 10.0, 1.0, 0.0]), 8)
    assert b.sum() == 8 and b[0] >= b[1] >= b[2] and b[3] == 0
    # each bit cuts a variance by ~4x: an axis 16x wider earns about two more bits
    assert allocate(torch.tensor([16.0, 1.0]), 6).tolist() == [4, 2]
    assert allocate(torch.ones(3), 100).tolist() == [MAX_BITS] * 3  # capped


def test_turboquant_pca_keys_cut_the_queries_logit_error_at_no_more_bytes():
    H, T, d = 2, 400, 16
    g = torch.Generator().manual_seed(4)
    x = _layer(H, T, d)
    x.keys = torch.randn(H, T, d, generator=g) * torch.logspace(0.7, -0.7, d) + 3  # anisotropic, offset
    x.queries = torch.randn(2 * H, 30, d, generator=g) * torch.linspace(0, 2, d)  # 2 query heads per KV head
    q = x.queries.reshape(H, -1, d)[None]
    states = {kb: make_method("turboquant", bits=2.5, sinks=0, key_shift=0, key_basis=kb).compress(x)
              for kb in ("random", "pca")}
    exact = q @ x.keys.transpose(-1, -2)
    err = {kb: (st.scores(q, 1.0) - exact).pow(2).mean() for kb, st in states.items()}
    assert err["pca"] < 0.3 * err["random"]
    assert states["pca"].nbytes() <= states["random"].nbytes()
    refs = sys.getrefcount(x.queries)
    kept = make_method("turboquant", bits=2.5, sinks=0, key_basis="pca").compress(x)
    held = sys.getrefcount(x.queries) - refs  # outside the assert: pytest's rewrite would hold one more
    assert held == 0 and kept.T == T  # the state holds no reference query (their bytes are not counted)
    assert torch.equal(states["pca"].values(), states["random"].values())  # values: the same rotated codes
    # both attention paths, and decoded keys coded on the same axes
    st = states["pca"]
    rotated = st.scores(q, 0.5)
    st.path = "dequant"
    assert torch.allclose(st.scores(q, 0.5), rotated, atol=1e-3)
    st.extend(x.keys[:, :40], x.values[:, :40])
    assert st.T == T + 40 and torch.equal(st.keys()[:, T:], st.keys()[:, :40])
    with pytest.raises(kvsum.KVSumError, match="key_basis='eigen'; accepted: random, pca"):
        make_method("turboquant", key_basis="eigen")
    with pytest.raises(kvsum.KVSumError, match="without QJL"):
        make_method("turboquant", key_basis="pca", qjl=True)


def test_pre_rope_pca_codes_keys_before_rope_at_their_positions():
    """Keys that share two directions before RoPE, smeared over every pair's plane by it: coded before RoPE,
    the same bytes hold them far better, and keys decoded later are un-rotated at their own positions."""
    from kvsum.calibrate import rope_tables, rotate
    H, T, d, n = 2, 400, 16, 40
    g = torch.Generator().manual_seed(6)
    rope = {"inv_freq": 1.0 / 100 ** (torch.arange(0, d, 2) / d), "scaling": 1.0}
    pre = torch.randn(H, T + n, 2, generator=g) @ (3 * torch.randn(H, 2, d, generator=g))
    keys = rotate(pre + 0.1 * torch.randn(H, T + n, d, generator=g), *rope_tables(rope["inv_freq"], 1.0, T + n))
    x = _layer(H, T, d)
    x.keys, x.rope = keys[:, :T].contiguous(), rope
    x.queries, x.query_pos = torch.randn(2 * H, 30, d, generator=g), torch.arange(T - 30, T)
    coded = slice(4, T - 8)
    states = {p: make_method("turboquant", bits=2.5, key_basis="pca", pre_rope=p, window=8).compress(x).parts[1]
              for p in (False, True)}

    def rel(st, k):
        return float((st.keys()[:, -k.shape[1]:] - k).norm() / k.norm())
    err = {p: rel(st, x.keys[:, coded]) for p, st in states.items()}
    assert err[True] < 0.3 * err[False]
    st = states[True]
    assert st.nbytes() <= make_method("turboquant", bits=2.5, key_shift=0).build(
        x.keys[:, coded], x.values[:, coded], 2.5, 0).nbytes()
    q = torch.randn(1, H, 5, d, generator=g)
    rotated = st.scores(q, 0.5)
    st.path = "dequant"
    assert torch.allclose(st.scores(q, 0.5), rotated, atol=1e-4)
    # decoded keys come after the 8-token window: positions T.., where the prompt's last code is at T - 9
    st.extend(keys[:, T:], torch.randn(H, n, d, generator=g))
    assert st.T == T - 12 + n and rel(st, keys[:, T:]) < 2 * err[True]
    with pytest.raises(kvsum.KVSumError, match="needs key_basis='pca'"):
        make_method("turboquant", pre_rope=True)
    x.rope = None
    with pytest.raises(kvsum.KVSumError, match="Llama form"):
        make_method("turboquant", key_basis="pca", pre_rope=True).compress(x)
    with pytest.raises(kvsum.KVSumError, match="drop pre_rope in a composition"):
        make_method("snapkv+turboquant", key_basis="pca", pre_rope=True)


def test_pca_outliers_keep_the_worst_coded_tokens_exact_in_the_same_bytes():
    H, T, d = 2, 400, 16
    g = torch.Generator().manual_seed(5)
    x = _layer(H, T, d)
    x.keys = torch.randn(H, T, d, generator=g) * torch.logspace(0.7, -0.7, d)
    odd = torch.tensor([7, 100, 222, 391])
    x.keys[:, odd, -1] = 40.0  # far outside the narrow last axis: its codes cannot hold these tokens
    x.queries = torch.randn(2 * H, 30, d, generator=g)
    q = x.queries.reshape(H, -1, d)[None]
    exact = q @ x.keys.transpose(-1, -2)
    states = {o: make_method("turboquant", bits=2.5, sinks=0, key_basis="pca", outliers=o).compress(x)
              for o in (0.0, 0.01)}
    worst = {o: (st.scores(q, 1.0) - exact).abs().amax((0, 1, 2)) for o, st in states.items()}  # per token
    st = states[0.01]
    assert torch.equal(st.k.exact[0].long(), odd.expand(H, -1))  # the 4 = 1% of 400 worst tokens are these
    assert torch.equal(st.keys()[:, odd], x.keys[:, odd].half().float())
    assert worst[0.01][odd].max() < 0.05 * worst[0.0][odd].min()
    assert st.nbytes() <= make_method("turboquant", bits=2.5, sinks=0, key_shift=0).compress(x).nbytes()
    rotated = st.scores(q, 0.5)
    st.path = "dequant"
    assert torch.allclose(st.scores(q, 0.5), rotated, atol=1e-3)
    st.extend(x.keys[:, :8], x.values[:, :8])  # decoded tokens are coded only: a copy of outlier 7 is clipped
    assert st.T == T + 8 and torch.equal(st.keys()[:, 7], x.keys[:, 7].half().float())
    assert (st.keys()[:, T + 7] - x.keys[:, 7]).abs().max() > 10
    for bad in (dict(outliers=0.01), dict(outliers=1.0, key_basis="pca")):
        with pytest.raises(kvsum.KVSumError, match="outliers"):
            make_method("turboquant", **bad)
