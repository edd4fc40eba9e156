"""KIVI (Liu et al., 2024): asymmetric min/max integer codes, keys per channel and values per token.

Keys have fixed outlier channels, so each key channel gets its own min and scale over a group of
`group` tokens; values are grouped along channels within each token. The newest `residual` prompt
tokens (plus the ones that do not fill a whole key group) stay in full precision, and so may the first
`sinks` (not in the paper, off by default). During decoding the generated tokens join that window, and its
oldest whole group is quantized as soon as the window holds more than `residual` + `group` tokens
(kvsum.compress attaches the stream).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import Tensor

from ... import kernels
from ...errors import KVSumError
from ...kernels import online
from ...state import tensor_bytes
from ..base import LayerInput, Plan
from ..quantizer import Quantizer
from ..registry import register
from . import native
from .packing import Packed, packed_nbytes, pick_bits
from .stream import QuantStream

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


def _ints(bits: int) -> tuple[float, ...]:
    """The integer codes as levels, so packed codes decode through one table lookup."""
    return tuple(float(i) for i in range(2 ** bits))


@functools.lru_cache(maxsize=4)
def _int_levels(bits: int) -> Tensor:
    """_ints as the float32 tensor the kernel reads (a constant, shared like the codebooks)."""
    return torch.tensor(_ints(bits), dtype=torch.float32)


class KIVIState:
    """The first `sinks` tokens in full precision (`storage`), the next n_q as packed codes (keys per channel
    over `group` tokens, values per token over `ch_group` channels), the newest ones in full precision.

    Codes, scales and zero points are held token-major (groups of tokens first), so `extend` appends
    decoding-time groups to the same stores."""

    def __init__(self, keys: Tensor, values: Tensor, bits: int, group: int, ch_group: int, n_q: int,
                 storage: torch.dtype, sinks: int = 0):
        self.H, _, self.d = keys.shape
        self.bits, self.group, self.ch_group, self.storage = bits, group, ch_group, storage
        self.sinks = sinks
        self.k_sink, self.v_sink = keys[:, :sinks].to(storage), values[:, :sinks].to(storage)
        self.n_q, self.T = 0, sinks
        self.k_res, self.v_res = keys[:, :0].to(storage), values[:, :0].to(storage)
        self.k_codes = self.v_codes = None
        self.extend(keys[:, sinks:], values[:, sinks:], n_q)

    def pending(self) -> int:
        """Tokens held in full precision after the codes (the sinks before them are never quantized)."""
        return self.T - self.sinks - self.n_q

    def extend(self, keys: Tensor, values: Tensor, quantize: int) -> None:
        """Append keys and values (H, n, d) in full precision, then quantize the `quantize` oldest full-precision
        tokens (a multiple of the group)."""
        if quantize % self.group or quantize > self.pending() + keys.shape[1]:
            raise ValueError(f"kivi: cannot quantize {quantize} tokens in groups of {self.group}")
        H, d, g, ch = self.H, self.d, self.group, self.ch_group
        k = torch.cat([self.k_res.float(), keys], 1)
        v = torch.cat([self.v_res.float(), values], 1)
        kq, vq = k[:, :quantize], v[:, :quantize]
        kc, k_scale, k_min = minmax_codes(kq.reshape(H, quantize // g, g, d).transpose(0, 1), 2, self.bits)
        vc, v_scale, v_min = minmax_codes(vq.reshape(H, quantize, d // ch, ch).transpose(0, 1), 3, self.bits)
        if self.k_codes is None:
            levels = _ints(self.bits)
            self.k_codes, self.v_codes = Packed(kc, self.bits, levels), Packed(vc, self.bits, levels)
            self.k_scale, self.k_min, self.v_scale, self.v_min = k_scale, k_min, v_scale, v_min
        else:
            self.k_codes.append(kc)
            self.v_codes.append(vc)
            self.k_scale, self.k_min = torch.cat([self.k_scale, k_scale]), torch.cat([self.k_min, k_min])
            self.v_scale, self.v_min = torch.cat([self.v_scale, v_scale]), torch.cat([self.v_min, v_min])
        self.k_res, self.v_res = k[:, quantize:].to(self.storage), v[:, quantize:].to(self.storage)
        self.n_q += quantize
        self.T += keys.shape[1]

    def lengths(self) -> list[int]:
        return [self.T] * self.H

    def nbytes(self) -> int:
        return self.k_codes.nbytes() + self.v_codes.nbytes() + tensor_bytes(
            self.k_scale, self.k_min, self.v_scale, self.v_min, self.k_res, self.v_res, self.k_sink, self.v_sink)

    def keys(self) -> Tensor:
        """All keys (H, T, d): the sinks, the dequantized codes, then the full-precision residual."""
        k = self.k_codes.lookup() * self.k_scale.float() + self.k_min.float()  # (G, H, group, d)
        return torch.cat([self.k_sink.float(), k.transpose(0, 1).reshape(self.H, self.n_q, self.d),
                          self.k_res.float()], 1)

    def values(self) -> Tensor:
        v = self.v_codes.lookup() * self.v_scale.float() + self.v_min.float()  # (n_q, H, d/ch, ch)
        return torch.cat([self.v_sink.float(), v.transpose(0, 1).reshape(self.H, self.n_q, self.d),
                          self.v_res.float()], 1)

    def _native(self, rows: int) -> bool:
        """Whether the packed-code kernel (native.py) reads the codes where they lie, for `rows` query rows per
        KV head; elsewhere attention dequantizes every code first."""
        return (self.n_q > 0 and self.d % 8 == 0 and self.ch_group % 8 == 0
                and native.serves(rows, self.k_codes, self.v_codes))

    def scores(self, q: Tensor, scale: float) -> Tensor:
        if not self._native(q.shape[2]):
            return q @ self.keys().transpose(-1, -2) * scale
        # k = code * scale + min per (group, channel): the scale folds into one query per group, the min into
        # one logit per group
        qh, G = q[0], self.n_q // self.group
        s = native.score_groups(self.k_codes, _int_levels(self.bits), qh[None] * self.k_scale.float())  # (H, M, n_q)
        base = (qh[None] * self.k_min.float()).sum(-1).permute(1, 2, 0)  # (H, M, G)
        s = (s.view(self.H, -1, G, self.group) + base[..., None]).view(self.H, -1, self.n_q)
        # the exact sinks' and window's logits only where they hold tokens (this runs at every decoding step)
        parts = [qh @ self.k_sink.float().transpose(-1, -2)] if self.sinks else []
        parts.append(s)
        if self.pending():
            parts.append(qh @ self.k_res.float().transpose(-1, -2))
        return (torch.cat(parts, -1) if len(parts) > 1 else s).mul_(scale)[None]

    def online(self, q: Tensor, scale: float) -> list | None:
        """On CUDA, a decoding step over the codes in one fused pass (kvsum/kernels/kivi.py's `attend`): its stacked
        partials, and the exact sinks and window for joint attention to read with the tail (kvsum/kernels/online.py);
        None where that kernel does not serve."""
        if not (kernels.serves(self.k_scale) and self._native(q.shape[2])):  # the cheap check first: CPU steps
            return None
        from ...kernels import kivi as gpu

        parts = [gpu.attend(self.k_codes, self.v_codes, _int_levels(self.bits), q[0], self.k_scale, self.k_min,
                            self.v_scale, self.v_min, scale)]
        return parts + [online.Exact(k, v) for k, v in ((self.k_sink, self.v_sink), (self.k_res, self.v_res))
                        if k.shape[1]]

    def mix(self, p: Tensor) -> Tensor:
        if not self._native(p.shape[2]):
            return p @ self.values()
        # v = code * scale + min per (token, run of channels), both applied inside the kernel
        s, e = self.sinks, self.sinks + self.n_q
        out = native.mix_runs(self.v_codes, _int_levels(self.bits), p[0, :, :, s:e],
                              self.v_scale[..., 0].permute(2, 1, 0), self.v_min[..., 0].permute(2, 1, 0))
        if s:
            out = out + p[0, :, :, :s] @ self.v_sink.float()
        if self.pending():
            out = out + p[0, :, :, e:] @ self.v_res.float()
        return out[None]


@register
@dataclass(frozen=True)
class KIVI(Quantizer):
    """Asymmetric min/max integer codes: keys per channel over groups of tokens, values per token over groups of
    channels, the newest prompt tokens in full precision.

    Attributes:
        bits: 2 or 4; None: the largest that fits the budget.
        group: tokens per key scale and channels per value scale (at most the head dim).
        residual: the newest prompt tokens kept in full precision (the decoding window too).
        sinks: the first prompt tokens kept in full precision; the paper codes them (0), but an attention
            sink's key is an outlier in its group and its codes widen the group's scales.
    """

    name = "kivi"
    summary = "per-channel keys, per-token values, 2/4-bit asymmetric codes + fp16 recent tokens (Liu et al., 2024)"
    supported_bits = SUPPORTED
    default_bits = 2
    exact_knobs = ("sinks",)

    bits: int | None = None
    group: int = 32
    residual: int = 128
    sinks: int = 0

    def layout(self, T: int, d: int) -> tuple[int, int]:
        """(tokens quantized, channels per value group)."""
        if self.group < 1 or self.residual < 0:
            raise KVSumError(f"kivi: need group >= 1 and residual >= 0, got group={self.group}, "
                             f"residual={self.residual}")
        ch = min(self.group, d)
        if d % ch:
            raise KVSumError(f"kivi: group={self.group} does not divide the head dim {d}")
        return max(0, (T - min(self.sinks, T) - self.residual) // self.group * self.group), ch

    def nbytes(self, H: int, T: int, d: int, bits: int, *, shift: int = 0,
               storage: torch.dtype = torch.float16) -> int:
        """Exactly what a state of (H, T, d) keys and values at `bits` holds (exact tokens in `storage`; keys
        are not shifted between layers)."""
        n_q, ch = self.layout(T, d)
        codes = 2 * packed_nbytes(H * n_q * d, bits)
        scales = 2 * 2 * H * (n_q // self.group) * d + 2 * 2 * H * n_q * (d // ch)  # fp16 scale + min
        return codes + scales + 2 * H * (T - n_q) * d * storage.itemsize

    def compress(self, x: LayerInput, plan: Plan | None = None) -> KIVIState:
        n_q, ch = self.layout(x.T, x.d)
        full = 2 * x.H * x.T * x.d * 2
        hint = f"; {x.T - n_q} of {x.T} tokens stay in full precision (a smaller residual= frees bytes)"
        bits = pick_bits("kivi", self.bits, SUPPORTED, lambda b: self.nbytes(x.H, x.T, x.d, b, storage=x.storage),
                         x.budget_bytes, full, hint)
        return self.build(x.keys, x.values, bits, storage=x.storage)

    def build(self, keys: Tensor, values: Tensor, bits: int, *, layer_idx: int = 0, shift: int = 0,
              storage: torch.dtype = torch.float16, decoded: bool = False, queries: Tensor | None = None,
              n_q: int | None = None) -> KIVIState:
        """The state of keys and values (H, T, d) fp32: the first `sinks` exact, the next `n_q` quantized
        (default: the whole groups before the `residual` window); `decoded` tokens are all quantized, none of
        them a sink (T a multiple of the group). Codes do not depend on the layer, a key shift or queries."""
        T = keys.shape[1]
        layout_n, ch = self.layout(T, keys.shape[2])
        sinks = 0 if decoded else min(self.sinks, T)
        n_q = T if decoded else layout_n if n_q is None else n_q
        return KIVIState(keys, values, bits, self.group, ch, n_q, storage, sinks)

    def stream(self, layer_idx: int, state) -> QuantStream | None:
        return QuantStream(self.group, self.residual, live=state) if isinstance(state, KIVIState) else None
