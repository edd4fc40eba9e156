"""kvsum/methods/quantizer.py: what every quantizer shares (byte counts, bit widths that fit a budget, compress and
generate), over TurboQuant and KIVI alike."""

import pytest
import torch

import kvsum
from kvsum.methods import make_method
from tests.helpers import kl_div, random_layer, teacher_forced, tiny_llama


def test_nbytes_is_the_analytic_count():
    H, T, d = 2, 300, 16
    x = random_layer(H, T, d)
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


def test_budget_picks_or_refuses_bits():
    x = random_layer(budget=0.31)  # no exact sinks: 3.5 bits take 0.301 at head dim 16 (norms, rotation), 4 bits 0.329
    with pytest.raises(kvsum.KVSumError, match=r"bits=4 needs 0\.329 .* bits that fit: 3\.5, 3, 2\.5, 2, 1"):
        make_method("turboquant", sinks=0, bits=4).compress(x)
    assert make_method("turboquant", sinks=0).compress(x).bits == 3.5
    assert make_method("turboquant", sinks=0, skew=0, qjl=True).compress(x).bits == 3  # |r|, S: half a bit
    with pytest.raises(kvsum.KVSumError, match="not supported"):
        make_method("turboquant", sinks=0, bits=5).compress(x)
    with pytest.raises(kvsum.KVSumError, match="no supported bit width fits"):
        make_method("turboquant", sinks=0).compress(random_layer(budget=0.05))
    with pytest.raises(kvsum.KVSumError, match="kivi: bits=4 needs .* 140 of 300 tokens stay in full precision"):
        make_method("kivi", bits=4).compress(random_layer(budget=0.6))
    assert make_method("kivi").compress(random_layer(budget=0.6)).bits == 2


@pytest.mark.parametrize("method,budget", [("turboquant", 0.35), ("kivi", 0.7)])
def test_compress_and_generate_at_4_and_2_bits(method, budget):
    model = tiny_llama()
    ids = torch.randint(0, 128, (1, 400), generator=torch.Generator().manual_seed(2))
    ctx, cont = ids[:, :360], ids[:, 360:]
    full = teacher_forced(model, kvsum.compress(model, ctx, method="full"), cont)
    kl = {}
    for bits in (4, 2):
        cache = kvsum.compress(model, ctx, method=method, budget=budget, bits=bits)
        assert cache.nbytes() <= (budget + 0.02) * cache.reference_nbytes
        assert all(n == 360 for n in cache.layers[0].lengths())
        kl[bits] = kl_div(full, teacher_forced(model, cache, cont))
        cache = kvsum.compress(model, ctx, method=method, budget=budget, bits=bits)
        out = model.generate(ids[:, :362], cache=cache, max_new_tokens=5, min_new_tokens=5, do_sample=False)
        assert out.shape == (1, 367) and cache.get_seq_length() == 366
    assert 0 < kl[4] < kl[2]
