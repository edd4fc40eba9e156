"""kvsum/methods/summary/cover.py: the low-rank and code covers of every non-anchor token."""

import pytest
import torch

import kvsum
from kvsum.methods import LayerInput, make_method
from kvsum.methods.quant.pca import KeyTransform
from kvsum.methods.quant.turboquant import TurboQuant
from tests.helpers import reference_layer


@pytest.mark.parametrize("rope", [True, False])
def test_cover_at_full_rank_is_exact_and_masks_anchors(rope):
    """The low-rank cover at full rank reproduces attention over its tokens (RoPE undone and redone exactly),
    and the tokens held as anchors are masked out of it for their own head only."""
    from kvsum.methods.summary.cover import CoverState
    from kvsum.rope import rope_tables, rotate

    g = torch.Generator().manual_seed(0)
    H, T, d = 3, 50, 16
    tables = {"inv_freq": 1 / 10000 ** (torch.arange(0, d, 2).float() / d), "scaling": 1.0}
    keys = rotate(torch.randn(H, T, d, generator=g), *rope_tables(tables["inv_freq"], 1.0, T))
    values = torch.randn(H, T, d, generator=g)
    exclude = torch.zeros(H, T, dtype=torch.bool)
    exclude[:, :2] = True
    exclude[1, 10] = True
    state = CoverState(keys, values, H * d, H * d, exclude, tables if rope else None, torch.float32)
    q = torch.randn(1, H, 4, d, generator=g)
    ref = (q[0] @ keys.transpose(1, 2) * 0.25).masked_fill(exclude[:, None], float("-inf"))[None]
    s = state.scores(q, 0.25)
    assert torch.equal(torch.isinf(s), torch.isinf(ref))
    torch.testing.assert_close(s.masked_fill(torch.isinf(s), 0), ref.masked_fill(torch.isinf(ref), 0),
                               atol=1e-4, rtol=1e-4)
    p = torch.softmax(s, -1)
    torch.testing.assert_close(state.mix(p), p @ values[None], atol=1e-4, rtol=1e-4)
    assert state.lengths() == [48, 47, 48]


@pytest.mark.parametrize("rows", [1, 3])  # a decoding step's one query row (one index_fill) and several
@pytest.mark.parametrize("center", [False, True])
def test_code_cover_skips_its_anchors_at_a_few_bytes_each(center, rows):
    """The code cover's logits are -inf at the tokens its head holds exactly and unchanged elsewhere; the skipped
    tokens cost their indices (8 bytes each), not a byte for every token of every head."""
    from kvsum.methods.summary.cover import EXCLUDED_BYTES, MaskedState

    torch.manual_seed(1)
    H, T, d = 3, 301, 64
    inner = TurboQuant(bits=3.5, center=center).build(torch.randn(H, T, d), torch.randn(H, T, d), 3.5, layer_idx=0)
    exclude = torch.rand(H, T) < 0.1
    state = MaskedState(inner, exclude)
    q = torch.randn(1, H, rows, d)
    s, plain = state.scores(q, 0.125), inner.scores(q, 0.125)
    assert torch.isneginf(s[0].transpose(0, 1)[:, exclude]).all()
    assert torch.equal(s[0].transpose(0, 1)[:, ~exclude], plain[0].transpose(0, 1)[:, ~exclude])
    assert state.lengths() == (T - exclude.sum(1)).tolist()
    assert state.nbytes() == inner.nbytes() + EXCLUDED_BYTES * int(exclude.sum())


@pytest.mark.parametrize("knobs", [dict(cover_share=0.6), dict(cover=TurboQuant(bits=2)),
                                   dict(cover=TurboQuant(bits=1.5, key_basis="pca")),
                                   dict(cover=TurboQuant(bits=1.5, center=True)),
                                   dict(cover=TurboQuant(bits=2, unbiased="values")),
                                   dict(cover=TurboQuant(bits=2, rotation="hadamard"))])
@pytest.mark.parametrize("budget", [0.5, 0.3])
def test_cover_modes_keep_every_token_within_budget(tiny, ids, knobs, budget):
    cache = kvsum.compress(tiny, ids, method="summary", budget=budget, **knobs)
    assert (budget - 0.03) * cache.reference_nbytes <= cache.nbytes() <= (budget + 0.02) * cache.reference_nbytes
    assert all(n == ids.shape[1] for layer in cache.layers for n in layer.lengths())  # anchors + cover = all
    out = tiny.generate(torch.cat([ids, ids[:, :4]], -1), cache=cache, max_new_tokens=4, do_sample=False)
    assert out.shape[1] == ids.shape[1] + 8


