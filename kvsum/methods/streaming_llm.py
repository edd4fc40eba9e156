"""StreamingLLM: the first `sinks` tokens (attention sinks) plus the most recent window."""

from dataclasses import dataclass

import torch

from ..errors import KVSumError
from .base import LayerInput, Method, register


@register
@dataclass
class StreamingLLM(Method):
    name = "streaming_llm"
    summary = "attention sinks + recent window (Xiao et al., 2023)"
    sinks: int = 4

    def compress(self, x: LayerInput):
        if self.sinks < 0:
            raise KVSumError(f"sinks must be >= 0, got {self.sinks}")
        n = x.entries_per_head()
        sinks = min(self.sinks, n)
        idx = torch.cat([torch.arange(sinks), torch.arange(x.T - (n - sinks), x.T)]).to(x.keys.device)
        return x.keep([idx] * x.H)
