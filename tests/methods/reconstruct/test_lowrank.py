"""kvsum/methods/reconstruct/lowrank.py: low-rank projection on calibrated bases."""

import pytest
import torch

import kvsum
from kvsum.methods.reconstruct.lowrank import split
from tests.helpers import cached_logits, compress_with_plan, random_ids, rebuild_errors


@pytest.mark.parametrize("knobs", [dict(), dict(space="post"), dict(share_layers=2, rank=128), dict(sinks=0)])
def test_lowrank_full_rank_reproduces_full_cache(tiny, tiny_art, ids, knobs):
    q = random_ids(7, 3)
    full = cached_logits(tiny, kvsum.compress(tiny, ids, method="full"), q)
    knobs = {"rank": 64, "key_share": 0.5, **knobs}  # keys and values: 2 heads x 16 channels each
    cache = compress_with_plan(tiny, ids, "lowrank", 1.0, torch.float32, layer_budget=2.0, artifact=tiny_art, **knobs)
    assert (cached_logits(tiny, cache, q) - full).abs().max() < 1e-4


def test_lowrank_error_decreases_with_rank(tiny, tiny_art, ids):
    errs = [rebuild_errors(tiny, ids, "lowrank", artifact=tiny_art, rank=r, key_share=0.5)
            for r in (4, 8, 16, 32, 48, 64)]
    for w in "kv":
        e = [x[w] for x in errs]
        assert all(a > b for a, b in zip(e, e[1:])), (w, e)
        assert e[-1] < 2e-3 < e[0]  # full rank: only the fp16 rounding of the coefficients


def test_split_keys_and_values():
    assert split(64, 0.25, 32) == (32, 32) and split(40, 0.25, 32) == (10, 30) and split(40, 0.0, 32) == (8, 32)
    assert split(10, 0.5, 32) == (5, 5) and split(0, 0.25, 32) == (0, 0)
