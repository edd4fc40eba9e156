"""Expected attention: treat future queries as Gaussian and keep the keys they will attend to in expectation.

For q ~ N(mu, Sigma), E[exp(s q.k)] = exp(s k.mu + s^2/2 k^T Sigma k); normalized over keys per
query head (so heads are comparable under adaptive allocation) and weighted by |v|, since a key's
contribution to the output scales with its value.
"""

from dataclasses import dataclass

import torch

from ..base import LayerInput
from ..registry import register
from .scoring import Eviction


@register
@dataclass(frozen=True)
class ExpectedAttention(Eviction):
    """Keys scored by their expected attention under a Gaussian fit of the reference queries, times |v|.

    Attributes:
        allocation: budget allocation over layers and heads: uniform, pyramid or adaptive (see Eviction).
        sinks: first tokens always kept.
    """

    name = "expected_attention"
    summary = "keys scored by their attention under a Gaussian model of queries, times |v| (Devoto et al., 2025)"
    needs_queries = True
    sinks: int = 4

    def __post_init__(self):
        super().__post_init__()
        self.check_int("sinks")

    def expected(self, x: LayerInput, h: int):
        """(T,) expected attention of KV head h's keys, averaged over its query heads."""
        G = x.queries.shape[0] // x.H
        q = x.queries[h * G:(h + 1) * G].float()  # (G, n, d)
        mu = q.mean(dim=1)  # (G, d)
        centred = q - mu[:, None]
        sigma = centred.transpose(1, 2) @ centred / q.shape[1]  # (G, d, d)
        k = x.keys[h].float()  # (T, d)
        logits = x.scale * (mu @ k.T) + 0.5 * x.scale ** 2 * ((k @ sigma) * k).sum(-1)  # (G, T)
        return torch.softmax(logits, dim=-1).mean(dim=0)

    def score(self, x: LayerInput):
        expected = torch.stack([self.expected(x, h) for h in range(x.H)])
        return expected * x.values.float().norm(dim=-1)

    def protect(self, n: int):
        return self.sinks, 0
