"""How a method refuses a budget: by naming the smallest budget that fits (shared by every family)."""

from __future__ import annotations

import math
from collections.abc import Callable


def smallest_budget(need_bytes: float, full_bytes: float) -> float:
    """The smallest budget of 3 decimals whose bytes hold `need_bytes` of a layer of `full_bytes`."""
    b = math.ceil(need_bytes / full_bytes * 1000) / 1000
    return b + 0.001 if b * full_bytes < need_bytes else b


def least_budget(fits: Callable[[float], bool], above: float) -> float | None:
    """The smallest budget of 3 decimals above `above` for which `fits` (increasing in the budget) holds, None
    if it does not hold at 1.0."""
    if not fits(1.0):
        return None
    lo, hi = math.floor(above * 1000), 1000  # fits(hi / 1000); lo / 1000 does not (or is the floor)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if fits(mid / 1000) else (mid, hi)
    return hi / 1000


def budget_hint(need_bytes: float, full_bytes: float) -> str:
    """The refusal's last words: the smallest budget that fits, or that none does."""
    b = smallest_budget(need_bytes, full_bytes)
    return f"the smallest budget that fits: {b:.3f}" if b <= 1 else "no budget up to 1.0 fits (its fixed costs)"
