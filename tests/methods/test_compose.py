"""Composition "method+quantizer": one budget over the quantized entries, knob routing, exact attention."""

import math

import pytest
import torch

import kvsum
from kvsum.methods import LayerInput, make_method
from kvsum.state import EntryState
from tests.helpers import SERVED, tiny_llama


@pytest.mark.parametrize("name,budget,knobs", [("summary+turboquant", 0.125, {}), ("summary+turboquant", 0.0625, {}),
                                               ("snapkv+turboquant", 0.125, dict(bits=2.5)),
                                               ("snapkv+kivi", 0.25, dict(kivi_residual=32)),
                                               ("h2o+turboquant", 0.0625, dict(bits=2, qjl=True))])
def test_budget_covers_the_quantized_total_and_generation_works(name, budget, knobs):
    model = tiny_llama()
    ids = torch.randint(0, 128, (1, 520), generator=torch.Generator().manual_seed(2))
    ctx = ids[:, :500]
    cache = kvsum.compress(model, ctx, method=name, budget=budget, **knobs)
    assert cache.method == name
    assert (budget - 0.02) * cache.reference_nbytes <= cache.nbytes() <= (budget + 0.02) * cache.reference_nbytes
    first = name.split("+")[0]  # alone, as configured in the composition (summary: not by budget)
    alone = kvsum.compress(model, ctx, method=first, budget=budget, **make_method(first).composed_defaults)
    assert sum(cache.layers[0].lengths()) > 2 * sum(alone.layers[0].lengths())  # quantized entries are cheaper
    out = model.generate(ids[:, :510], cache=cache, max_new_tokens=50, min_new_tokens=50, do_sample=False)
    assert out.shape == (1, 560) and cache.get_seq_length() == 559
    q = make_method(name, **knobs).quant
    assert cache.layers[0].tail_length() <= q.residual + q.group  # decoded tokens were quantized too


