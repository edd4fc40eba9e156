"""kvsum/compress.py: arguments, batches (left padded), sliding-window layers, failures that leave the prefill
intact, every dtype (hypothesis)."""

import pytest
import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st

import kvsum
from kvsum.cache import KVSumSlidingLayer
from kvsum.calibrate import calibrate
from kvsum.state import BatchState
from tests.helpers import (
    ARTIFACT_METHODS,
    DTYPES,
    PROPERTY_METHODS,
    PROPERTY_SETTINGS,
    SLACK,
    batch_equals_alone,
    greedy,
    refused,
    tiny_gemma,
    tiny_llama,
)


class _FailOn:
    """A method that fails on one layer, after the others succeeded."""

    def __init__(self, layer):
        self.layer = layer

    def __call__(self):
        fail = self.layer

        class Boom(kvsum.Method):
            name = "boom"

            def compress(self, x, plan=None):
                if x.layer_idx == fail:
                    raise RuntimeError("boom")
                return x.keep([torch.arange(3)] * x.H)

        return Boom()


@pytest.fixture(scope="module")
def calibrated():
    model = tiny_llama()
    ids = torch.randint(0, 128, (1, 1600), generator=torch.Generator().manual_seed(7))
    return model, calibrate(model, ids=ids, tokens=1600, seq_len=400, progress=False)


@pytest.mark.parametrize("method", ["streaming_llm", "snapkv", "summary", "random", "turboquant"])
def test_left_padded_batch_equals_each_sequence_alone(method):
    model = tiny_llama()
    cache, held, alone = batch_equals_alone(model, method, [300, 231, 97])
    state = cache.layers[0].state
    assert isinstance(state, BatchState) and len(state) == 3
    assert held == alone  # ragged lengths held for real: no padding in the compressed batch
    lens = [s.lengths()[0] for s in state.states]
    assert lens[0] > lens[1] > lens[2]  # each sequence got its own budget


def test_left_padded_batch_full_method_and_eager():
    batch_equals_alone(tiny_llama("eager"), "full", [120, 64])
    batch_equals_alone(tiny_llama("sdpa"), "snapkv", [120, 70, 120])


def test_batch_without_padding_and_single_padded_row():
    model = tiny_llama()
    batch_equals_alone(model, "streaming_llm", [80, 80])
    batch_equals_alone(model, "streaming_llm", [80])  # B = 1, no padding: the plain path


@pytest.mark.parametrize("method", ["streaming_llm", "snapkv", "summary", "turboquant"])
def test_gemma_compresses_global_layers_only(method):
    model = tiny_gemma()
    ctx = torch.randint(0, 128, (1, 200), generator=torch.Generator().manual_seed(1))
    pre = kvsum.prefill(model, ctx)
    window_keys = [layer.keys.clone() for layer in pre.cache.layers if isinstance(layer, KVSumSlidingLayer)]
    cache = kvsum.compress(model, ctx, method=method, budget=0.25)
    sliding = [layer for layer in cache.layers if isinstance(layer, KVSumSlidingLayer)]
    assert len(sliding) == 4 and all(layer.state is None for layer in sliding)
    assert all(torch.equal(a, layer.keys) for a, layer in zip(window_keys, sliding))
    assert all(cache.layers[i].state is not None for i in (2, 5))
    # the budget governs the global layers; the windows are counted too
    assert cache.budget_nbytes() <= 0.27 * cache.budget_reference_nbytes
    assert cache.window_nbytes() == 4 * 2 * 31 * 32 * 4  # fp32 model: 31 tokens, K and V, 1 head, d = 32
    assert cache.nbytes() == cache.budget_nbytes() + cache.window_nbytes()
    assert cache.reference_nbytes == cache.budget_reference_nbytes + 4 * 2 * 31 * 32 * 2
    out = greedy(model, torch.cat([ctx, ctx[:, :5]], -1), cache, steps=40)
    assert out.shape == (1, 40) and cache.get_seq_length() == 200 + 5 + 39


@pytest.mark.parametrize("method", ["full", "streaming_llm", "summary"])
def test_gemma_left_padded_batch_equals_alone(method):
    batch_equals_alone(tiny_gemma(), method, [90, 40, 33], steps=30)


def test_failed_compression_leaves_gemma_prefill_intact():
    model = tiny_gemma()
    ctx = torch.randint(0, 128, (1, 100), generator=torch.Generator().manual_seed(1))
    pre = kvsum.prefill(model, ctx)
    before = [(type(layer), layer.keys.clone(), layer.get_seq_length()) for layer in pre.cache.layers]
    with pytest.raises(RuntimeError):
        kvsum.compress_prefill(pre, _FailOn(5)(), 0.25, consume=True)
    for (kind, keys, seen), layer in zip(before, pre.cache.layers):
        assert type(layer) is kind and torch.equal(keys, layer.keys) and layer.get_seq_length() == seen
    cache = kvsum.compress_prefill(pre, "streaming_llm", 0.25)  # still usable
    assert cache.get_seq_length() == 100


