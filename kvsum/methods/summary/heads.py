"""Retrieval heads in summary: sentences kept where a question will read them, the vote everywhere else.

A fact asked after compression is copied by a few KV heads (kvsum.retrieval scores them once per model); the
rest read what the continuation reads. With `retrieval_heads` = s, the top s of the model's KV heads by that
score keep their anchors as summary scores them (whole sentences, with the configured share by the vote), each
with `retrieval_weight` times another head's bytes in its layer (the sentence that holds the fact must be
among the kept ones); every other head takes all its anchors by SnapKV's vote of the observation window.
Without scores (no tokenizer, or a model whose window cannot hold the probe) it refuses.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ...errors import KVSumError
from ...retrieval import PROBE_TOKENS
from .fit import split_by_weight


def masks(inputs, share: float) -> dict[int, Tensor] | None:
    """Per layer, (H,) True at the KV heads among the top `share` of all layers' heads by retrieval score;
    None where `share` is 0. Without scores (no tokenizer, or a window too short for the probe) it refuses, so
    that summary by budget takes its next configuration."""
    if not share:
        return None
    if any(x.retrieval is None for x in inputs):
        raise KVSumError("retrieval_heads needs each KV head's retrieval score, probed with the model's tokenizer "
                         "(kvsum.compress(..., tokenizer=tokenizer)); a model whose window is shorter than the probe "
                         f"({PROBE_TOKENS} tokens and its questions) has none")
    flat = torch.cat([x.retrieval.flatten() for x in inputs])
    cut = flat.sort(descending=True).values[max(1, round(share * flat.numel())) - 1]
    return {x.layer_idx: x.retrieval >= cut for x in inputs}


def head_bytes(left: int, H: int, diffuse: Tensor | None, retrieval: Tensor | None, weight: float) -> list[int]:
    """A layer's `left` bytes over its heads: by diffuseness (entropy allocation), else a retrieval head `weight`
    times another, else evenly."""
    if diffuse is not None:
        return split_by_weight(left, 0.5 + diffuse, 0, left)
    if retrieval is not None and 0 < int(retrieval.sum()) < H:
        return split_by_weight(left, 1.0 + (weight - 1.0) * retrieval.float(), 0, left)
    return [left // H] * H


def voted(retrieval: Tensor | None, h: int) -> bool:
    """Head h takes every anchor by the vote: it is not among the retrieval heads."""
    return retrieval is not None and not bool(retrieval[h])
