"""The seeded orthogonal rotations TurboQuant codes in: a dense Haar-random matrix, or a seeded-sign Hadamard.

A random rotation makes every coordinate of a unit vector follow one known law, so one precomputed codebook
serves any input. Both kinds are regenerated from their seed; what a state holds (and is charged for) is the
dense matrix in fp16 (d*d*2 bytes), or only the d seeded signs beside a Hadamard matrix shared by every
layer (a constant, like the codebooks).
"""

from __future__ import annotations

import functools
import math

import numpy as np
import scipy.linalg
import torch
from torch import Tensor

from ...errors import KVSumError
from ...state import tensor_bytes

ROTATIONS = ("qr", "hadamard")


def gaussian(d: int, seed: int) -> Tensor:
    """A seeded (d, d) standard Gaussian matrix (float64)."""
    return torch.randn(d, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def haar(d: int, seed: int) -> Tensor:
    """A Haar-random orthogonal (d, d) matrix (float64): QR of a Gaussian, signs fixed by R's diagonal.
    (numpy's QR: torch.linalg.qr takes milliseconds even on tiny CPU matrices.)"""
    q, r = np.linalg.qr(gaussian(d, seed).numpy())
    return torch.from_numpy(q * np.sign(np.diagonal(r)))


@functools.lru_cache(maxsize=8)
def _hadamard(d: int, device: str) -> Tensor:
    """The Sylvester Hadamard matrix over sqrt(d) (orthogonal, symmetric), one per head dim per process."""
    return torch.from_numpy(scipy.linalg.hadamard(d) / math.sqrt(d)).float().to(device)


def hadamard_fits(d: int) -> bool:
    """Whether the Sylvester Hadamard rotation exists at head dim d (a power of 2)."""
    return d > 0 and not d & (d - 1)


class Rotation:
    """x -> x R^T (`apply`) and back (`undo`), R orthogonal and seeded. "qr": Haar-random R held in fp16 (d*d*2
    bytes per layer). "hadamard": R = H diag(s) / sqrt(d), the Sylvester Hadamard matrix H shared by every layer
    and d seeded signs s per layer (d bytes); the better choice where the head dim is large beside the KV heads'
    tokens. Needs d a power of 2."""

    def __init__(self, d: int, seed: int, kind: str, device):
        self.kind = kind
        self.R = self.signs = None
        if kind == "qr":
            self.R = haar(d, seed).to(torch.float16).to(device)
        elif not hadamard_fits(d):
            raise KVSumError(f"turboquant: rotation='hadamard' needs a power-of-2 head dim, got {d}; use 'qr'")
        else:
            g = torch.Generator().manual_seed(seed)
            self.signs = (torch.randint(0, 2, (d,), generator=g) * 2 - 1).to(torch.int8).to(device)

    def apply(self, x: Tensor) -> Tensor:
        if self.R is not None:
            return x @ self.R.float().t()
        return (x * self.signs) @ _hadamard(x.shape[-1], str(x.device))  # H symmetric: H^T = H

    def undo(self, y: Tensor) -> Tensor:
        if self.R is not None:
            return y @ self.R.float()
        return (y @ _hadamard(y.shape[-1], str(y.device))) * self.signs

    def nbytes(self) -> int:
        return tensor_bytes(self.R, self.signs)

    @staticmethod
    def planned_nbytes(d: int, kind: str) -> int:
        """What `nbytes` will be, before the rotation is built (for budget planning)."""
        return d * d * 2 if kind == "qr" else d
