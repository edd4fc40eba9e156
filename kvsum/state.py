"""What a compressed layer holds, and how attention reads it.

A `LayerState` is the compressed part of one layer (one sequence, all KV heads). Attention asks it
for the scores of the grouped queries against its entries (bias included) and for the values
weighted by the softmax probabilities; the attention function joins these with the
full-precision tail in one softmax, so the result is exact for whatever the state holds.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor

from . import kernels
from .errors import KVSumError
from .kernels import online


class LayerState(Protocol):
    """The compressed part of one layer. Implemented by `EntryState` and by methods with their own storage."""

    def scores(self, q: Tensor, scale: float) -> Tensor:
        """q: (1, H, M, d) fp32 queries grouped by KV head -> (1, H, M, N) logits, -inf where not attendable."""

    def mix(self, p: Tensor) -> Tensor:
        """p: (1, H, M, N) probabilities -> (1, H, M, d) fp32 weighted values."""

    def nbytes(self) -> int:
        """Bytes of every tensor held."""

    def lengths(self) -> list[int]:
        """Entries held per KV head."""


MASKED_MAX = 1024  # ragged entries up to which EntryState reads all heads in one masked matmul (see _masked)
KERNEL_ROWS = 16  # query rows per KV head up to which ragged heads on CUDA are read by the Triton kernels


def tensor_bytes(*tensors: Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


class EntryState:
    """Entries (key, value, optional additive log-mass bias) per KV head, stored packed.

    Heads may hold different numbers of entries: they are packed one after another into a single
    (sum of lengths, d) tensor, so nothing is padded and dropped entries take no memory. With equal
    lengths the packed tensor is viewed as (1, H, n, d) for batched matmuls; with ragged lengths each head's
    queries are scored against that head's own slice (scores padded with -inf to the longest head), or, up to
    MASKED_MAX entries in all, against all of them in one matmul with the other heads' entries masked. On CUDA a
    decoding step reads ragged heads with one Triton launch per layer (kvsum/kernels/ragged.py), padded likewise.
    """

    def __init__(self, keys: list[Tensor], values: list[Tensor], bias: list[Tensor] | None = None,
                 dtype: torch.dtype = torch.float16):
        if len(keys) != len(values) or (bias is not None and len(bias) != len(keys)):
            raise KVSumError("EntryState: keys, values and bias need one tensor per KV head, got "
                             f"{len(keys)}, {len(values)} and {len(bias) if bias is not None else 'no'} bias")
        self.H = len(keys)
        self._lengths = [int(k.shape[0]) for k in keys]
        self.keys = torch.cat(keys).to(dtype).contiguous()
        self.values = torch.cat(values).to(dtype).contiguous()
        self.bias = torch.cat(bias).to(dtype).contiguous() if bias is not None else None
        self.uniform = len(set(self._lengths)) == 1
        if not self.uniform:
            # head index of every packed entry: int8 for <=127 heads, counted in nbytes.
            idx_dtype = torch.int8 if self.H <= 127 else torch.int16
            self.head_of = torch.repeat_interleave(
                torch.arange(self.H, dtype=idx_dtype), torch.tensor(self._lengths)).to(self.keys.device)
        else:
            self.head_of = None

    def lengths(self) -> list[int]:
        return list(self._lengths)

    def nbytes(self) -> int:
        return tensor_bytes(self.keys, self.values, self.bias, self.head_of)

    def scores(self, q: Tensor, scale: float) -> Tensor:
        if self.uniform:
            n = self._lengths[0]
            s = q @ self.keys.view(1, self.H, n, self.keys.shape[-1]).float().transpose(-1, -2) * scale  # n may be 0
            if self.bias is not None:
                s = s + self.bias.view(1, self.H, 1, n).float()
            return s
        if self._kernel(q.shape[2]):  # CUDA: one launch over every head's own entries (kvsum/kernels/ragged.py)
            from .kernels import ragged
            return ragged.scores(q[0], self.keys, self.bias, self._starts(), max(self._lengths), scale)[None]
        if self._masked():  # few entries: one matmul over all of them, the other heads' entries masked
            H, M, d = q.shape[1:]
            q2, k = q.reshape(H * M, d), self.keys.float().t()
            s = q2 @ k * scale if self.bias is None else torch.addmm(self.bias.float(), q2, k, alpha=scale)
            return s.view(H, M, -1).masked_fill_(self._foreign()[:, None, :], float("-inf"))[None]
        # many: one matmul per head over its own entries, padded with -inf to the longest head
        s = q.new_full((*q.shape[:3], max(self._lengths)), float("-inf"))
        for h, (a, n) in enumerate(self._slices()):
            if n:
                s[0, h, :, :n] = q[0, h] @ self.keys[a:a + n].float().t()
        s.mul_(scale)
        if self.bias is not None:
            for h, (a, n) in enumerate(self._slices()):
                s[0, h, :, :n] += self.bias[a:a + n].float()
        return s

    def exact(self) -> online.Exact | None:
        """The entries as (H, n, d) keys and values where every head holds n and there is no bias (exact sinks):
        joint attention then reads them in one product with the tail."""
        if not self.uniform or self.bias is not None:
            return None
        n, d = self._lengths[0], self.keys.shape[-1]
        return online.Exact(self.keys.view(self.H, n, d), self.values.view(self.H, n, d))

    def _kernel(self, rows: int) -> bool:
        """Whether ragged heads are read by the Triton kernels: CUDA tensors, a decoding step's rows."""
        return rows <= KERNEL_ROWS and kernels.serves(self.keys)

    def _starts(self) -> Tensor:
        return kernels.offsets(self._lengths, self.keys.device)

    def _masked(self) -> bool:
        """Whether ragged heads are read in one masked matmul (H times the products, a few operations) rather
        than one matmul per head (about ten small operations a head): the former wins on few entries in all,
        the latter on many (MASKED_MAX is the crossover)."""
        return self.keys.shape[0] <= MASKED_MAX

    def _foreign(self) -> Tensor:
        """(H, N) bool: entry n belongs to another head than h."""
        return self.head_of[None, :] != torch.arange(self.H, device=self.keys.device, dtype=self.head_of.dtype)[:, None]

    def _slices(self):
        start = 0
        for n in self._lengths:
            yield start, n
            start += n

    def mix(self, p: Tensor) -> Tensor:
        if self.uniform:
            return p @ self.values.view(1, self.H, self._lengths[0], self.values.shape[-1]).float()
        if self._kernel(p.shape[2]):  # p (1, H, M, longest head), as the kernel's scores were
            from .kernels import ragged
            return ragged.mix(p[0], self.values, self._starts())[None]
        if self._masked():
            return p @ self.values.float()  # the other heads' entries have probability 0
        out = p.new_zeros(*p.shape[:3], self.values.shape[-1])
        for h, (a, n) in enumerate(self._slices()):
            if n:
                out[0, h] = p[0, h, :, :n] @ self.values[a:a + n].float()
        return out


