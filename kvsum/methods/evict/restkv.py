"""ReST-KV: score a pair by how much removing it would change the layer's attention output.

Removing entry i from a softmax renormalizes the rest: o' = (o - a_i v_i) / (1 - a_i), so the
output moves by |o - o'| = a_i |v_i - o| / (1 - a_i). A heavily attended entry whose value equals
the output costs nothing to drop, while raw attention would keep it. Per-query errors are summed over
the query group, smoothed in time (exponential moving average over the reference queries in prompt
order, newest weighted most) and in space (each score lifted halfway to the max of its neighbourhood,
so neighbours of an important entry come along while isolated peaks stay sharp), then top-k per head.
"""

from dataclasses import dataclass

import torch

from ..attention_stats import group_attention, pool1d
from ..base import LayerInput
from ..registry import register
from .scoring import Eviction, time_order


@register
@dataclass(frozen=True)
class ReSTKV(Eviction):
    """Keep the pairs whose removal would change the attention output most, smoothed in time and space.

    Attributes:
        allocation: budget allocation over layers and heads: uniform, pyramid or adaptive (see Eviction).
        window: most recent entries always kept.
        ema: weight of the past in the moving average over query steps, in [0, 1).
        pool: neighbourhood of the spatial smoothing, odd (1 disables it).
    """

    name = "restkv"
    summary = "output error caused by removing each pair, smoothed in time and space (An et al., 2026)"
    needs_queries = True
    window: int = 64
    ema: float = 0.98
    pool: int = 5

    def __post_init__(self):
        super().__post_init__()
        self.check_int("window")
        self.check_fraction("ema", high_open=True)
        self.check_int("pool", 1, odd=True)

    def removal_error(self, x: LayerInput, h: int):
        """(n, T): output change of each reference query when each entry is removed, summed over the group."""
        a = group_attention(x, h)  # (G, n, T)
        v = x.values[h].float()
        o = a @ v  # (G, n, d)
        dist = (o @ v.T).mul_(-2).add_((v * v).sum(-1)).add_((o * o).sum(-1, keepdim=True)).clamp_(min=0).sqrt_()
        err = dist.mul_(a).div_((1 - a).clamp_(min=1e-6))  # |v_i - o| a_i / (1 - a_i), in place: (G, n, T) each
        return err.sum(0)

    def score(self, x: LayerInput):
        age = (len(x.query_pos) - 1 - time_order(x)).float().to(x.keys.device)
        w = self.ema ** age
        w = w / w.sum()
        scores = torch.stack([w @ self.removal_error(x, h) for h in range(x.H)])
        return 0.5 * (scores + pool1d(scores, self.pool, "max"))

    def protect(self, n: int):
        return 0, self.window
