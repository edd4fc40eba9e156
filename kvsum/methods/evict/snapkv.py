"""SnapKV: the last prompt queries (the observation window) vote for the keys a question will need."""

from dataclasses import dataclass

import torch

from ..base import LayerInput
from ..registry import register
from .scoring import Eviction, group_attention, pool1d


@register
@dataclass(frozen=True)
class SnapKV(Eviction):
    """The observation window's queries vote for keys; votes pooled along positions, top-k per head.

    Attributes:
        allocation: budget allocation over layers and heads: uniform, pyramid or adaptive (see Eviction).
        window: observation window: its queries vote, its entries are always kept.
        kernel: width of the average pooling along positions, odd.
    """

    name = "snapkv"
    summary = "observation-window queries vote per key, pooled, top-k per head (Li et al., 2024)"
    needs_queries = True
    window: int = 64
    kernel: int = 5

    def __post_init__(self):
        super().__post_init__()
        self.check_int("window", 1)
        self.check_int("kernel", 1, odd=True)

    def score(self, x: LayerInput):
        rows = torch.nonzero(x.query_pos >= x.T - self.window).flatten()
        if rows.numel() == 0:
            rows = x.query_pos.argmax()[None]
        votes = torch.stack([group_attention(x, h, rows).mean(dim=(0, 1)) for h in range(x.H)])
        return pool1d(votes, self.kernel)

    def protect(self, n: int):
        return 0, self.window
