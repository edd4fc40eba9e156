"""The low-rank cover: every token of a layer kept approximately, as coefficients on the prompt's own bases.

Eviction loses query-agnostic retrieval because the fact a later question needs is rarely among the tokens
an observation window attends to. The cover keeps every token, so nothing is lost outright; anchors (the
exact entries of the summary method) are masked out of the cover for their own head, so no token is
counted twice in the softmax.

Per layer, a token's keys of all KV heads form one vector of H*d channels (heads are correlated, so one
basis over all heads beats one per head at the same bytes), and likewise its values. Both are stored as a
mean, an orthonormal basis (H*d, r) and per-token coefficients (T, r): a truncated SVD of this prompt's own
activations, so no calibration is needed. Keys are factored before RoPE (`space="pre"`), where they are far
closer to low rank, and rotated back at their positions when attention reads them; without the model's
RoPE tables (`LayerInput.rope`), they are factored as cached (`space="post"`), where the query can be
projected once and the keys are never rebuilt. Values are mixed in coefficient space and mapped back once.
"""

from __future__ import annotations

import functools
import inspect

import torch
from torch import Tensor

from ...errors import KVSumError
from ...rope import rope_tables, rotate, unrotate
from ...state import tensor_bytes
from ..quantizer import Quantizer
from .fit import lowrank_factors


def check_cover(cover) -> None:
    """A code cover is a quantizer of every non-anchor token: no exact tokens of its own. It codes the prompt's
    tokens after the sinks in position order, so codes tied to positions (pre_rope) are served."""
    if cover is None:
        return
    if not isinstance(cover, Quantizer):
        raise KVSumError(f"summary: cover must be a quantizer (e.g. TurboQuant(bits=3.5)), got {cover!r}")
    knobs = cover.exact_set()
    if knobs:
        raise KVSumError(f"summary: the cover codes every token but the anchors (summary's sinks and window "
                         f"decide what stays exact, in position order); drop the cover's {', '.join(knobs)}")

EXCLUDED_BYTES = 8  # an excluded token's flat (head, position) index, int64: each anchor a cover skips costs this too


def cover_bytes(T: int, H: int, d: int, rank_k: int, rank_v: int, elem: int) -> int:
    """Bytes of a cover of T tokens: per side a mean (H*d), a basis (H*d, r) and coefficients (T, r). The
    anchors it skips are counted with the anchors (EXCLUDED_BYTES each)."""
    n = H * d
    return sum((n + n * r + T * r) * elem for r in (rank_k, rank_v))


