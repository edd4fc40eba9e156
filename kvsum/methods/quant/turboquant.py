"""TurboQuant (Zandieh et al., 2025): random rotation + per-coordinate Lloyd-Max codes + separate norms.

A random rotation makes every coordinate of a unit vector follow one known law, so one precomputed
codebook is near-optimal for any input. Fractional rates (2.5, 3.5 bits) give half of each head's
rotated channels one more bit: those with the largest RMS in this layer's own data. With `qjl`, keys get
one bit less of MSE codes plus a 1-bit QJL sketch of the residual, which makes the attention logits
unbiased (the MSE quantizer alone shrinks inner products).

Two attention paths hold the same codes and give the same numbers: `dequant` rebuilds keys and values
in the original basis; `rotated` rotates the queries once, scores them against codebook lookups in the
rotated basis and rotates the mixed values back once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from ...errors import KVSumError
from ...state import tensor_bytes
from ..base import LayerInput, Method, register
from .codebook import codebook, encode
from .packing import Packed, packed_nbytes, pick_bits

SUPPORTED = (1, 2, 2.5, 3, 3.5, 4)
PATHS = ("rotated", "dequant")


def gaussian(d: int, seed: int) -> Tensor:
    return torch.randn(d, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def rotation(d: int, seed: int) -> Tensor:
    """A Haar-random orthogonal (d, d) matrix (float64): QR of a Gaussian, signs fixed by R's diagonal.
    (numpy's QR: torch.linalg.qr takes milliseconds even on tiny CPU matrices.)"""
    q, r = np.linalg.qr(gaussian(d, seed).numpy())
    return torch.from_numpy(q * np.sign(np.diagonal(r)))


def _split(bits: float, d: int) -> tuple[int, int]:
    """(low bit width, channels at low + 1 bits) so that the average over d channels is exactly `bits`."""
    lo = math.floor(bits)
    n_hi = (bits - lo) * d
    if n_hi != int(n_hi):
        raise KVSumError(f"turboquant: {bits} bits cannot be split exactly over head dim {d}")
    return lo, int(n_hi)


def _idx_dtype(d: int) -> torch.dtype:
    return torch.uint8 if d <= 256 else torch.int16


class Coded:
    """Lloyd-Max codes of rotated unit directions y (H, T, d): channels `idx_hi` of each head at lo + 1 bits
    (the largest RMS), the others at lo bits."""

    def __init__(self, y: Tensor, bits: float):
        H, T, d = y.shape
        lo, n_hi = _split(bits, d)
        self.T, self.d = T, d
        if n_hi:
            order = y.pow(2).mean(1).argsort(-1, descending=True)  # (H, d): channels by RMS
            idx = [order[:, :n_hi].sort(-1).values, order[:, n_hi:].sort(-1).values]
            widths = [lo + 1, lo]
        else:
            idx, widths = [None], [lo]
        self.parts = []
        for width, ix in zip(widths, idx):
            levels = codebook(width, d, y.device)
            part = y if ix is None else y.gather(2, ix[:, None, :].expand(H, T, -1))
            ix = None if ix is None else ix.to(_idx_dtype(d))
            self.parts.append((ix, levels, Packed(encode(part, levels), width)))

    def lookup(self) -> Tensor:
        """Reconstructed rotated unit directions (H, T, d)."""
        ix, levels, codes = self.parts[0]
        if ix is None:
            return levels[codes.codes().long()]
        H = ix.shape[0]
        out = torch.empty(H, self.T, self.d, device=levels.device)
        for ix, levels, codes in self.parts:
            out.scatter_(2, ix.long()[:, None, :].expand(H, self.T, -1), levels[codes.codes().long()])
        return out

    def dot(self, qr: Tensor) -> Tensor:
        """Rotated queries qr (1, H, M, d) against the reconstructed directions -> (1, H, M, T)."""
        s = 0
        for ix, levels, codes in self.parts:
            part = qr if ix is None else qr.gather(3, ix.long()[None, :, None, :].expand(*qr.shape[:3], -1))
            s = s + part @ levels[codes.codes().long()].transpose(-1, -2)
        return s

    def nbytes(self) -> int:
        return sum(tensor_bytes(ix, levels) + codes.nbytes() for ix, levels, codes in self.parts)


def coded_nbytes(H: int, T: int, d: int, bits: float) -> int:
    lo, n_hi = _split(bits, d)
    n = packed_nbytes(H * T * (d - n_hi), lo) + 4 * 2 ** lo
    if n_hi:
        n += packed_nbytes(H * T * n_hi, lo + 1) + 4 * 2 ** (lo + 1) + H * d * _idx_dtype(d).itemsize
    return n


def qjl_encode(r: Tensor, S: Tensor) -> tuple[Tensor, Tensor]:
    """1-bit sketch of residuals r (..., d): sign(S r) as bools and |r|."""
    return (r @ S.t()) >= 0, r.norm(dim=-1)


def qjl_estimate(q: Tensor, signs: Tensor, r_norm: Tensor, S: Tensor) -> Tensor:
    """Unbiased estimate of <q, r> from the sketch: sqrt(pi/2) / m |r| <S q, sign(S r)>; q (..., M, d),
    signs (..., T, m) -> (..., M, T)."""
    pm = signs.float() * 2 - 1
    return math.sqrt(math.pi / 2) / S.shape[0] * (q @ S.t()) @ pm.transpose(-1, -2) * r_norm.unsqueeze(-2)


class TurboQuantState:
    """A layer's keys and values as rotated Lloyd-Max codes, fp16 norms (and a QJL sketch of the key residuals)."""

    def __init__(self, keys: Tensor, values: Tensor, bits: float, qjl: bool, R: Tensor, S: Tensor | None,
                 path: str):
        self.H, self.T, self.d = keys.shape
        self.bits, self.qjl, self.path, self.R, self.S = bits, qjl, path, R, S
        Rf = R.float()
        yk, self.k_norm = self._directions(keys, Rf)
        yv, self.v_norm = self._directions(values, Rf)
        self.k = Coded(yk, bits - 1 if qjl else bits)
        self.v = Coded(yv, bits)
        self.signs = self.r_norm = None
        if qjl:
            resid = keys @ Rf.t() - self.k_norm.float()[..., None] * self.k.lookup()  # in the rotated basis
            signs, r_norm = qjl_encode(resid, S.float())
            self.signs, self.r_norm = Packed(signs, 1), r_norm.half()

    @staticmethod
    def _directions(x: Tensor, Rf: Tensor) -> tuple[Tensor, Tensor]:
        norm = x.norm(dim=-1)
        return (x / norm.clamp_min(1e-30)[..., None]) @ Rf.t(), norm.half()

    def lengths(self) -> list[int]:
        return [self.T] * self.H

    def nbytes(self) -> int:
        n = self.k.nbytes() + self.v.nbytes() + tensor_bytes(self.k_norm, self.v_norm, self.R, self.S, self.r_norm)
        return n + (self.signs.nbytes() if self.signs is not None else 0)

    def _qjl_keys(self) -> Tensor:
        """The QJL correction of the keys in the rotated basis: sqrt(pi/2) / m |r| S^T sign(S r)."""
        pm = self.signs.codes().float() * 2 - 1
        return math.sqrt(math.pi / 2) / self.S.shape[0] * self.r_norm.float()[..., None] * (pm @ self.S.float())

    def keys(self) -> Tensor:
        """Dequantized keys (H, T, d) in the original basis."""
        k = self.k_norm.float()[..., None] * self.k.lookup()
        if self.signs is not None:
            k = k + self._qjl_keys()
        return k @ self.R.float()

    def values(self) -> Tensor:
        return (self.v_norm.float()[..., None] * self.v.lookup()) @ self.R.float()

    def scores(self, q: Tensor, scale: float) -> Tensor:
        if self.path == "dequant":
            return q @ self.keys().transpose(-1, -2) * scale
        qr = q @ self.R.float().t()
        s = self.k.dot(qr) * self.k_norm.float()[None, :, None, :]
        if self.signs is not None:
            signs = self.signs.codes().bool()
            s = s + qjl_estimate(qr, signs, self.r_norm.float(), self.S.float())
        return s * scale

    def mix(self, p: Tensor) -> Tensor:
        if self.path == "dequant":
            return p @ self.values()
        return ((p * self.v_norm.float()[None, :, None, :]) @ self.v.lookup()) @ self.R.float()


@register
@dataclass
class TurboQuant(Method):
    """`bits` per coordinate on average over keys and values (None: the largest in SUPPORTED that fits the
    budget); with `qjl` keys spend one of them on the QJL sketch. The rotation and the QJL matrix are held in
    fp16 and counted in nbytes."""

    name = "turboquant"
    summary = "random rotation + Lloyd-Max scalar codes, optional QJL residual (Zandieh et al., 2025)"
    bits: float | None = None
    qjl: bool = False
    seed: int = 0
    path: str = "rotated"

    def nbytes(self, H: int, T: int, d: int, bits: float) -> int:
        """Exactly what a state of (H, T, d) keys and values at `bits` holds."""
        n = coded_nbytes(H, T, d, bits - 1 if self.qjl else bits) + coded_nbytes(H, T, d, bits)
        n += 2 * H * T * 2 + d * d * 2  # fp16 norms, fp16 rotation
        if self.qjl:
            n += packed_nbytes(H * T * d, 1) + H * T * 2 + d * d * 2  # sign bits, fp16 |r|, fp16 S
        return n

    def compress(self, x: LayerInput) -> TurboQuantState:
        if self.path not in PATHS:
            raise KVSumError(f"turboquant: path={self.path!r}; accepted: {', '.join(PATHS)}")
        supported = [b for b in SUPPORTED if b >= 2] if self.qjl else list(SUPPORTED)
        full = 2 * x.H * x.T * x.d * 2
        bits = pick_bits("turboquant" + (" with qjl" if self.qjl else ""), self.bits, supported,
                         lambda b: self.nbytes(x.H, x.T, x.d, b), x.budget_bytes, full)
        seed = self.seed * 1_000_003 + 2 * x.layer_idx
        R = rotation(x.d, seed).to(torch.float16).to(x.keys.device)
        S = gaussian(x.d, seed + 1).to(torch.float16).to(x.keys.device) if self.qjl else None
        return TurboQuantState(x.keys, x.values, bits, self.qjl, R, S, self.path)
