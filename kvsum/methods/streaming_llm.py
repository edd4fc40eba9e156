"""StreamingLLM: the first `sinks` tokens (attention sinks) plus the most recent window."""

from dataclasses import dataclass

import torch

from ..errors import KVSumError
from ..state import LayerState
from .base import LayerInput, Method, Plan
from .registry import register


@register
@dataclass(frozen=True)
class StreamingLLM(Method):
    """Keep the attention sinks and the most recent tokens, as many as the budget allows.

    Attributes:
        sinks: first tokens always kept (attention sinks); the rest of each head's entries are the newest.
    """

    name = "streaming_llm"
    summary = "attention sinks + recent window (Xiao et al., 2023)"
    sinks: int = 4

    def compress(self, x: LayerInput, plan: Plan | None = None) -> LayerState:
        if self.sinks < 0:
            raise KVSumError(f"sinks must be >= 0, got {self.sinks}")
        n = x.entries_per_head()
        sinks = min(self.sinks, n)
        idx = torch.cat([torch.arange(sinks), torch.arange(x.T - (n - sinks), x.T)]).to(x.keys.device)
        return x.keep([idx] * x.H)
