"""One softmax over several parts of a layer, joined from partial results (flash-decoding's combine), in PyTorch.

A partial is (max logit per query row (H, M), sum of exp(logit - max) (H, M), the values weighted by those
exponentials (H, M, d)): what a fused kernel (flash.py) returns for the coded tokens without writing any logit
to memory, and what `from_scores` computes for a part read through scores and mix (ragged anchors, the exact
entries and the full-precision tail). `join` rescales the parts to a common maximum and adds them, so the
joined softmax is the one over all parts' tokens at once. A part with no token has max NEG and sum 0.

A state's `online` returns stacked partials (a leading dim of chunks: a kernel's chunks as it wrote them) and
`Exact` entries; joint attention scores the exact entries with the tail in one product and joins every chunk in
one `combine_stacked`. On a GPU a decoding step is bound by the launches of its small operations, not by
arithmetic, so fewer operations is what makes it fast.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

NEG = -1.0e30


def from_scores(s: Tensor, mix) -> tuple[Tensor, Tensor, Tensor]:
    """The partial of logits s (H, M, N) (-inf where nothing is attended) whose weights `mix` (H, M, N) -> (H, M, d)
    turns into values, as a stack of one chunk (1, H, M) / (1, H, M, d)."""
    m = s.amax(-1).clamp_min(NEG) if s.shape[-1] else s.new_full(s.shape[:2], NEG)
    p = torch.exp(s - m[..., None])
    return m[None], p.sum(-1)[None], mix(p)[None]


@dataclass(frozen=True)
class Exact:
    """Entries a state holds exactly, (H, n, d) keys and values of any float dtype, no bias (sinks, windows): joint
    attention reads them with the tail."""

    keys: Tensor
    values: Tensor


def join(parts: list) -> tuple[Tensor, Tensor, Tensor]:
    """Stacked partials over disjoint tokens -> the partial over all of them."""
    return combine_stacked(*(torch.cat(ts) if len(ts) > 1 else ts[0] for ts in zip(*parts)))


def combine_stacked(m: Tensor, total: Tensor, acc: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Partials stacked on a first dim (S, H, M) / (S, H, M, d) (a kernel's chunks) -> one partial, in a few
    tensor operations whatever S."""
    top = m.amax(0)
    w = torch.exp(m - top)
    return top, (w * total).sum(0), (w[..., None] * acc).sum(0)


def output(part: tuple[Tensor, Tensor, Tensor]) -> Tensor:
    """The attention output (H, M, d) of a partial over every token; zeros for a row with nothing to attend."""
    _, total, acc = part
    return (acc / total[..., None]).nan_to_num_(0.0)