def test_code_cover_leaves_the_sinks_to_the_exact_anchors():
    """The sinks' keys are unlike the others: coded with them they would skew the cover's channel split and mean."""
    x = reference_layer(T=300, H=2, budget=0.4)
    x.keys[:, :4] = x.keys[:, :4] * 10 + 20  # sinks far from every other key, as in real models
    state = make_method("summary", cover=TurboQuant(bits=3.5, center=True), sinks=4).compress(x)
    anchors, cover = state.parts
    assert cover.inner.T == 296 and (cover.exclude.H, cover.exclude.T) == (2, 296)
    starts = [0, *torch.tensor(anchors.lengths()).cumsum(0)[:-1].tolist()]
    for h, s in enumerate(starts):  # every head's first anchors are the sinks, exact
        assert torch.equal(anchors.keys[s:s + 4].float(), x.keys[h, :4])
    torch.testing.assert_close(cover.inner.k_mean.float()[:, 0], x.keys[:, 4:].mean(1), atol=2e-3, rtol=0)
    assert state.lengths() == [300, 300]


def test_code_cover_widens_keys_in_sharp_layers(tiny, ids):
    cache = kvsum.compress(tiny, ids, method="summary", budget=0.3, cover=TurboQuant(bits=2))
    covers = [layer.state.parts[1].inner for layer in cache.layers]  # ConcatState([anchors, MaskedState])
    assert sorted(c.widths[0] for c in covers) == [1.5, 3.5]  # keys 2.5 +- 1 (2 layers), values 1.5
    assert {c.widths[1] for c in covers} == {1.5}
    flat = kvsum.compress(tiny, ids, method="summary", budget=0.3, cover=TurboQuant(bits=2),
                          entropy_allocation=False)
    assert {layer.state.parts[1].inner.widths for layer in flat.layers} == {(2.5, 1.5)}


def test_centered_cover_holds_each_layers_mean_key(tiny, ids):
    cache = kvsum.compress(tiny, ids, method="summary", budget=0.3, cover=TurboQuant(bits=2, center=True))
    plain = kvsum.compress(tiny, ids, method="summary", budget=0.3, cover=TurboQuant(bits=2))
    pre = kvsum.prefill(tiny, ids)
    for layer, ref, full in zip(cache.layers, plain.layers, pre.cache.layers):
        cover = layer.state.parts[1].inner
        assert torch.allclose(cover.k_mean.float(), full.keys[0].float().mean(1, keepdim=True), atol=1e-2)
        assert cover.nbytes() == ref.state.parts[1].inner.nbytes() + (cover.k_mean.numel() + cover.k_shrink.numel()) * 2


def test_unbiased_cover_reads_its_values_unshrunk_in_the_same_bytes(tiny, ids):
    cache = kvsum.compress(tiny, ids, method="summary", budget=0.3, cover=TurboQuant(bits=2, unbiased="values"))
    plain = kvsum.compress(tiny, ids, method="summary", budget=0.3, cover=TurboQuant(bits=2))
    pre = kvsum.prefill(tiny, ids)
    for layer, ref, full in zip(cache.layers, plain.layers, pre.cache.layers):
        cover, plain_cover = layer.state.parts[1].inner, ref.state.parts[1].inner
        v = full.values[0].float()[:, ids.shape[1] - cover.T:]  # the cover codes every token after the sinks
        proj = (cover.values() * v).sum(-1) / v.pow(2).sum(-1)
        assert (proj - 1).abs().max() < 2e-3 < (1 - (plain_cover.values() * v).sum(-1) / v.pow(2).sum(-1)).mean()
        assert torch.equal(cover.keys(), plain_cover.keys()) and cover.nbytes() == plain_cover.nbytes()
    with pytest.raises(kvsum.KVSumError, match="unbiased='yes'"):
        make_method("summary", cover="turboquant(bits=2, unbiased='yes')")


def test_pca_cover_codes_keys_on_the_queries_axes_without_a_layer_shift(tiny, ids):
    cache = kvsum.compress(tiny, ids, method="summary", budget=0.3, cover=TurboQuant(bits=2, key_basis="pca"))
    covers = [layer.state.parts[1].inner for layer in cache.layers]
    assert all(isinstance(c.k, KeyTransform) for c in covers)
    assert {c.widths for c in covers} == {(2.5, 1.5)}  # no key shift: pca spreads bits by the queries
    random = kvsum.compress(tiny, ids, method="summary", budget=0.3, cover=TurboQuant(bits=2))
    assert cache.nbytes() <= random.nbytes()


