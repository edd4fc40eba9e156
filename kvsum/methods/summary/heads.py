"""Retrieval heads in summary: sentences kept where a question will read them, the vote everywhere else.

A fact asked after compression is copied by a few KV heads (kvsum.retrieval scores them once per model); the
rest read what the continuation reads. With `retrieval_score` = s, the KV heads whose score is at least s (and the
top one, whatever its score) keep their anchors as summary scores them (whole sentences, with the configured share
by the vote), each with `retrieval_weight` times another head's bytes in its layer (the sentence that holds the
fact must be among the kept ones); every other head takes all its anchors by SnapKV's vote of the observation
window (sentences there too answer more long values, but cost the continuation what the retrieval heads gained
over SnapKV's selection as codes: docs/results/flagship.md). A threshold on the score, not a
share of the heads: a KV head counts where some query head of its group copies, so a model with larger query
groups (Qwen2.5's 7 to a KV head, SmolLM2's 3) has a larger share of such heads. Without scores (no tokenizer, or
a model whose window cannot hold the probe) it refuses.
"""

from __future__ import annotations

from torch import Tensor

from ...errors import KVSumError
from ...retrieval import PROBE_TOKENS
from .fit import split_by_weight


def masks(inputs, score: float) -> dict[int, Tensor] | None:
    """Per layer, (H,) True at the KV heads whose retrieval score is at least `score`, and at the top one of all
    layers'; None where `score` is 0. Without scores (no tokenizer, or a window too short for the probe) it
    refuses, so that summary by budget takes its next configuration."""
    if not score:
        return None
    if any(x.retrieval is None for x in inputs):
        raise KVSumError("retrieval_score needs each KV head's retrieval score, probed with the model's tokenizer "
                         "(kvsum.compress(..., tokenizer=tokenizer)); a model whose window is shorter than the probe "
                         f"({PROBE_TOKENS} tokens and its questions) has none")
    cut = min(score, max(float(x.retrieval.max()) for x in inputs))
    return {x.layer_idx: x.retrieval >= cut for x in inputs}


def head_bytes(left: int, H: int, diffuse: Tensor | None, retrieval: Tensor | None, weight: float) -> list[int]:
    """A layer's `left` bytes over its heads: by diffuseness (entropy allocation), else a retrieval head `weight`
    times another, else evenly."""
    if diffuse is not None:
        return split_by_weight(left, 0.5 + diffuse, 0, left)
    if retrieval is not None and 0 < int(retrieval.sum()) < H:
        return split_by_weight(left, 1.0 + (weight - 1.0) * retrieval.float(), 0, left)
    return [left // H] * H


def vote_shares(retrieval: Tensor | None, H: int, share: float) -> list[float]:
    """Each head's share of its anchors by the vote: `share` in a retrieval head (and in every head without
    retrieval heads), all of them in the rest."""
    if retrieval is None:
        return [share] * H
    return [share if r else 1.0 for r in retrieval.tolist()]
