"""H2O: heavy hitters (most attention received, accumulated over the prompt's queries) plus the recent tokens."""

from dataclasses import dataclass

import torch

from ..attention_stats import group_attention
from ..base import LayerInput
from ..registry import register
from .scoring import Eviction


@register
@dataclass(frozen=True)
class H2O(Eviction):
    """Heavy hitters (most attention received from the reference queries) plus the most recent tokens.

    Attributes:
        allocation: budget allocation over layers and heads: uniform, pyramid or adaptive (see Eviction).
        recent: fraction of each head's entries given to the most recent tokens.
    """

    name = "h2o"
    summary = "accumulated attention (heavy hitters) + recent window (Zhang et al., 2023)"
    needs_queries = True
    recent: float = 0.5

    def __post_init__(self):
        super().__post_init__()
        self.check_fraction("recent")

    def score(self, x: LayerInput):
        return torch.stack([group_attention(x, h).sum(dim=(0, 1)) for h in range(x.H)])

    def protect(self, n: int):
        return 0, round(self.recent * n)
