"""KIVI (Liu et al., 2024): asymmetric min/max integer codes, keys per channel and values per token.

Keys have fixed outlier channels, so each key channel gets its own min and scale over a group of
`group` tokens; values are grouped along channels within each token. The newest `residual` prompt
tokens (plus the ones that do not fill a whole key group) stay in full precision.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ...errors import KVSumError
from ...state import tensor_bytes
from ..base import LayerInput, Method, register
from .packing import Packed, packed_nbytes, pick_bits

SUPPORTED = (2, 4)


def minmax_codes(x: Tensor, dim: int, bits: int) -> tuple[Tensor, Tensor, Tensor]:
    """Codes (uint8) with fp16 scale and zero point (the group's min) along `dim`.

    The fp16 min is rounded down, so even a group whose range is below fp16 resolution at its magnitude
    has min + code * scale within scale / 2 of every element.
    """
    top = 2 ** bits - 1
    lo, hi = x.amin(dim, keepdim=True), x.amax(dim, keepdim=True)
    mn = lo.half()
    mn = torch.where(mn.float() > lo, torch.nextafter(mn, torch.full_like(mn, -float("inf"))), mn)
    sc = ((hi - mn.float()) / top).half()
    codes = ((x - mn.float()) / sc.float().clamp_min(1e-30)).round().clamp(0, top).to(torch.uint8)
    return codes, sc, mn


class KIVIState:
    """The first n_q prompt tokens as packed codes (keys per channel, values per token), the rest in full."""

    def __init__(self, keys: Tensor, values: Tensor, bits: int, group: int, ch_group: int, n_q: int,
                 storage: torch.dtype):
        self.H, self.T, self.d = keys.shape
        self.bits, self.n_q, self.group, self.ch_group = bits, n_q, group, ch_group
        H, d = self.H, self.d
        kc, self.k_scale, self.k_min = minmax_codes(keys[:, :n_q].reshape(H, n_q // group, group, d), 2, bits)
        vc, self.v_scale, self.v_min = minmax_codes(values[:, :n_q].reshape(H, n_q, d // ch_group, ch_group), 3, bits)
        self.k_codes, self.v_codes = Packed(kc, bits), Packed(vc, bits)
        self.k_res, self.v_res = keys[:, n_q:].to(storage), values[:, n_q:].to(storage)

    def lengths(self) -> list[int]:
        return [self.T] * self.H

    def nbytes(self) -> int:
        return self.k_codes.nbytes() + self.v_codes.nbytes() + tensor_bytes(
            self.k_scale, self.k_min, self.v_scale, self.v_min, self.k_res, self.v_res)

    def keys(self) -> Tensor:
        """All keys (H, T, d): dequantized codes then the full-precision residual."""
        k = self.k_codes.codes().float() * self.k_scale.float() + self.k_min.float()
        return torch.cat([k.reshape(self.H, self.n_q, self.d), self.k_res.float()], 1)

    def values(self) -> Tensor:
        v = self.v_codes.codes().float() * self.v_scale.float() + self.v_min.float()
        return torch.cat([v.reshape(self.H, self.n_q, self.d), self.v_res.float()], 1)

    def scores(self, q: Tensor, scale: float) -> Tensor:
        return q @ self.keys().transpose(-1, -2) * scale

    def mix(self, p: Tensor) -> Tensor:
        return p @ self.values()


@register
@dataclass
class KIVI(Method):
    """`bits` 2 or 4 (None: the largest that fits the budget); `group` tokens per key scale and channels per
    value scale (at most the head dim); the newest `residual` prompt tokens stay in full precision."""

    name = "kivi"
    summary = "per-channel keys, per-token values, 2/4-bit asymmetric codes + fp16 recent tokens (Liu et al., 2024)"
    bits: int | None = None
    group: int = 32
    residual: int = 128

    def layout(self, T: int, d: int) -> tuple[int, int]:
        """(tokens quantized, channels per value group)."""
        if self.group < 1 or self.residual < 0:
            raise KVSumError(f"kivi: need group >= 1 and residual >= 0, got group={self.group}, "
                             f"residual={self.residual}")
        ch = min(self.group, d)
        if d % ch:
            raise KVSumError(f"kivi: group={self.group} does not divide the head dim {d}")
        return max(0, (T - self.residual) // self.group * self.group), ch

    def nbytes(self, H: int, T: int, d: int, bits: int, storage: torch.dtype = torch.float16) -> int:
        """Exactly what a state of (H, T, d) keys and values at `bits` holds."""
        n_q, ch = self.layout(T, d)
        codes = 2 * packed_nbytes(H * n_q * d, bits)
        scales = 2 * 2 * H * (n_q // self.group) * d + 2 * 2 * H * n_q * (d // ch)  # fp16 scale + min
        return codes + scales + 2 * H * (T - n_q) * d * storage.itemsize

    def compress(self, x: LayerInput) -> KIVIState:
        n_q, ch = self.layout(x.T, x.d)
        full = 2 * x.H * x.T * x.d * 2
        hint = f"; {x.T - n_q} of {x.T} tokens stay in full precision (a smaller residual= frees bytes)"
        bits = pick_bits("kivi", self.bits, SUPPORTED, lambda b: self.nbytes(x.H, x.T, x.d, b, x.storage),
                         x.budget_bytes, full, hint)
        return KIVIState(x.keys, x.values, bits, self.group, ch, n_q, x.storage)
