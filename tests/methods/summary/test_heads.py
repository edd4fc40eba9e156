"""kvsum/methods/summary/heads.py: retrieval heads keep the sentences, the others the vote, with their bytes."""

import dataclasses

import pytest
import torch

from kvsum.errors import KVSumError
from kvsum.methods import make_method
from kvsum.methods.attention_stats import window_votes
from kvsum.methods.summary import heads, scores
from tests.helpers import reference_layer


def _layer(scores, seed=0, budget=0.25):
    x = reference_layer(seed=seed, H=len(scores), budget=budget)
    return dataclasses.replace(x, retrieval=torch.tensor(scores))


def test_masks_take_the_heads_scoring_at_least_the_threshold_and_the_top_one():
    a, b = _layer([0.9, 0.1, 0.0]), dataclasses.replace(_layer([0.5, 0.2, 0.05]), layer_idx=1)
    m = heads.masks([a, b], 0.2)
    assert m[0].tolist() == [True, False, False] and m[1].tolist() == [True, True, False]
    m = heads.masks([a, b], 0.95)  # none scores that much: the top head of all layers' alone
    assert m[0].tolist() == [True, False, False] and m[1].tolist() == [False, False, False]
    assert heads.masks([a, b], 0.0) is None
    with pytest.raises(KVSumError, match="tokenizer"):  # a layer without scores: summary by budget moves on
        heads.masks([a, dataclasses.replace(b, retrieval=None)], 0.5)


def test_head_bytes_weigh_retrieval_heads_and_sum_within_the_layer():
    got = heads.head_bytes(9000, 3, None, torch.tensor([True, False, False]), 2.0)
    assert got == [4500, 2250, 2250]
    assert heads.head_bytes(9000, 3, None, torch.tensor([True, True, True]), 2.0) == [3000] * 3
    assert heads.head_bytes(9000, 3, None, None, 2.0) == [3000] * 3


def test_other_heads_keep_what_the_vote_ranks_first_and_retrieval_heads_get_their_bytes():
    x = _layer([1.0, 0.0], budget=0.2)
    m = make_method("summary", retrieval_score=0.5, entropy_allocation=False, anchor_share=1.0, score="surprisal",
                    window=8, sinks=2)
    state = m.compress(x, m.plan([x], 0.2))
    n0, n1 = state.lengths()
    assert n0 == pytest.approx(2 * n1, abs=2)  # the retrieval head holds twice the other's entries
    kept1 = state.keys[n0:n0 + n1].float()
    forced = set(range(2)) | set(range(x.T - 8, x.T))
    votes = window_votes(x)[1].clone()
    votes[list(forced)] = float("inf")
    want = set(torch.argsort(votes, descending=True)[:n1].tolist())
    got = {int((x.keys[1] - k).norm(dim=-1).argmin()) for k in kept1}
    assert got == want
    plain = make_method("summary", entropy_allocation=False, anchor_share=1.0, score="surprisal", window=8, sinks=2)
    info = scores.information(x, "surprisal", plain.span)
    (k0, _), _, _ = plain._head(x, 0, n0 * x.entry_bytes(), info)  # summary's own ranking, at the head's bytes
    assert torch.equal(state.keys[:n0].float(), k0)  # the retrieval head keeps what summary scores first


def test_retrieval_score_needs_the_same_share_per_head_and_a_valid_score():
    with pytest.raises(KVSumError, match="entropy_allocation=False"):
        make_method("summary", retrieval_score=0.1)
    with pytest.raises(KVSumError, match="retrieval_score"):
        make_method("summary", retrieval_score=1.5, entropy_allocation=False)
    assert make_method("summary", retrieval_score=0.1, entropy_allocation=False).prefill_options()["retrieval"]

