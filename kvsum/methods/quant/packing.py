"""Bit-level storage for quantization states: packed b-bit codes, their byte count, bit widths that fit a budget.

Codes are packed eight at a time into `bits` bytes (8 codes x b bits = b bytes), so any width from 1 to 8
bits, 3 included, takes exactly b bits per code plus at most b bytes of padding per tensor.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from ...errors import KVSumError
from ..refusal import budget_hint
from . import native


def packed_nbytes(n: int, bits: int) -> int:
    """Bytes that `n` codes of `bits` bits take once packed."""
    return math.ceil(n / 8) * bits


def pack(codes: Tensor, bits: int) -> Tensor:
    """Integer codes in [0, 2**bits) of any shape -> flat uint8 tensor of packed_nbytes(codes.numel(), bits).

    Every 8 codes become one little-endian word of 8 * bits bits, code j at bit bits * j, stored as its `bits`
    bytes (for widths that divide 8: whole codes per byte, code j of a byte at bit bits * j)."""
    if not 1 <= bits <= 8:
        raise ValueError(f"bits must be in 1..8, got {bits}")
    flat = codes.reshape(-1).to(torch.uint8)
    pad = (-flat.numel()) % 8
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    per = 8 // bits if 8 % bits == 0 else 8  # codes per word: a byte, or 8 codes in `bits` bytes
    size = per * bits // 8  # bytes per word
    g = flat.view(-1, per).to(torch.uint8 if size == 1 else torch.int32 if size < 4 else torch.int64)
    word = g[:, 0].clone()
    for j in range(1, per):  # OR-ed in one column at a time: a reduction over a short last dim is slow
        word |= g[:, j] << (bits * j)
    if size == 1:
        return word
    return torch.stack([(word >> (8 * i)).to(torch.uint8) for i in range(size)], 1).reshape(-1)  # low byte of each


def unpack(packed: Tensor, bits: int, n: int) -> Tensor:
    """Inverse of `pack`: the first `n` codes, as a flat uint8 tensor.

    Runs at every decode step, so it does the least work: for widths that divide 8 each byte holds whole
    codes (one shift-and-mask broadcast); otherwise every `bits` bytes are read as one little-endian word
    that holds 8 codes."""
    mask = (1 << bits) - 1
    if 8 % bits == 0:
        shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
        return ((packed.view(-1, 1) >> shifts) & mask).reshape(-1)[:n]
    groups = packed.view(-1, bits).long()
    word = (groups << (8 * torch.arange(bits, device=packed.device))).sum(-1)
    codes = (word[:, None] >> (bits * torch.arange(8, device=packed.device))) & mask
    return codes.to(torch.uint8).reshape(-1)[:n]


def word_codes(bits: int) -> int:
    """Codes per lookup word: a byte for widths that divide 8; otherwise the most codes (a divisor of 8) in
    at most 12 bits, so that tables stay small: 4 codes at 3 bits, 2 at 5 and 6, 1 at 7."""
    return 8 // bits if 8 % bits == 0 else max(k for k in (1, 2, 4) if k * bits <= 12)


@functools.lru_cache(maxsize=32)
def level_table(levels: tuple[float, ...], bits: int, device: str = "cpu") -> Tensor:
    """(2**(k*bits), k) float32: the levels of the k codes one lookup word holds, for every word value.

    One table per (levels, bits) per process, shared by every layer and cache like the codebooks it is built
    from (2 KiB at 4 bits, 64 KiB at 3, 8 KiB at 5); decoding then reads one row per word instead of unpacking codes."""
    k = word_codes(bits)
    word = torch.arange(2 ** (k * bits))
    lv = torch.tensor(levels, dtype=torch.float32)
    return torch.stack([lv[(word >> (bits * i)) & ((1 << bits) - 1)] for i in range(k)], 1).to(device)


class Packed:
    """A tensor of b-bit codes held packed; `codes()` unpacks it to its shape (uint8).

    `append` grows it along its first dimension in place, still one packed store (decoding-time
    quantization appends a group of tokens at a time, so states keep tokens on the first dimension).
    A saved cache holds the codes, not the word table: the table is the process's own (`transient`), and
    `restore` resolves it again on load."""

    transient = ("table",)

    def __init__(self, codes: Tensor, bits: int, levels: tuple[float, ...] | None = None):
        self.bits, self.shape, self.levels = bits, tuple(codes.shape), levels
        self.data = pack(codes, bits)
        self.restore()

    def restore(self) -> None:
        """Resolve the shared word table once here rather than at every decoding step."""
        self.table = level_table(self.levels, self.bits, str(self.data.device)) if self.levels else None
        if self.levels:
            native.library()  # the kernel that reads such codes is built now (once), not in a decoding step

    def codes(self) -> Tensor:
        return unpack(self.data, self.bits, math.prod(self.shape)).view(self.shape)

    def lookup(self) -> Tensor:
        """levels[codes] as float32 in the codes' shape (the levels given at construction), straight from the
        packed bytes through `level_table`."""
        if self.levels is None:
            raise ValueError("Packed.lookup needs the codes' levels, given at construction")
        n = math.prod(self.shape)
        b, k = self.bits, word_codes(self.bits)
        if 8 % b:  # 8 codes in b little-endian bytes, read as 8 / k words of k codes, each from <= 2 bytes
            g, kb, words = self.data.view(-1, b).int(), k * b, []
            for start in range(0, 8 * b, kb):
                a, end = start // 8, (start + kb - 1) // 8
                w = g[:, a] if end == a else g[:, a] | (g[:, end] << 8)
                words.append((w >> (start - 8 * a)) & ((1 << kb) - 1))
            words = torch.stack(words, 1).view(-1)
        else:
            words = self.data.int()
        return self.table.index_select(0, words).view(-1)[:n].view(self.shape)

    def append(self, codes: Tensor) -> None:
        """Add codes of shape (n, *shape[1:]) after the current ones."""
        if tuple(codes.shape[1:]) != self.shape[1:]:
            raise ValueError(f"cannot append codes of shape {tuple(codes.shape)} to {self.shape}")
        rest = math.prod(self.shape) % 8  # codes in the padded last group of 8 (its `bits` bytes), repacked with
        if rest:  # the new ones; the groups before it stay as they are
            tail = unpack(self.data[-self.bits:], self.bits, rest)
            self.data = torch.cat([self.data[:-self.bits], pack(torch.cat([tail, codes.reshape(-1).to(torch.uint8)]),
                                                                 self.bits)])
        else:
            self.data = torch.cat([self.data, pack(codes, self.bits)])
        self.shape = (self.shape[0] + codes.shape[0], *self.shape[1:])

    def nbytes(self) -> int:
        return self.data.numel()


def pick_bits(method: str, bits, supported: Sequence, need: Callable[[float], int], budget_bytes: float,
              full_bytes: float, hint: str = "", ceiling: float | None = None):
    """The configured bit width if it fits the layer's budget, the largest supported one that fits if `bits`
    is None; otherwise a KVSumError that says what each width needs, which fit, and the smallest budget that
    fits (the least of the width's bytes and `ceiling`, what the method holds where no width fits)."""
    if bits is not None and bits not in supported:
        raise KVSumError(f"{method}: bits={bits!r} is not supported; accepted: "
                         f"{', '.join(map(str, supported))} or None (largest that fits the budget)")
    fits = [b for b in sorted(supported, reverse=True) if need(b) <= budget_bytes]
    if bits is None:
        if fits:
            return fits[0]
        low = min(supported)
        raise KVSumError(f"{method}: no supported bit width fits the budget {budget_bytes / full_bytes:.3f}; "
                         f"the smallest, bits={low}, needs {need(low) / full_bytes:.3f} of the full cache{hint}; "
                         f"{budget_hint(min(need(low), ceiling or need(low)), full_bytes)}")
    if bits not in fits:
        which = f"bits that fit: {', '.join(map(str, fits))}" if fits else "no supported bit width fits"
        raise KVSumError(f"{method}: bits={bits} needs {need(bits) / full_bytes:.3f} of the full cache, more than "
                         f"the budget {budget_bytes / full_bytes:.3f}; {which} (bits=None picks the largest){hint}; "
                         f"{budget_hint(min(need(bits), ceiling or need(bits)), full_bytes)}")
    return bits
