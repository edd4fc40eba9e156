"""kvsum/methods/base.py: the method protocol, property-based (hypothesis).

Every method, on any input it accepts, must hold its byte budget, keep a length per KV head, and give
finite attention outputs; an input it cannot serve must raise one KVSumError, never another exception.
Run with --hypothesis-show-statistics for the number of examples tried (benchmarks/results/robust/properties.txt).
"""

import math

import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st

import kvsum
from kvsum.attention import joint_attention
from kvsum.budget import full_nbytes
from kvsum.methods import LayerInput, make_method
from kvsum.prefill import reference_positions
from tests.helpers import (
    DTYPES,
    PROPERTY_METHODS,
    PROPERTY_SETTINGS,
    SLACK,
    refused,
)


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


@settings(PROPERTY_SETTINGS, max_examples=600)
@given(method=st.sampled_from(PROPERTY_METHODS), H=st.integers(1, 4), G=st.integers(1, 3), T=st.integers(1, 160),
       d=st.sampled_from([8, 16, 32]), budget=st.floats(0.02, 1.0), storage=st.sampled_from(DTYPES),
       seed=st.integers(0, 2**16), magnitude=st.sampled_from([0.01, 1.0, 40.0]), q_len=st.integers(1, 4),
       tail=st.integers(0, 5))
def test_layer_states_hold_budget_lengths_and_finite_outputs(method, H, G, T, d, budget, storage, seed, magnitude,
                                                            q_len, tail):
    x = _layer_input(H, G, T, d, budget, storage, seed, magnitude)
    try:
        state = make_method(method).compress(x)
    except kvsum.KVSumError as e:  # a clear refusal is allowed (e.g. no bit width fits the budget)
        return refused(e)
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
