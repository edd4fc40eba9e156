"""kvsum/methods/streaming_llm.py: attention sinks plus the recent window."""

import torch

import kvsum
from kvsum.methods import make_method


def test_streaming_llm_keeps_sinks_and_window(tiny, ids):
    pre = kvsum.prefill(tiny, ids)
    cache = kvsum.compress_prefill(pre, make_method("streaming_llm", sinks=4), 0.25)
    state = cache.layers[0].state
    n = state.lengths()[0]
    full_k = pre.cache.layers[0].keys[0, 0]
    kept = state.keys[:n].float()
    torch.testing.assert_close(kept[:4], full_k[:4].half().float())
    torch.testing.assert_close(kept[4:], full_k[-(n - 4):].half().float())
