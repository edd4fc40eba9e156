"""TOVA: keep what the last prompt token attends to; that query sees the whole prompt and is the freshest."""

from dataclasses import dataclass

import torch

from ..attention_stats import group_attention
from ..base import LayerInput
from ..registry import register
from .scoring import Eviction


@register
@dataclass(frozen=True)
class TOVA(Eviction):
    """Keep what the last prompt token attends to (averaged over its query group), per KV head.

    Attributes:
        allocation: budget allocation over layers and heads: uniform, pyramid or adaptive (see Eviction).
    """

    name = "tova"
    summary = "attention of the last query, per KV head (Oren et al., 2024)"
    needs_queries = True

    def score(self, x: LayerInput):
        last = x.query_pos.argmax()[None]
        return torch.stack([group_attention(x, h, last).mean(dim=(0, 1)) for h in range(x.H)])
