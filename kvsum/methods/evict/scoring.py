"""Shared machinery of the eviction family: knob checks, the queries' time order, the base class (the causal
attention of the reference queries and SnapKV's vote are in ../attention_stats.py: summary reads them too).

Every eviction method only says how to score entries (`score` -> (H, T), higher is kept first) and
which positions it always keeps (`protect`); selection and budget allocation live in allocation.py,
so any scorer composes with any allocation.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from ...errors import KVSumError
from ...state import LayerState
from ..base import LayerInput, Method, Plan
from .allocation import ALLOCATIONS, pyramid_budgets, select


def time_order(x: LayerInput) -> Tensor:
    """Rank of every reference query in prompt order (0 = earliest)."""
    return x.query_pos.argsort().argsort()


@dataclass(frozen=True)
class Eviction(Method):
    """Base of the eviction methods: a scorer (`score`, `protect`) under a budget allocation.

    Attributes:
        allocation: how entries are spread: "uniform" (every head alike), "pyramid" (layer budgets decrease
            with depth, PyramidKV) or "adaptive" (heads of a layer compete in one top-k, AdaKV).
    """

    allocation: str = "uniform"

    def __post_init__(self):
        if self.allocation not in ALLOCATIONS:
            raise KVSumError(f"{self.name}: allocation must be one of {', '.join(ALLOCATIONS)}; "
                             f"got {self.allocation!r}")

    def check_int(self, knob: str, low: int = 0, odd: bool = False) -> None:
        value = getattr(self, knob)
        if isinstance(value, bool) or not isinstance(value, int) or value < low or (odd and value % 2 == 0):
            kind = "an odd integer" if odd else "an integer"
            raise KVSumError(f"{self.name}: {knob} must be {kind} >= {low}, got {value!r}")

    def check_fraction(self, knob: str, high_open: bool = False) -> None:
        """Knob in [0, 1] (or [0, 1) with high_open)."""
        value = getattr(self, knob)
        ok = not isinstance(value, bool) and isinstance(value, (int, float))
        if not ok or not (0 <= value < 1 if high_open else 0 <= value <= 1):
            raise KVSumError(f"{self.name}: {knob} must be a number in [0, 1{')' if high_open else ']'}, "
                             f"got {value!r}")

    def score(self, x: LayerInput) -> Tensor:
        """(H, T) importance of every prompt entry; scores are compared across heads by adaptive allocation."""
        raise NotImplementedError

    def protect(self, n: int) -> tuple[int, int]:
        """(first, last): positions always kept when a head holds n entries (sinks, recent window)."""
        return 0, 0

    def plan(self, inputs: list[LayerInput], budget: float) -> Plan:
        """Pyramid allocation spreads the budget over layers (decreasing with depth); else every layer alike."""
        if self.allocation == "pyramid":
            return Plan(tuple(pyramid_budgets(len(inputs), budget)))
        return super().plan(inputs, budget)

    def compress(self, x: LayerInput, plan: Plan | None = None) -> LayerState:
        scores = self.score(x)
        return x.keep(select(x, scores, self.allocation, self.protect))
