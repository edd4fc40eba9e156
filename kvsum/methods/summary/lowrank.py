"""Low-rank entries: per head, keys and values as mean + coefficients @ basis^T (truncated SVD).

Attention never rebuilds the keys: the query is projected on the key basis once, and the weighted
values are mixed in the coefficient space and mapped back once.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ...state import tensor_bytes
from .fit import lowrank_factors


class LowRankState:
    def __init__(self, heads: list[tuple[Tensor, Tensor, int]], dtype=torch.float16):
        """heads: per KV head (keys (m, d), values (m, d), rank)."""
        self.heads = []
        for k, v, rank in heads:
            parts = (*lowrank_factors(k, rank), *lowrank_factors(v, rank))
            self.heads.append(tuple(t.to(dtype).contiguous() for t in parts))

    def lengths(self) -> list[int]:
        return [h[1].shape[0] for h in self.heads]

    def nbytes(self) -> int:
        return sum(tensor_bytes(*h) for h in self.heads)

    def scores(self, q: Tensor, scale: float) -> Tensor:
        out = []
        for h, (km, kc, kb, *_) in enumerate(self.heads):
            qh = q[0, h]  # (M, d)
            out.append(((qh @ kb.float()) @ kc.float().t() + (qh @ km.float())[:, None]) * scale)
        n = max(o.shape[-1] for o in out)
        pad = [torch.nn.functional.pad(o, (0, n - o.shape[-1]), value=float("-inf")) for o in out]
        return torch.stack(pad)[None]

    def mix(self, p: Tensor) -> Tensor:
        out = []
        for h, (*_, vm, vc, vb) in enumerate(self.heads):
            ph = p[0, h, :, : vc.shape[0]]
            out.append((ph @ vc.float()) @ vb.float().t() + ph.sum(-1, keepdim=True) * vm.float())
        return torch.stack(out)[None]

    @staticmethod
    def bytes_for(tokens: int, rank: int, d: int, elem: int) -> int:
        """Bytes for one head: K and V each a mean (d), a basis (d, r) and coefficients (tokens, r)."""
        return 2 * (d + d * rank + tokens * rank) * elem
