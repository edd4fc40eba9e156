"""Key norm: keys with a small L2 norm draw the most attention (Devoto et al., 2024); needs no queries at all."""

from dataclasses import dataclass

from ..base import LayerInput, register
from .scoring import Eviction


@register
@dataclass
class KNorm(Eviction):
    name = "knorm"
    summary = "keep the keys with the smallest L2 norm (query-free)"

    def score(self, x: LayerInput):
        return -x.keys.float().norm(dim=-1)
