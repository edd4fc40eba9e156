"""Lloyd-Max scalar codes of rotated unit directions, with the outlier-channel split of fractional rates.

Fractional rates (2.5, 3.5 bits) give half of each head's rotated channels one more bit: those with the
largest RMS in the data the codes are built for. Codes are held token-major in packed stores, so tokens
decoded later append to the same store with the same channel split.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ...errors import KVSumError
from ...state import tensor_bytes
from . import native
from .codebook import codebook, encode
from .packing import Packed, packed_nbytes


def split_bits(bits: float, d: int) -> tuple[int, int]:
    """(low bit width, channels at low + 1 bits) so that the average over d channels is exactly `bits`."""
    lo = math.floor(bits)
    n_hi = (bits - lo) * d
    if n_hi != int(n_hi):
        raise KVSumError(f"turboquant: {bits} bits cannot be split exactly over head dim {d}")
    return lo, int(n_hi)


def idx_dtype(d: int) -> torch.dtype:
    return torch.uint8 if d <= 256 else torch.int16


class Coded:
    """Lloyd-Max codes of rotated unit directions (H, T, d): channels `idx_hi` of each head at lo + 1 bits
    (the largest RMS in `y`, the data it is built for), the others at lo bits. It holds no tokens until
    `extend` codes them. Codes are held token-major (T, H, c), so decoding-time tokens append to the same packed
    store with the same channel split."""

    def __init__(self, y: Tensor, bits: float):
        H, T, d = y.shape
        lo, n_hi = split_bits(bits, d)
        self.H, self.T, self.d = H, 0, d
        if n_hi:
            order = y.pow(2).mean(1).argsort(-1, descending=True)  # (H, d): channels by RMS
            idx = [order[:, :n_hi].sort(-1).values.to(idx_dtype(d)), order[:, n_hi:].sort(-1).values.to(idx_dtype(d))]
            widths = [lo + 1, lo]
        else:
            idx, widths = [None], [lo]
        self.parts = [[ix, codebook(width, d, y.device), width, None] for ix, width in zip(idx, widths)]

    def extend(self, y: Tensor) -> Tensor:
        """Encode directions y (H, n, d) after the current ones; returns their reconstruction (H, n, d)."""
        H, n, d = y.shape
        out = torch.empty_like(y) if self.parts[0][0] is not None else None
        for part in self.parts:
            ix, levels, width, codes = part
            sub = y if ix is None else y.gather(2, ix.long()[:, None, :].expand(H, n, -1))
            c = encode(sub, levels)
            if codes is None:
                part[3] = Packed(c.transpose(0, 1), width, tuple(levels.tolist()))
            else:
                codes.append(c.transpose(0, 1))
            if ix is None:
                out = levels[c.long()]
            else:
                out.scatter_(2, ix.long()[:, None, :].expand(H, n, -1), levels[c.long()])
        self.T += n
        return out

    @staticmethod
    def _levels(levels: Tensor, codes: Packed) -> Tensor:
        return codes.lookup().transpose(0, 1)  # (T, H, c) -> (H, T, c)

    def lookup(self) -> Tensor:
        """Reconstructed rotated unit directions (H, T, d)."""
        ix, levels, _, codes = self.parts[0]
        if ix is None:
            return self._levels(levels, codes)
        out = torch.empty(self.H, self.T, self.d, device=levels.device)
        for ix, levels, _, codes in self.parts:
            out.scatter_(2, ix.long()[:, None, :].expand(self.H, self.T, -1), self._levels(levels, codes))
        return out

    def _native(self, rows: int) -> list | None:
        """The parts as native.py takes them, where its kernel serves them."""
        parts = [(codes, ix, levels) for ix, levels, _, codes in self.parts]
        return parts if native.usable(parts, rows) else None

    def dot(self, qr: Tensor, norm: Tensor, scale: float, add: Tensor | None = None,
            runs: Tensor | None = None) -> Tensor:
        """Rotated queries qr (1, H, M, d) against the reconstructed directions times `norm` (H, T) and `scale`
        -> (1, H, M, T); read from the packed codes by native.py's kernel where it serves. `add` and `runs`
        (kernel only, see native.score): one head's tokens read in runs, one per query head, plus `add`."""
        parts = self._native(qr.shape[2])
        if parts is not None:
            return native.score(parts, qr[0], norm, scale, add, runs)[None]
        if runs is not None:
            raise KVSumError("turboquant: codes are read in runs only through the packed-code kernel")
        s = 0
        for ix, levels, _, codes in self.parts:
            part = qr if ix is None else qr.gather(3, ix.long()[None, :, None, :].expand(*qr.shape[:3], -1))
            s = s + part @ self._levels(levels, codes).transpose(-1, -2)
        return s * (norm.float()[None, :, None, :] * scale)

    def mix(self, pw: Tensor, norm: Tensor, runs: Tensor | None = None) -> Tensor:
        """Weights pw (1, H, M, T) over the reconstructed directions times `norm` (H, T) -> (1, H, M, d), one
        channel part at a time (the split is undone on the small output, never on an (H, T, d) tensor)."""
        parts = self._native(pw.shape[2])
        if parts is not None:
            return native.mix(parts, pw[0], norm, self.d, runs)[None]
        if runs is not None:
            raise KVSumError("turboquant: codes are read in runs only through the packed-code kernel")
        pw = pw * norm.float()[None, :, None, :]
        if self.parts[0][0] is None:
            _, levels, _, codes = self.parts[0]
            return pw @ self._levels(levels, codes)
        out = pw.new_empty(*pw.shape[:3], self.d)
        for ix, levels, _, codes in self.parts:
            out.scatter_(3, ix.long()[None, :, None, :].expand(*pw.shape[:3], -1), pw @ self._levels(levels, codes))
        return out

    def nbytes(self) -> int:
        return sum(tensor_bytes(ix, levels) + codes.nbytes() for ix, levels, _, codes in self.parts)


def coded_nbytes(H: int, T: int, d: int, bits: float) -> int:
    lo, n_hi = split_bits(bits, d)
    n = packed_nbytes(H * T * (d - n_hi), lo) + 4 * 2 ** lo
    if n_hi:
        n += packed_nbytes(H * T * n_hi, lo + 1) + 4 * 2 ** (lo + 1) + H * d * idx_dtype(d).itemsize
    return n
