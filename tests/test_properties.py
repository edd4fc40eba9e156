"""Property-based tests (hypothesis) over shapes, budgets, head counts, dtypes and seeds.

Every method, on any input it accepts, must hold its byte budget, keep a length per KV head, and give
finite attention outputs; an input it cannot serve must raise one KVSumError, never another exception.
Run with --hypothesis-show-statistics for the number of examples tried (benchmarks/results/properties.txt).
"""

import math

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import kvsum
from kvsum.attention import joint_attention
from kvsum.budget import full_nbytes
from kvsum.calibrate import calibrate
from kvsum.compress import reference_positions
from kvsum.methods.base import LayerInput, make_method

from .conftest import tiny_llama
from .test_robust import tiny_gemma

ARTIFACT = {"echokv", "lowrank"}  # need a calibration artifact of the model: tested on a fixed tiny model below
METHODS = sorted(set(kvsum.methods()) - ARTIFACT - {"full"})
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SLACK = 0.02  # the documented tolerance: bytes <= (budget + 0.02) x full

common = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def _refused(e: kvsum.KVSumError) -> None:
    assert str(e) and "\n" not in str(e)
    event(f"refused: {str(e).split(':')[0][:30]}")


def _layer_input(H, G, T, d, budget, storage, seed, magnitude) -> LayerInput:
    g = torch.Generator().manual_seed(seed)
    pos = reference_positions(T, 16, 32)
    keys = torch.randn(H, T, d, generator=g) * magnitude
    surprisal = torch.rand(T, generator=g) * 8
    surprisal[0] = math.inf
    return LayerInput(keys=keys, values=torch.randn(H, T, d, generator=g) * magnitude,
                      queries=torch.randn(H * G, len(pos), d, generator=g) * magnitude, query_pos=pos,
                      scale=d ** -0.5, layer_idx=0, n_layers=1, budget_bytes=budget * full_nbytes(1, H, d, T),
                      storage=storage, surprisal=surprisal)


@settings(common, max_examples=600)
@given(method=st.sampled_from(METHODS), H=st.integers(1, 4), G=st.integers(1, 3), T=st.integers(1, 160),
       d=st.sampled_from([8, 16, 32]), budget=st.floats(0.02, 1.0), storage=st.sampled_from(DTYPES),
       seed=st.integers(0, 2**16), magnitude=st.sampled_from([0.01, 1.0, 40.0]), q_len=st.integers(1, 4),
       tail=st.integers(0, 5))
def test_layer_states_hold_budget_lengths_and_finite_outputs(method, H, G, T, d, budget, storage, seed, magnitude,
                                                            q_len, tail):
    x = _layer_input(H, G, T, d, budget, storage, seed, magnitude)
    try:
        state = make_method(method).compress(x)
    except kvsum.KVSumError as e:  # a clear refusal is allowed (e.g. no bit width fits the budget)
        return _refused(e)
    event(f"compressed ({x.storage})")
    full = full_nbytes(1, H, d, T)
    assert state.nbytes() <= x.budget_bytes + SLACK * full, (state.nbytes() / full, budget)
    lengths = state.lengths()
    assert len(lengths) == H and all(isinstance(n, int) and n >= 0 for n in lengths)
    g = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(1, H * G, q_len, d, generator=g) * magnitude
    k, v = (torch.randn(1, H, tail + q_len, d, generator=g) for _ in range(2))
    out = joint_attention(state, q, k, v, None, d ** -0.5)
    assert out.shape == (1, q_len, H * G, d) and torch.isfinite(out).all()


@settings(common, max_examples=300)
@given(method=st.sampled_from(METHODS), dtype=st.sampled_from(DTYPES), heads=st.sampled_from([(2, 1), (4, 2), (4, 4)]),
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
        return _refused(e)
    event(f"compressed ({dtype}, {'gemma' if gemma else 'llama'}, batch {ids.shape[0]})")
    assert cache.get_seq_length() == T and cache.batch_size == ids.shape[0]
    assert cache.budget_nbytes() <= (budget + SLACK) * cache.budget_reference_nbytes
    assert all(len(layer.lengths()) == model.config.num_key_value_heads for layer in cache.layers)
    nxt = torch.randint(0, 128, (ids.shape[0], 3), generator=g)
    full_mask = None if mask is None else torch.cat([mask, torch.ones_like(nxt)], -1)
    with torch.no_grad():
        logits = model(nxt, past_key_values=cache, attention_mask=full_mask).logits
    assert logits.dtype == dtype and torch.isfinite(logits).all()


@pytest.fixture(scope="module")
def calibrated():
    model = tiny_llama()
    ids = torch.randint(0, 128, (1, 1600), generator=torch.Generator().manual_seed(7))
    return model, calibrate(model, ids=ids, tokens=1600, seq_len=400, progress=False)


@pytest.mark.parametrize("method", sorted(ARTIFACT))
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
