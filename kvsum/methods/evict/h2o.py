"""H2O: heavy hitters (most attention received, accumulated over the prompt's queries) plus the recent tokens."""

from dataclasses import dataclass

import torch

from ..base import LayerInput, register
from .scoring import Eviction, group_attention


@register
@dataclass
class H2O(Eviction):
    name = "h2o"
    summary = "accumulated attention (heavy hitters) + recent window (Zhang et al., 2023)"
    needs_queries = True
    recent: float = 0.5  # fraction of each head's entries given to the most recent tokens

    def __post_init__(self):
        super().__post_init__()
        self.check_fraction("recent")

    def score(self, x: LayerInput):
        return torch.stack([group_attention(x, h).sum(dim=(0, 1)) for h in range(x.H)])

    def protect(self, n: int):
        return 0, round(self.recent * n)