def test_ragged_composed_state_attends_exactly_over_its_dequantized_entries():
    g = torch.Generator().manual_seed(0)
    H, d, lengths = 3, 16, [40, 7, 25]
    kept = EntryState([torch.randn(n, d, generator=g) for n in lengths],
                      [torch.randn(n, d, generator=g) for n in lengths], [torch.randn(n, generator=g) for n in lengths])
    x = LayerInput(torch.zeros(H, 100, d), torch.zeros(H, 100, d), None, None, 0.25, 0, 1, 1.0, torch.float16)
    for name in ("summary+turboquant", "summary+kivi"):
        state = make_method(name, bits=4, **({"residual": 8} if "kivi" in name else {})).quantize(kept, x)
        assert state.lengths() == lengths
        inner = state.inner
        ref = EntryState(list(inner.keys()[0].split(lengths)), list(inner.values()[0].split(lengths)),
                         list(kept.bias.float().split(lengths)), dtype=torch.float32)
        q = torch.randn(1, H, 5, d, generator=g)
        s, s_ref = state.scores(q, 0.25), ref.scores(q, 0.25)  # layouts may differ: compare what attention uses
        torch.testing.assert_close(s.logsumexp(-1), s_ref.logsumexp(-1), atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(state.mix(s.softmax(-1)), ref.mix(s_ref.softmax(-1)), atol=1e-4, rtol=1e-4)
        assert (torch.isfinite(s).sum(-1) == torch.tensor(lengths).view(1, H, 1)).all()  # each head sees its own
        if name == "summary+turboquant" and SERVED:  # the kernel reads each head's run: (1, H, M, longest run)
            assert s.shape == (1, H, 5, max(lengths))
        assert state.nbytes() == inner.nbytes() + 2 * sum(lengths) + sum(lengths)  # fp16 bias, int8 head index


def test_knobs_are_routed_by_owner_or_prefix():
    m = make_method("snapkv+kivi", bits=4, kernel=3, snapkv_window=16, kivi_residual=0)
    assert (m.first.kernel, m.first.window, m.quant.bits, m.quant.residual, m.bits) == (3, 16, 4, 0, 4)
    assert make_method("summary+turboquant").bits == 3  # the default width of a composition
    with pytest.raises(kvsum.KVSumError, match="belongs to both methods; write random_seed or turboquant_seed"):
        make_method("random+turboquant", seed=3)
    m = make_method("random+turboquant", random_seed=3, turboquant_seed=5)
    assert (m.first.seed, m.quant.seed) == (3, 5)
    with pytest.raises(kvsum.KVSumError, match="has no knob 'nope'"):
        make_method("summary+turboquant", nope=1)
    with pytest.raises(kvsum.KVSumError, match="second method must be a quantizer"):
        make_method("turboquant+snapkv")
    with pytest.raises(kvsum.KVSumError, match="unknown method 'snap'"):
        make_method("snap+kivi")
    with pytest.raises(kvsum.KVSumError, match="not supported"):
        make_method("snapkv+kivi", bits=3)


def test_the_quantizers_exact_tokens_are_refused_in_a_composition():
    for name, knobs in (("snapkv+turboquant", dict(sinks=4)), ("summary+turboquant", dict(turboquant_window=8)),
                        ("summary+kivi", dict(kivi_sinks=4))):
        with pytest.raises(kvsum.KVSumError, match="do not apply in a composition: .* decides what stays exact"):
            make_method(name, **knobs)


def test_key_shift_in_a_composition_moves_key_bits_between_layers_in_the_same_bytes():
    model = tiny_llama(layers=4)
    ctx = torch.randint(0, 128, (1, 500), generator=torch.Generator().manual_seed(3))
    caches = {k: kvsum.compress(model, ctx, method="snapkv+turboquant", budget=0.125, **knobs)
              for k, knobs in (("off", {}), ("on", dict(key_shift=1)))}
    widths = {k: [layer.state.inner.widths[0] for layer in c.layers] for k, c in caches.items()}
    assert widths["off"] == [3.5] * 4  # off by default: 3 bits, keys +0.5
    assert sorted(widths["on"]) == [2.5, 2.5, 4.5, 4.5]  # the sharpest half +1, the most diffuse half -1
    on, off = caches["on"], caches["off"]
    assert abs(on.nbytes() - off.nbytes()) <= 0.02 * off.reference_nbytes
    for a, b in zip(on.layers, off.layers):  # each layer's bytes follow its entries' cost: about as many entries
        assert abs(a.state.lengths()[0] - b.state.lengths()[0]) <= 0.1 * b.state.lengths()[0]


def test_the_sinks_summary_keeps_stay_exact_beside_the_codes(monkeypatch):
    """summary+turboquant stores summary's sinks (the first prompt tokens) at the storage dtype, outside the codes;
    snapkv (no sinks knob) has everything coded."""
    from kvsum.methods.compose import ComposedState
    from kvsum.state import ConcatState
    model, ids = tiny_llama(), torch.randint(0, 128, (1, 500), generator=torch.Generator().manual_seed(3))
    pre = kvsum.prefill(model, ids, surprisal=True)
    keys = pre.cache.layers[0].keys[0].clone()
    method, calls = make_method("summary+turboquant", summary_sinks=3), []
    first = type(method.first).compress
    monkeypatch.setattr(type(method.first), "compress", lambda self, x, plan=None: calls.append(1) or first(self, x,
                                                                                                            plan))
    cache = kvsum.compress_prefill(pre, method, 0.125)
    n_layers = len(cache.layers)
    assert len(calls) <= n_layers + 1  # the sinks' exact bytes are in the first method's target: no second pass
    state = cache.layers[0].state
    assert isinstance(state, ConcatState) and isinstance(state.parts[-1], ComposedState)
    exact = state.parts[0]
    assert exact.lengths() == [3] * keys.shape[0]
    assert torch.equal(exact.keys.view(keys.shape[0], 3, -1), keys[:, :3].half())
    assert cache.nbytes() <= 0.125 * cache.reference_nbytes * 1.01
    assert cache.layers[0].stream is not None  # decoded tokens are still coded
    plain = kvsum.compress(model, ids, method="snapkv+turboquant", budget=0.125)
    assert isinstance(plain.layers[0].state, ComposedState)


def test_the_newest_tokens_stay_exact_beside_the_codes_with_recent_exact():
    """summary's `recent_exact` newest prompt tokens join the sinks outside the codes, in the same bytes."""
    model, ids = tiny_llama(), torch.randint(0, 128, (1, 500), generator=torch.Generator().manual_seed(3))
    pre = kvsum.prefill(model, ids, surprisal=True)
    caches = {r: kvsum.compress_prefill(pre, make_method("summary+turboquant", summary_recent_exact=r), 0.125)
              for r in (0, 8)}
    for i, (layer, before) in enumerate(zip(caches[8].layers, caches[0].layers)):
        keys = pre.cache.layers[i].keys[0]
        exact = layer.state.parts[0]
        assert exact.lengths() == [4 + 8] * keys.shape[0]
        want = torch.cat([keys[:, :4], keys[:, -8:]], 1).half()
        assert torch.equal(exact.keys.view(keys.shape[0], 12, -1), want)
        # the exact tokens cost ~4.5 coded entries each: fewer coded entries, the same bytes
        assert layer.state.parts[-1].lengths()[0] < before.state.parts[-1].lengths()[0]
    assert caches[8].nbytes() <= 0.125 * caches[8].reference_nbytes * 1.01
    with pytest.raises(kvsum.KVSumError, match="recent_exact must be in"):
        make_method("summary+turboquant", summary_recent_exact=40)


def test_the_refusal_names_what_one_plain_entry_per_head_needs_and_that_budget_compresses():
    """SnapKV's entries carry no bias: the smallest budget is one entry per head of the lighter (Hadamard) codes,
    with no bias counted, and it compresses (the lighter codes chosen by the same count)."""
    model = tiny_llama()
    ids = torch.randint(0, 128, (1, 200), generator=torch.Generator().manual_seed(2))
    H, d = model.config.num_key_value_heads, model.config.hidden_size // model.config.num_attention_heads
    one = make_method("turboquant").lighter(d).nbytes(H, 1, d, 3.0)
    least = math.ceil(1000 * one / (2 * H * 200 * d * 2)) / 1000
    with pytest.raises(kvsum.KVSumError, match=f"the smallest budget that fits: {least:.3f}$"):
        kvsum.compress(model, ids, method="snapkv+turboquant", budget=least - 0.002)
    cache = kvsum.compress(model, ids, method="snapkv+turboquant", budget=least)
    assert cache.nbytes() <= least * cache.reference_nbytes and min(cache.layers[0].lengths()) >= 1
