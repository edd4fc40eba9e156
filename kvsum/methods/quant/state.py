"""TurboQuantState: a layer's keys and values as rotated Lloyd-Max codes with fp16 norms (and a QJL sketch).

Two attention paths hold the same codes and give the same numbers: `dequant` rebuilds keys and values
in the original basis; `rotated` rotates the queries once, scores them against codebook lookups in the
rotated basis and rotates the mixed values back once.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ... import kernels
from ...state import tensor_bytes
from .codes import Coded
from .packing import Packed
from .pca import KeyTransform
from .qjl import qjl_encode, qjl_estimate
from .rotation import Rotation


def _after(held: Tensor | None, new: Tensor) -> Tensor:
    """Per-token side data (H, n) appended after what a state holds (H, T), or `new` where it holds none yet."""
    return new if held is None else torch.cat([held, new], 1)


class TurboQuantState:
    """A layer's keys and values as rotated Lloyd-Max codes, fp16 norms (and a QJL sketch of the key residuals).

    With `center`, each head's mean prompt key (fp16) is subtracted before coding from every key it shortens,
    and its logit added back exactly: a code's error scales with the norm it codes, and the mean is a large share
    of a key; the few keys that point away from it (on SmolLM2 " the" in some heads, the very tokens those heads
    attend to) are coded as they are, the sign bit of their fp16 norm (always positive) saying which. (Values are
    not centered: their mean is pulled by a few large tokens; see docs/results/quant.md.) A prebuilt `key_codes` (pca's
    KeyTransform, centered itself) replaces the key codes. `extend` quantizes decoding-time tokens into the
    same stores (same rotation, codebooks, channel split, mean)."""

    def __init__(self, keys: Tensor, values: Tensor, bits: float, qjl: bool, R: Rotation, S: Tensor | None,
                 path: str, widths: tuple[float, float], center: bool = False, key_codes: KeyTransform | None = None,
                 unbiased: str = "none", note: str = ""):
        self.H, _, self.d = keys.shape
        self.note = note  # what was degraded to fit the budget (e.g. the rotation), "" when nothing was
        self.unbiased = unbiased
        self.bits, self.qjl, self.path, self.R, self.S = bits, qjl, path, R, S
        self.widths = widths  # (keys' MSE code width, values'), TurboQuant.widths(bits)
        self.T = 0
        self.k = key_codes
        self.v = self.k_norm = self.v_norm = self.signs = self.r_norm = self.k_shrink = None
        self.k_mean = keys.mean(1, keepdim=True).half() if center and key_codes is None else None  # (H, 1, d)
        self.extend(keys, values)

    def pending(self) -> int:
        """Tokens held in full precision, waiting for a group (none: every token is coded at once)."""
        return 0

    def extend(self, keys: Tensor, values: Tensor, quantize: int | None = None) -> None:
        """Append keys and values (H, n, d), all quantized (`quantize`, if given, must be n)."""
        n = keys.shape[1]
        if quantize is not None and quantize != n:
            raise ValueError("turboquant quantizes every appended token")
        yv, v_norm = self._directions(values)
        self.T += n
        first = self.v is None
        if first:
            self.v = Coded(yv, self.widths[1])
        v_norm = self._gain(v_norm, yv, self.v.extend(yv), "values")
        self.v_norm = _after(self.v_norm, v_norm)
        if isinstance(self.k, KeyTransform):
            if not first:  # the prompt's keys were coded when the transform was built
                self.k.extend(keys)
            return
        if self.k_mean is not None:
            less = keys - self.k_mean.float()
            on = less.norm(dim=-1) < keys.norm(dim=-1)  # (H, n): the keys the mean shortens
            keys = torch.where(on[..., None], less, keys)
        yk, k_norm = self._directions(keys)
        if first:
            self.k = Coded(yk, self.widths[0])
        k_hat = self.k.extend(yk)
        if first and self.k_mean is not None:  # what the codes shrink a key by, on average: the mean's share it keeps
            self.k_shrink = (1 - (yk * k_hat).sum(-1).mean(1, keepdim=True)).half()  # (H, 1)
        k_norm = self._gain(k_norm, yk, k_hat, "keys")
        self.k_norm = _after(self.k_norm, k_norm if self.k_mean is None else torch.where(on, k_norm, -k_norm))
        if self.qjl:
            resid = self.R.apply(keys) - k_norm.float()[..., None] * k_hat  # in the rotated basis
            signs, r_norm = qjl_encode(resid, self.S.float())
            signs = signs.transpose(0, 1)  # token-major, as the codes
            if self.signs is None:
                self.signs = Packed(signs, 1)
            else:
                self.signs.append(signs)
            self.r_norm = _after(self.r_norm, r_norm.half())

    def _directions(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Rotated unit directions and fp32 norms of x (H, n, d)."""
        norm = x.norm(dim=-1)
        return self.R.apply(x / norm.clamp_min(1e-30)[..., None]), norm

    def _gain(self, norm: Tensor, y: Tensor, y_hat: Tensor, side: str) -> Tensor:
        """The fp16 scale a side's codes are read with: the norm, or with `unbiased` naming this side the norm
        over <y, y_hat>, which makes the reconstruction's projection on the true direction exact."""
        if self.unbiased in ("both", side):
            norm = norm / (y * y_hat).sum(-1).clamp_min(0.05)
        return norm.half()

    def lengths(self) -> list[int]:
        return [self.T] * self.H

    def nbytes(self) -> int:
        n = self.k.nbytes() + self.v.nbytes() + self.R.nbytes() + tensor_bytes(self.k_norm, self.v_norm, self.S,
                                                                               self.r_norm, self.k_mean, self.k_shrink)
        return n + (self.signs.nbytes() if self.signs is not None else 0)

    def _norms(self) -> Tensor:
        """The keys' fp16 norms (centered codes keep which keys were coded less the mean in their sign bit)."""
        return self.k_norm if self.k_mean is None else self.k_norm.abs()

    def _on(self) -> Tensor:
        """(H, T) the share of the mean each key's reconstruction adds back: 1 where it was coded less the mean (a
        cache saved before: every key); where coded as it is (a negative norm), the share the codes shrink a key by,
        so both kinds shrink toward the mean alike (Lloyd-Max codes shrink each vector by about their distortion,
        12% at 2 bits: a key shrunk toward zero would read that share of the mean's logit low beside the rest)."""
        on = (~torch.signbit(self.k_norm)).float()
        shrink = getattr(self, "k_shrink", None)
        return on if shrink is None else on + (1 - on) * shrink.float()

    def _mean_logit(self, q: Tensor, scale: float) -> Tensor:
        """The mean key's logit for each query row, exact: q (..., H, M, d) -> (..., H, M, 1)."""
        k = self.k_mean.float().transpose(-1, -2)
        if q.dim() == 3 and k.shape[0] == q.shape[0]:  # a decoding step's heads: bmm, its fewest operations
            return torch.bmm(q, k).mul_(scale)
        return q @ k * scale

    def _mean_logits(self, q: Tensor, scale: float, runs: Tensor | None = None) -> Tensor:
        """The mean key's logit on each key, in the share `_on` gives: q (..., H, M, d) -> (..., H, M, T); with
        `runs` (one head's store read in runs, as Coded.dot reads it) (1, H, M, longest run)."""
        on = self._on()
        if runs is not None:
            t = runs[:-1, None].to(on.device) + torch.arange(kernels.longest_run(runs), device=on.device)
            on = on[0, t.clamp_max(self.T - 1)]
        return self._mean_logit(q, scale) * on[:, None, :]

    def _signs(self) -> Tensor:
        return self.signs.codes().transpose(0, 1)  # (H, T, m)

    def _qjl_keys(self) -> Tensor:
        """The QJL correction of the keys in the rotated basis: sqrt(pi/2) / m |r| S^T sign(S r)."""
        pm = self._signs().float() * 2 - 1
        return math.sqrt(math.pi / 2) / self.S.shape[0] * self.r_norm.float()[..., None] * (pm @ self.S.float())

    def keys(self) -> Tensor:
        """Dequantized keys (H, T, d) in the original basis."""
        if isinstance(self.k, KeyTransform):
            return self.k.keys()
        k = self._norms().float()[..., None] * self.k.lookup()
        if self.signs is not None:
            k = k + self._qjl_keys()
        k = self.R.undo(k)
        return k if self.k_mean is None else k + self.k_mean.float() * self._on()[..., None]

    def values(self) -> Tensor:
        return self.R.undo(self.v_norm.float()[..., None] * self.v.lookup())

    def scores(self, q: Tensor, scale: float) -> Tensor:
        if self.path == "dequant":
            return q @ self.keys().transpose(-1, -2) * scale
        if isinstance(self.k, KeyTransform):  # the scale on the few queries, not on the (H, M, T) logits
            return self.k.scores(q * scale)
        if self.signs is None:  # the scale inside the codes' pass (the kernel's, where it serves)
            return self._code_logits(q, scale)
        qr = self.R.apply(q)
        s = self.k.dot(qr, self._norms(), 1.0) + qjl_estimate(qr, self._signs().bool(), self.r_norm.float(),
                                                             self.S.float())
        s = s * scale
        return s if self.k_mean is None else s + self._mean_logits(q, scale)

    def mix(self, p: Tensor) -> Tensor:
        if self.path == "dequant":
            return p @ self.values()
        return self.R.undo(self.v.mix(p, self.v_norm))

    def serves_runs(self, rows: int) -> bool:
        """Whether `run_scores` and `run_mix` serve `rows` query rows per head: the rotated path, MSE codes only
        (no QJL sketch, no pca keys), both sides through the packed-code kernel."""
        return (self.path == "rotated" and self.signs is None and isinstance(self.k, Coded)
                and self.k._native(rows) is not None and self.v._native(rows) is not None)

    def run_scores(self, q: Tensor, scale: float, bias: Tensor | None, runs: Tensor) -> Tensor:
        """A store of one head holding H heads' entries one run after another (composition's ragged heads):
        queries q (1, H, M, d) of head h against run h only, (1, H, M, longest run), -inf past each run's end;
        `bias` (T,) is added to each entry's logit. Each code is decoded once, for its own head's M rows."""
        return self._code_logits(q, scale, add=bias, runs=runs)

    def _code_logits(self, q: Tensor, scale: float, **read) -> Tensor:
        """Queries q (1, H, M, d) against the MSE key codes, times `scale`, read as Coded.dot's `read` keywords
        say; plus the mean key's logit on the keys coded less it (-inf stays -inf)."""
        s = self.k.dot(self.R.apply(q), self._norms(), scale, **read)
        if self.k_mean is not None:
            s += self._mean_logits(q, scale, read.get("runs"))
        return s

    def online(self, q: Tensor, scale: float, skip: Tensor | None = None, bias: Tensor | None = None,
               runs: Tensor | None = None) -> list | None:
        """On CUDA, a decoding step's attention over the codes in one fused pass (kvsum/kernels/flash.py): the
        partials (max, sum, values) of its chunks, stacked, that joint attention joins with the exact parts and the
        tail, no logit written to memory; `skip`: flat indices h * T + t of tokens left out (held exactly
        elsewhere); `bias` and `runs` as `run_scores` takes them (a composition's store). None where that kernel
        does not serve (then `scores` and `mix` do)."""
        if not (kernels.serves(self.v_norm) and self.serves_runs(q.shape[2])):  # the cheap check first: CPU steps
            return None
        from ...kernels import flash

        add = shrink = None
        if self.k_mean is not None:  # the mean's logit per query row, times each key's share of it (`_on`, which
            add = self._mean_logit(q[0], scale)[..., 0]  # the kernel reads from the norms' sign bits)
            shrink = getattr(self, "k_shrink", None)  # None: a cache saved before the flags, every norm positive
        skip = None if skip is None else flash.skip_mask(skip, self.H, self.T)
        m, total, acc = flash.coded(self.k._native(q.shape[2]), self.v._native(q.shape[2]), self.R.apply(q)[0],
                                    self.k_norm, self.v_norm, scale, add, skip, shrink, bias, runs)
        return [(m, total, self.R.undo(acc))]  # every chunk's values back in the original basis at once

    def run_mix(self, p: Tensor, runs: Tensor) -> Tensor:
        """Weights p (1, H, M, longest run) over each head's run -> (1, H, M, d), as `run_scores` reads them."""
        return self.R.undo(self.v.mix(p, self.v_norm, runs))
