"""One softmax over several parts of a layer, joined from partial results (flash-decoding's combine), in PyTorch.

A partial is (max logit per query row (H, M), sum of exp(logit - max) (H, M), the values weighted by those
exponentials (H, M, d)): what a fused kernel (flash.py) returns for the coded tokens without writing any logit
to memory, and what `from_scores` computes for a part read through scores and mix (exact sinks and windows,
ragged anchors, the full-precision tail). `combine` rescales the parts to a common maximum and adds them, so the
joined softmax is the one over all parts' tokens at once. A part with no token has max NEG and sum 0.
"""

from __future__ import annotations

import torch
from torch import Tensor

NEG = -1.0e30


def from_scores(s: Tensor, mix) -> tuple[Tensor, Tensor, Tensor]:
    """The partial of logits s (H, M, N) (-inf where nothing is attended) whose weights `mix` (H, M, N) -> (H, M, d)
    turns into values."""
    m = s.amax(-1).clamp_min(NEG) if s.shape[-1] else s.new_full(s.shape[:2], NEG)
    p = torch.exp(s - m[..., None])
    return m, p.sum(-1), mix(p)


def combine(parts: list) -> tuple[Tensor, Tensor, Tensor]:
    """Partials over disjoint tokens -> the partial over all of them."""
    if len(parts) == 1:
        return parts[0]
    top = torch.stack([m for m, _, _ in parts]).amax(0)
    w = [torch.exp(m - top) for m, _, _ in parts]
    total = sum(wi * t for wi, (_, t, _) in zip(w, parts))
    return top, total, sum(wi[..., None] * a for wi, (_, _, a) in zip(w, parts))


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