@settings(PROPERTY_SETTINGS, max_examples=300)
@given(method=st.sampled_from(PROPERTY_METHODS), dtype=st.sampled_from(DTYPES),
       heads=st.sampled_from([(2, 1), (4, 2), (4, 4)]),
       T=st.integers(2, 300), budget=st.sampled_from([1.0, 0.5, 0.25, 0.125, 0.05]), seed=st.integers(0, 2**16),
       gemma=st.booleans(), batch=st.booleans())
def test_models_in_every_dtype_compress_within_budget_and_stay_finite(method, dtype, heads, T, budget, seed, gemma,
                                                                     batch):
    model = tiny_gemma(dtype=dtype, window=32, seed=seed % 3) if gemma else \
        tiny_llama(dtype=dtype, heads=heads[0], kv_heads=heads[1], seed=seed % 3)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 128, (2 if batch else 1, T), generator=g)
    mask = None
    if batch:  # the second sequence is left padded
        mask = torch.ones_like(ids)
        mask[1, : int(torch.randint(0, T, (1,), generator=g))] = 0
    try:
        cache = kvsum.compress(model, ids, method=method, budget=budget, attention_mask=mask)
    except kvsum.KVSumError as e:
        return refused(e)
    event(f"compressed ({dtype}, {'gemma' if gemma else 'llama'}, batch {ids.shape[0]})")
    assert cache.get_seq_length() == T and cache.batch_size == ids.shape[0]
    assert cache.budget_nbytes() <= (budget + SLACK) * cache.budget_reference_nbytes
    assert all(len(layer.lengths()) == model.config.num_key_value_heads for layer in cache.layers)
    nxt = torch.randint(0, 128, (ids.shape[0], 3), generator=g)
    full_mask = None if mask is None else torch.cat([mask, torch.ones_like(nxt)], -1)
    with torch.no_grad():
        logits = model(nxt, past_key_values=cache, attention_mask=full_mask).logits
    assert logits.dtype == dtype and torch.isfinite(logits).all()


@pytest.mark.parametrize("method", sorted(ARTIFACT_METHODS))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("storage", DTYPES)
def test_artifact_methods_in_every_dtype(calibrated, method, dtype, storage):
    """Calibration runs in float32 whatever the model's dtype; storage follows the configured dtype."""
    model, art = calibrated
    model = model.to(dtype)
    try:
        ids = torch.randint(0, 128, (1, 200), generator=torch.Generator().manual_seed(2))
        cache = kvsum.compress(model, ids, method=method, budget=0.25, storage_dtype=storage, artifact=art)
        assert cache.budget_nbytes() <= (0.25 + SLACK) * cache.budget_reference_nbytes
        with torch.no_grad():
            logits = model(ids[:, :3], past_key_values=cache).logits
        assert logits.dtype == dtype and torch.isfinite(logits).all()
    finally:
        model.to(torch.float32)


@pytest.mark.parametrize("kwargs, match", [
    (dict(method="nope"), "unknown method 'nope'; accepted:"),
    (dict(budget=0.0), r"budget must be a fraction in \(0, 1\]"),
    (dict(budget=1.5), r"budget must be a fraction in \(0, 1\]"),
    (dict(budget="half"), r"budget must be a fraction"),
    (dict(method="streaming_llm", window=3), "has no knob window; accepted: sinks"),
    (dict(storage_dtype=torch.int8), "storage_dtype must be"),
])
def test_bad_arguments(tiny, ids, kwargs, match):
    with pytest.raises(kvsum.KVSumError, match=match):
        kvsum.compress(tiny, ids, **kwargs)


def test_a_spec_string_compresses_as_its_knobs_do(tiny, ids):
    """A configuration copied from a result table or the CLI: the same cache as the keywords give."""
    by_spec = kvsum.compress(tiny, ids, method="snapkv+turboquant:key_shift=1,bits=2.5", budget=0.25)
    by_knobs = kvsum.compress(tiny, ids, method="snapkv+turboquant", budget=0.25, key_shift=1, bits=2.5)
    assert by_spec.nbytes() == by_knobs.nbytes()
    q = ids[:, :4]
    with torch.no_grad():
        assert torch.equal(tiny(q, past_key_values=by_spec).logits, tiny(q, past_key_values=by_knobs).logits)


def test_failed_compression_leaves_prefill_intact(tiny, ids):
    pre = kvsum.prefill(tiny, ids)
    before = [layer.keys.clone() for layer in pre.cache.layers]

    class Boom(kvsum.Method):
        name = "boom"

        def compress(self, x, plan=None):
            if x.layer_idx == 1:
                raise RuntimeError("boom")
            return x.keep([torch.arange(3)] * x.H)

    with pytest.raises(RuntimeError):
        kvsum.compress_prefill(pre, Boom(), 0.25, consume=True)
    assert all(torch.equal(a, layer.keys) for a, layer in zip(before, pre.cache.layers))


def test_compress_prefill_checks_storage_too(tiny, ids):
    pre = kvsum.prefill(tiny, ids)
    from kvsum.methods import make_method

    with pytest.raises(kvsum.KVSumError, match="storage_dtype must be"):
        kvsum.compress_prefill(pre, make_method("streaming_llm"), 0.25, storage_dtype=torch.int8)
