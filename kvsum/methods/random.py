"""Uniform random keep per head: the floor any scoring method must beat."""

from dataclasses import dataclass

import torch

from .base import LayerInput, Method, register


@register
@dataclass
class Random(Method):
    name = "random"
    summary = "uniformly random entries per head (a floor for scoring methods)"
    seed: int = 0

    def compress(self, x: LayerInput):
        g = torch.Generator().manual_seed(self.seed * 100_003 + x.layer_idx)
        n = x.entries_per_head()
        idx = [torch.randperm(x.T, generator=g)[:n].sort().values.to(x.keys.device) for _ in range(x.H)]
        return x.keep(idx)
