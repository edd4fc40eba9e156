"""`hae`: the published entropy-guided summarization (SRC pipeline), applied per KV head as a reference.

As published: importance = attention a token receives (column sum over the reference queries), entropy
= entropy of the token's own attention row, score = importance - 0.5 x entropy. The lowest-score tokens
go to a recycle bin; every `bin_size` binned tokens are replaced by `rank` synthetic tokens from the SVD
of W = pinv(Q) Y, where Y = softmax(s Q K_bin^T) V_bin over the reference queries:
k_j = u_j sqrt(sigma_j), v_j = v_j sqrt(sigma_j).

Adaptations a real model forces, kept minimal: only the captured reference queries have an attention
row, so tokens without one get the mean row entropy; attention is causal (a reference query only sees
keys at or before its position); synthetic tokens count against the same byte budget as kept tokens.
The known flaw stays: W is a linear map from queries to outputs, but the synthetic tokens are used as
softmax keys and values, which is not what was fitted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ...state import EntryState
from ..attention_stats import causal_logits, group_queries
from ..base import LayerInput, Method, Plan
from ..registry import register


@register
@dataclass(frozen=True)
class HAE(Method):
    """The published recycle-bin summarization, per KV head (see the module docstring).

    Attributes:
        bin_size: binned tokens replaced together (doubled until the synthetic tokens fit the budget).
        rank: synthetic tokens per bin (the top singular directions of pinv(Q) Y).
    """

    name = "hae"
    summary = "published entropy-guided summarization: recycle bin + SVD of pinv(Q) Y (reference)"
    needs_queries = True
    bin_size: int = 20
    rank: int = 2

    def compress(self, x: LayerInput, plan: Plan | None = None):
        n = x.entries_per_head()
        keys, values = [], []
        for h in range(x.H):
            k, v = self._head(x, h, n)
            keys.append(k)
            values.append(v)
        return EntryState(keys, values, dtype=x.storage)

    def _plan(self, T: int, n: int) -> tuple[int, int]:
        """(tokens kept, bin size) so that kept + rank x bins <= n."""
        m = self.bin_size
        if n < min(self.rank, T) or n >= T:  # no room for one bin's synthetic entries, or room for every token
            return min(n, T), 0
        while True:
            for kept in range(min(n, T), -1, -1):
                if kept + self.rank * math.ceil((T - kept) / m) <= n:
                    return kept, m
            m *= 2

    def _head(self, x: LayerInput, h: int, n: int):
        q, pos = group_queries(x, h)
        K, V = x.keys[h], x.values[h]
        logits = causal_logits(q, pos, K, x.scale)
        p = torch.softmax(logits, -1)
        importance = p.sum(0)
        row_entropy = -(p * torch.log(p.clamp_min(1e-30))).sum(-1)
        entropy = torch.full((x.T,), float(row_entropy.mean()), device=K.device)
        entropy[pos] = row_entropy  # the last query head of the group wins for a shared position
        score = importance - 0.5 * entropy
        kept, m = self._plan(x.T, n)
        order = torch.argsort(score, descending=True)
        keep_idx = order[:kept].sort().values
        binned = order[kept:].flip(0)  # lowest score enters the bin first
        syn_k, syn_v = [K[keep_idx]], [V[keep_idx]]
        pinv = torch.linalg.pinv(q)  # (d, nq), shared by every bin of this head
        for a in range(0, len(binned) if m else 0, m or 1):
            idx = binned[a:a + m]
            y = torch.softmax(logits[:, idx], -1).nan_to_num(0.0) @ V[idx]  # rows that see no bin token: 0
            u, s, vh = torch.linalg.svd(pinv @ y)
            r = min(self.rank, s.numel())
            root = s[:r].sqrt()
            syn_k.append(u[:, :r].t() * root[:, None])
            syn_v.append(vh[:r] * root[:, None])
        return torch.cat(syn_k), torch.cat(syn_v)
