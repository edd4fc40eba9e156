"""Budget allocation and top-k selection, shared by every eviction scorer.

- uniform: every head of every layer keeps `entries_per_head()` entries.
- pyramid (PyramidKV): lower layers attend broadly and upper layers sharply, so layer budgets
  decrease linearly with depth; the mean over layers stays the requested budget.
- adaptive (AdaKV): within a layer, heads compete in one top-k over all their scores, each head
  keeping at least a floor; the ragged lengths are stored packed, paying one head index per entry.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

ALLOCATIONS = ("uniform", "pyramid", "adaptive")
PYRAMID_TOP = 0.5  # the last layer's budget relative to the mean; the first layer gets 2 - PYRAMID_TOP
ADAPTIVE_FLOOR = 0.2  # fraction of the uniform share that every head keeps under adaptive allocation


def pyramid_budgets(n_layers: int, budget: float, top: float = PYRAMID_TOP) -> list[float]:
    """Linearly decreasing layer fractions with mean `budget`, none above 1 (the excess goes to uncapped layers)."""
    if n_layers == 1:
        return [budget]
    w = [2 - top - 2 * (1 - top) * i / (n_layers - 1) for i in range(n_layers)]
    f = [budget * wi for wi in w]
    while True:
        over = sum(max(0.0, fi - 1) for fi in f)
        f = [min(fi, 1.0) for fi in f]
        free = [i for i, fi in enumerate(f) if fi < 1]
        if over <= 1e-12 or not free:
            return f
        total = sum(w[i] for i in free)
        for i in free:
            f[i] += over * w[i] / total


def forced_positions(T: int, first: int, last: int, device=None) -> Tensor:
    """Always-kept positions in priority order: the first `first`, then the last `last` newest first."""
    head = torch.arange(min(first, T), device=device)
    tail = torch.arange(T - 1, max(T - 1 - last, -1), -1, device=device)
    return torch.cat([head, tail[tail >= len(head)]])


def _rankable(scores: Tensor) -> Tensor:
    """Scores with NaN/-inf made finite, so -inf can mark taken entries."""
    return torch.nan_to_num(scores.float(), nan=torch.finfo(torch.float32).min,
                            neginf=torch.finfo(torch.float32).min)


def top_with_forced(score: Tensor, n: int, forced: Tensor) -> Tensor:
    """Sorted positions of n entries: forced ones first (in priority order), then the highest scores."""
    keep = forced[:n]
    k = n - len(keep)
    if k > 0:
        s = _rankable(score)
        s[keep] = float("-inf")
        keep = torch.cat([keep, s.topk(k).indices])
    return keep.sort().values


def select(x, scores: Tensor, allocation: str, protect: Callable[[int], tuple[int, int]]) -> list[Tensor]:
    """Positions to keep per head of layer `x`, from (H, T) scores and the method's protected positions."""
    H, T = scores.shape
    if allocation == "adaptive":
        return _adaptive(x, scores, protect)
    n = x.entries_per_head()
    forced = forced_positions(T, *protect(n), device=scores.device)
    return [top_with_forced(scores[h], n, forced) for h in range(H)]


def _adaptive(x, scores: Tensor, protect) -> list[Tensor]:
    H, T = scores.shape
    index_bytes = 1 if H <= 127 else 2  # EntryState's head index for ragged heads
    total = min(H * T, int(x.budget_bytes // (x.entry_bytes() + index_bytes)))
    share = total // H
    forced = forced_positions(T, *protect(share), device=scores.device)[:share]
    base = max(min(T, math.ceil(ADAPTIVE_FLOOR * share)), len(forced))
    kept = [top_with_forced(scores[h], base, forced) for h in range(H)]
    rest = _rankable(scores).clone()
    for h, idx in enumerate(kept):
        rest[h, idx] = float("-inf")
    chosen = rest.flatten().topk(total - H * base).indices
    heads, pos = chosen // T, chosen % T
    return [torch.cat([kept[h], pos[heads == h]]).sort().values for h in range(H)]
