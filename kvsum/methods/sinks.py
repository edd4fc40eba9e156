"""The prompt tokens a composition keeps exact beside its codes: the attention sinks and the newest tokens.

The first prompt tokens draw most of the attention mass and their keys are unlike every other token's: coded
with the rest they skew the codes' channel split and mean key (docs/results/summary.md). The newest tokens are
what the next tokens read hardest: coded at 2-3 bits they cost the first generated tokens most of their error
(docs/results/flagship.md). So a composition stores the sinks and newest tokens its first method keeps (its
`sinks` and `recent_exact` knobs: summary's) at the storage dtype, outside the codes.
"""

from __future__ import annotations

import torch

from ..state import EntryState


def split_exact(kept: EntryState, keys: torch.Tensor, values: torch.Tensor, sinks: int, recent: int = 0):
    """(the kept entries that are the first `sinks` or the last `recent` prompt tokens, as an exact EntryState, or
    None; the others). An entry is one of them where its key and value are exactly that token's (kept entries are
    the prompt's own at the storage dtype; fitted summaries never are)."""
    T = keys.shape[1]
    idx = torch.cat([torch.arange(min(sinks, T)), torch.arange(max(sinks, T - recent), T)]).to(keys.device)
    if not len(idx) or kept.keys.shape[0] == 0:
        return None, kept
    dt = kept.keys.dtype
    sk, sv = keys[:, idx].to(dt), values[:, idx].to(dt)  # (H, n, d)
    parts = [t.split(kept.lengths()) for t in (kept.keys, kept.values)]
    bias = kept.bias.split(kept.lengths()) if kept.bias is not None else None
    ex_k, ex_v, rk, rv, rb = [], [], [], [], []
    for h, (k, v) in enumerate(zip(*parts)):
        hit = ((k[:, None] == sk[h][None]).all(-1) & (v[:, None] == sv[h][None]).all(-1)).any(-1)
        ex_k.append(k[hit])
        ex_v.append(v[hit])
        rk.append(k[~hit])
        rv.append(v[~hit])
        if bias is not None:
            rb.append(bias[h][~hit])
    if not sum(len(k) for k in ex_k):
        return None, kept
    return EntryState(ex_k, ex_v, dtype=dt), EntryState(rk, rv, rb if bias is not None else None, dtype=dt)