def test_pre_rope_cover_codes_the_tokens_after_the_sinks_at_their_positions(tiny, ids):
    """A pca cover coded before RoPE un-rotates the tokens after the sinks by their own positions (the frame starts
    at the sinks), so its keys read back close to the model's, far closer than with the frame's start dropped; it
    holds the budget, and a cache over it generates."""
    cover = TurboQuant(bits=3.5, key_basis="pca", pre_rope=True, unbiased="values", skew=0)
    cache = kvsum.compress(tiny, ids, method="summary", budget=0.3, cover=cover)
    full = kvsum.prefill(tiny, ids).cache.layers
    for layer, ref in zip(cache.layers, full):
        inner = layer.state.parts[1].inner
        k, s = ref.keys[0].float(), ids.shape[1] - inner.T
        assert inner.k.frame.start == s > 0 and inner.k.frame.resume == ids.shape[1]
        err = (inner.keys() - k[:, s:]).norm() / k[:, s:].norm()
        assert err < 0.2
        inner.k.frame.start = 0  # the same codes turned from position 0: the keys come out wrong
        assert (inner.keys() - k[:, s:]).norm() / k[:, s:].norm() > 2 * err
    assert cache.nbytes() <= 0.3 * sum(2 * ref.keys.numel() * 2 for ref in full)  # the budget, in 16-bit bytes
    out = tiny.generate(ids, past_key_values=cache, max_new_tokens=4, do_sample=False)
    assert out.shape[1] == ids.shape[1] + 4
    H, T, d = 1, 256, 64  # a layer whose RoPE kvsum cannot read: refused, naming the knob
    x = LayerInput(*(torch.randn(*shape) for shape in ((H, T, d), (H, T, d), (4, 32, d))), torch.arange(T - 32, T),
                   d ** -0.5, 0, 1, 0.3 * 2 * H * T * d * 2, torch.float16)
    with pytest.raises(kvsum.KVSumError, match="pre_rope un-rotates keys by the model's RoPE"):
        make_method("summary", cover=cover, score="max").compress(x)


def test_the_cover_is_a_quantizer_that_checks_its_own_knobs():
    """The cover takes any quantizer config (or its spec string); the quantizer refuses its own bad knobs, and
    the cover refuses the knobs it cannot honour (exact tokens: summary's anchors decide)."""
    with pytest.raises(kvsum.KVSumError, match="key_basis='hadamard'; accepted: random, pca"):
        make_method("summary", cover=TurboQuant(bits=2, key_basis="hadamard"))
    with pytest.raises(kvsum.KVSumError, match="rotation='pca'; accepted: qr, hadamard"):
        make_method("summary", cover=TurboQuant(bits=2, rotation="pca"))
    assert make_method("summary", cover="turboquant(bits=3.5, center=True)") == make_method(
        "summary", cover=TurboQuant(bits=3.5, center=True))
    for knobs in (dict(sinks=8), dict(window=16)):
        with pytest.raises(kvsum.KVSumError, match="drop the cover's (sinks|window)"):
            make_method("summary", cover=TurboQuant(bits=2, **knobs))
    with pytest.raises(kvsum.KVSumError, match="cover must be a"):
        make_method("summary", cover=make_method("snapkv"))


def test_the_cover_falls_back_to_the_hadamard_rotation_where_the_dense_one_does_not_fit():
    H, T, d = 1, 256, 64  # one KV head, few tokens: the dense fp16 rotation is 1/8 of the layer
    g = torch.Generator().manual_seed(0)
    keys, values, queries = (torch.randn(*shape, generator=g) for shape in ((H, T, d), (H, T, d), (4, 32, d)))
    x = LayerInput(keys, values, queries, torch.arange(T - 32, T), d ** -0.5, 0, 1, 0.25 * 2 * H * T * d * 2,
                   torch.float16)
    fell = make_method("summary", cover=TurboQuant(bits=3), score="max").compress(x)
    state = make_method("summary", cover=TurboQuant(bits=3, rotation="hadamard"), score="max").compress(x)
    assert fell.parts[1].inner.R.nbytes() == state.parts[1].inner.R.nbytes() == d
    assert fell.nbytes() == state.nbytes() <= 0.25 * 2 * H * T * d * 2
    assert torch.equal(fell.parts[1].inner.keys(), state.parts[1].inner.keys())
    assert "rotation='hadamard'" in fell.note and state.note == ""


def test_cover_beyond_the_budget_is_a_clear_error(tiny, ids):
    with pytest.raises(kvsum.KVSumError, match="cover"):
        kvsum.compress(tiny, ids, method="summary", budget=0.1, cover=TurboQuant(bits=2))