class Excluded:
    """The tokens of an (H, T) cover that another state holds exactly for their head (summary's anchors), kept
    as flat indices h * T + t: a few dozen per head, so 8 bytes each beat a byte for every token of every head."""

    def __init__(self, mask: Tensor):
        self.H, self.T = mask.shape
        self.flat = mask.flatten().nonzero()[:, 0]

    def lengths(self) -> list[int]:
        return [self.T - int(n) for n in torch.bincount(self.flat // self.T, minlength=self.H)]

    def nbytes(self) -> int:
        return tensor_bytes(self.flat)

    def fill(self, s: Tensor) -> Tensor:
        """Logits s (1, H, M, T), -inf written in place at the excluded tokens (one index_fill at a decoding
        step, where M = 1)."""
        if s.shape[2] == 1 and s.is_contiguous():
            s.view(-1).index_fill_(0, self.flat, float("-inf"))
        else:
            s[0, self.flat // self.T, :, self.flat % self.T] = float("-inf")
        return s


class CoverState:
    """keys/values (H, T, d) float32 -> low-rank factors; `exclude` (H, T) bool marks tokens held elsewhere."""

    def __init__(self, keys: Tensor, values: Tensor, rank_k: int, rank_v: int, exclude: Tensor,
                 rope: dict | None, dtype: torch.dtype):
        self.H, self.T, self.d = keys.shape
        self.rope = rope
        if rope is not None:
            keys = unrotate(keys, *self._tables(keys.device))
        flat = {"k": keys.transpose(0, 1).reshape(self.T, -1), "v": values.transpose(0, 1).reshape(self.T, -1)}
        # the bases are fitted on the tokens the cover serves: anchors held by every head (the attention sinks,
        # whose keys and values are outliers, and the recent window) would take the top components
        fit = ~exclude.all(0)
        self.factors = {}
        for w, r in (("k", rank_k), ("v", rank_v)):
            mean, _, basis = lowrank_factors(flat[w][fit], r)
            coef = (flat[w] - mean) @ basis
            self.factors[w] = tuple(t.to(dtype).contiguous() for t in (mean, coef, basis))
        self.exclude = Excluded(exclude)

    def _tables(self, device) -> tuple[Tensor, Tensor]:
        return rope_tables(self.rope["inv_freq"], self.rope["scaling"], self.T, device)

    def lengths(self) -> list[int]:
        return self.exclude.lengths()

    def nbytes(self) -> int:
        return tensor_bytes(*self.factors["k"], *self.factors["v"]) + self.exclude.nbytes()

    def _per_head(self, w: str) -> tuple[Tensor, Tensor, Tensor]:
        mean, coef, basis = (t.float() for t in self.factors[w])
        return mean.view(self.H, self.d), coef, basis.view(self.H, self.d, -1)

    def scores(self, q: Tensor, scale: float) -> Tensor:
        mean, coef, basis = self._per_head("k")
        if self.rope is None:  # exact in the reduced space: project the query once per head
            s = (q[0] @ basis) @ coef.t() + (q[0] @ mean[:, :, None])
        else:
            keys = (coef @ basis.transpose(1, 2)) + mean[:, None]  # (H, T, d) before RoPE
            s = q[0] @ rotate(keys, *self._tables(q.device)).transpose(1, 2)
        return self.exclude.fill((s * scale)[None])

    def mix(self, p: Tensor) -> Tensor:
        mean, coef, basis = self._per_head("v")
        out = ((p[0] @ coef) @ basis.transpose(1, 2)) + p[0].sum(-1, keepdim=True) * mean[:, None]
        return out[None]


@functools.cache
def _skips(cls) -> bool:
    """Whether a state class has a fused pass that can leave tokens out (`online(q, scale, skip=...)`)."""
    fused = getattr(cls, "online", None)
    return fused is not None and "skip" in inspect.signature(fused).parameters


class MaskedState:
    """A quantizer's state over n tokens of a layer (summary's code cover: all but the sinks), with `exclude`
    (H, n) bool masked out of its scores."""

    def __init__(self, inner, exclude: Tensor):
        self.inner, self.exclude = inner, Excluded(exclude)

    def lengths(self) -> list[int]:
        return self.exclude.lengths()

    def nbytes(self) -> int:
        return self.inner.nbytes() + self.exclude.nbytes()

    def scores(self, q: Tensor, scale: float) -> Tensor:
        return self.exclude.fill(self.inner.scores(q, scale))

    def mix(self, p: Tensor) -> Tensor:
        return self.inner.mix(p)

    def online(self, q: Tensor, scale: float) -> list | None:
        """The inner codes' fused pass (CUDA: TurboQuantState.online) with the excluded tokens skipped; None
        where the inner state has none that skips (then `scores` and `mix` do)."""
        if not _skips(type(self.inner)):
            return None
        return self.inner.online(q, scale, skip=self.exclude.flat)


def make_cover(x, quant: Quantizer | None, shift: int, sinks: int, cover_share: float, key_share: float):
    """(a function exclude -> cover state, its bytes) for layer x, or (None, 0) without a cover: `quant`'s codes
    of every token but the sinks (always anchors: not coded), else a low-rank cover of `cover_share` of the layer's
    bytes, `key_share` of its rank to keys."""
    if quant is not None:
        bits, s = quant.fixed_bits(), min(sinks, x.T)
        q, at = quant.basis_queries(x), quant.placed(x, s, 0)  # tokens s..T-1, at their positions where it matters
        return (lambda ex: MaskedState(quant.build(x.keys[:, s:], x.values[:, s:], bits, layer_idx=x.layer_idx,
                                                   shift=shift, storage=x.storage, queries=q, **at), ex[:, s:]),
                quant.charged_nbytes(x.H, x.T - s, x.d, bits, shift=shift, storage=x.storage))
    if cover_share > 0:
        n, elem = x.H * x.d, x.storage.itemsize
        budget = int(x.budget_bytes * cover_share)
        total = max(0, (budget - 2 * n * elem) // ((n + x.T) * elem))
        rk = min(n, round(total * key_share))
        rv = min(n, total - rk)
        return (lambda ex: CoverState(x.keys, x.values, rk, rv, ex, x.rope, x.storage),
                cover_bytes(x.T, x.H, x.d, rk, rv, elem))
    return None, 0
