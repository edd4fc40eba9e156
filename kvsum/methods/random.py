"""Uniform random keep per head: the floor any scoring method must beat."""

from dataclasses import dataclass

import torch

from ..state import LayerState
from .base import LayerInput, Method, Plan
from .registry import register


@register
@dataclass(frozen=True)
class Random(Method):
    """Keep uniformly random entries of each head, as many as the budget allows.

    Attributes:
        seed: seeds the draw (with the layer index), so a prompt always keeps the same entries.
    """

    name = "random"
    summary = "uniformly random entries per head (a floor for scoring methods)"
    seed: int = 0

    def compress(self, x: LayerInput, plan: Plan | None = None) -> LayerState:
        g = torch.Generator().manual_seed(self.seed * 100_003 + x.layer_idx)
        n = x.entries_per_head()
        idx = [torch.randperm(x.T, generator=g)[:n].sort().values.to(x.keys.device) for _ in range(x.H)]
        return x.keep(idx)
