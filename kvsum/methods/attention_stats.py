"""Reference-attention statistics shared by method families (quantizers and summaries read the same ones).

Everything here runs in float32 on one KV head at a time, whatever the model's dtype.
"""

from __future__ import annotations

import torch
from torch import Tensor


def group_queries(x, h: int, limit: int | None = None) -> tuple[Tensor, Tensor]:
    """Reference queries of KV head h (all query heads of its group stacked) and their positions,
    evenly thinned to at most `limit` rows."""
    G = x.queries.shape[0] // x.H
    q, pos = x.queries[h * G:(h + 1) * G].reshape(-1, x.d), x.query_pos.repeat(G)
    if limit is not None and q.shape[0] > limit:
        keep = torch.linspace(0, q.shape[0] - 1, limit).round().long().to(q.device)
        q, pos = q[keep], pos[keep]
    return q, pos


def causal_logits(q: Tensor, pos: Tensor, keys: Tensor, scale: float, key_pos: Tensor | None = None) -> Tensor:
    """(n, m) scaled logits; a query at position p sees keys at positions <= p only.

    `key_pos` gives the keys' positions (default 0..m-1)."""
    logits = (q * scale) @ keys.t()
    if key_pos is None:
        key_pos = torch.arange(keys.shape[0], device=keys.device)
    if bool((pos < key_pos.max()).any()):  # window queries see every key: skip the mask for them
        logits.masked_fill_(key_pos[None, :] > pos[:, None], float("-inf"))
    return logits


def normalized_entropy(p: Tensor, pos: Tensor) -> Tensor:
    """Entropy of each attention row over log(number of visible keys): 0 = one key, 1 = uniform."""
    ent = -(p * torch.log(p.clamp_min(1e-30))).sum(-1)
    return ent / torch.log((pos + 1).clamp_min(2).float())


def head_diffuseness(x, rows: int = 128) -> Tensor:
    """(H,) mean normalized entropy of each KV head's reference attention, over `rows` evenly spread
    reference rows (a mean needs few; this runs for every head of every layer)."""
    out = []
    for h in range(x.H):
        q, pos = group_queries(x, h, rows)
        p = torch.softmax(causal_logits(q, pos, x.keys[h], x.scale), -1)
        out.append(normalized_entropy(p, pos).mean())
    return torch.stack(out)
