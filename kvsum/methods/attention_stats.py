"""Reference-attention statistics shared by method families (quantizers and summaries read the same ones).

Everything here runs in float32 on one KV head at a time, whatever the model's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..errors import KVSumError

VOTE_WINDOW, VOTE_KERNEL = 64, 5  # SnapKV's observation window (last prompt queries) and pooling width


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


def group_attention(x, h: int, rows: Tensor | None = None) -> Tensor:
    """Causal softmax attention (G, m, T) of KV head h's query group (reference queries `rows`) over the prompt keys.

    Computed one KV head at a time in float32, so memory is G x n x T per call instead of Hq x n x T for the
    whole layer.
    """
    if x.queries is None or x.query_pos is None:
        raise KVSumError("this method needs the reference queries (LayerInput.queries)")
    G = x.queries.shape[0] // x.H
    q, pos = x.queries[h * G:(h + 1) * G].float(), x.query_pos
    # decoding-time eviction (kvsum.decoding) says per head which entries each query may see
    hidden = x.hidden[h] if getattr(x, "hidden", None) is not None else None
    if rows is not None:
        q, pos = q[:, rows], pos[rows]
        hidden = hidden[rows] if hidden is not None else None
    logits = q @ x.keys[h].float().T * x.scale
    if hidden is None:
        hidden = torch.arange(x.T, device=logits.device)[None, :] > pos.to(logits.device)[:, None]  # (m, T)
    # nan_to_num: a query that sees nothing (all it saw was evicted) votes for nothing
    return torch.softmax(logits.masked_fill_(hidden, float("-inf")), dim=-1).nan_to_num_(0.0)


def pool1d(scores: Tensor, kernel: int, mode: str = "avg", edges: bool = False) -> Tensor:
    """Same-length pooling of (H, T) scores along positions: neighbours of a selected key come along. `edges`:
    an average near either end is over the positions that exist (the padding does not count as zeros)."""
    if kernel == 1:
        return scores
    if mode == "avg":
        out = F.avg_pool1d(scores[:, None], kernel, stride=1, padding=kernel // 2, count_include_pad=not edges)
    else:
        out = F.max_pool1d(scores[:, None], kernel, stride=1, padding=kernel // 2)
    return out[:, 0, :scores.shape[-1]]  # an even kernel pads one position more than it pools away


def window_votes(x, window: int = VOTE_WINDOW, kernel: int = VOTE_KERNEL) -> Tensor:
    """(H, T) SnapKV's vote: the attention of the observation window (the last `window` prompt queries; the newest
    query where none is that late) per KV head, averaged over its query group and rows, pooled along positions."""
    rows = torch.nonzero(x.query_pos >= x.T - window).flatten()
    if rows.numel() == 0:
        rows = x.query_pos.argmax()[None]
    return pool1d(torch.stack([group_attention(x, h, rows).mean(dim=(0, 1)) for h in range(x.H)]), kernel)