class ConcatState:
    """Several states attended as one: their entries side by side in the same softmax."""

    def __init__(self, parts: list):
        self.parts = [p for p in parts if p is not None]

    def scores(self, q: Tensor, scale: float) -> Tensor:
        s = [p.scores(q, scale) for p in self.parts]
        self._sizes = [x.shape[-1] for x in s]
        return torch.cat(s, dim=-1)

    def mix(self, p: Tensor) -> Tensor:
        return sum(part.mix(chunk) for part, chunk in zip(self.parts, p.split(self._sizes, dim=-1)))

    def online(self, q: Tensor, scale: float) -> list | None:
        """The parts as stacked partial softmax results (kvsum/kernels/online.py) where some part has a fused kernel
        that serves (TurboQuant's codes on CUDA); the others as their exact entries where they are plain ones, else
        through their scores and mix. None where no part has a fused kernel."""
        got = [getattr(p, "online", lambda *a: None)(q, scale) for p in self.parts]
        if all(g is None for g in got):
            return None
        out = []
        for part, g in zip(self.parts, got):
            if g is None:
                g = [getattr(part, "exact", lambda: None)() or online.from_scores(
                    part.scores(q, scale)[0], lambda w, part=part: part.mix(w[None])[0])]
            out += g
        return out

    def nbytes(self) -> int:
        return sum(p.nbytes() for p in self.parts)

    def lengths(self) -> list[int]:
        return [sum(n) for n in zip(*(p.lengths() for p in self.parts))]

    @property
    def note(self) -> str:
        """What the state or any part degraded to fit its budget ("" when nothing was)."""
        notes = [getattr(self, "_note", ""), *(getattr(p, "note", "") for p in self.parts)]
        return "; ".join(dict.fromkeys(n for n in notes if n))

    @note.setter
    def note(self, value: str) -> None:
        self._note = value


class BatchState:
    """One compressed state per sequence of a batch; each was compressed alone, so lengths are ragged
    across sequences (and heads) and held for real. Attention loops over the sequences."""

    per_sequence = True

    def __init__(self, states: list[LayerState]):
        self.states = list(states)

    @classmethod
    def of(cls, state) -> BatchState:
        """`state` as a BatchState (a single sequence's state becomes a batch of one)."""
        return state if isinstance(state, BatchState) else cls([state])

    def __len__(self) -> int:
        return len(self.states)

    def nbytes(self) -> int:
        # a state repeated for beams or samples is one object, held once
        return sum(s.nbytes() for s in {id(s): s for s in self.states}.values())

    def lengths(self) -> list[int]:
        """Entries held per KV head, summed over the sequences."""
        return [sum(n) for n in zip(*(s.lengths() for s in self.states))]

    def select(self, index) -> BatchState:
        return BatchState([self.states[int(i)] for i in index])
