"""Key norm: keys with a small L2 norm draw the most attention (Devoto et al., 2024); needs no queries at all."""

from dataclasses import dataclass

from ..base import LayerInput
from ..registry import register
from .scoring import Eviction


@register
@dataclass(frozen=True)
class KNorm(Eviction):
    """Keep the keys with the smallest L2 norm; reads no queries.

    Attributes:
        allocation: budget allocation over layers and heads: uniform, pyramid or adaptive (see Eviction).
    """

    name = "knorm"
    summary = "keep the keys with the smallest L2 norm (query-free)"

    def score(self, x: LayerInput):
        return -x.keys.float().norm(dim=-1)
