"""SnapKV: the last prompt queries (the observation window) vote for the keys a question will need."""

from dataclasses import dataclass

from ..attention_stats import VOTE_KERNEL, VOTE_WINDOW, window_votes
from ..base import LayerInput
from ..registry import register
from .scoring import Eviction


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
    window: int = VOTE_WINDOW
    kernel: int = VOTE_KERNEL

    def __post_init__(self):
        super().__post_init__()
        self.check_int("window", 1)
        self.check_int("kernel", 1, odd=True)

    def score(self, x: LayerInput):
        return window_votes(x, self.window, self.kernel)

    def protect(self, n: int):
        return 0, self.window
