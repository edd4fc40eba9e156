"""Lloyd-Max codebooks for one coordinate of a randomly rotated unit vector.

After a uniformly random rotation, each coordinate x of a unit vector in dimension d has density
proportional to (1 - x^2)^((d - 3) / 2) on [-1, 1], i.e. (x + 1) / 2 ~ Beta(a, a) with a = (d - 1) / 2;
close to N(0, 1/d). The optimal scalar quantizer for that law is data-independent, so it is computed
once per (bits, d). Lloyd's conditions: each boundary is the midpoint of its two levels, each level is
the conditional mean of its cell. The partial first moment has a closed form through the Beta CDF,
E[Y; Y < y] = 1/2 I_y(a + 1, a) for Y ~ Beta(a, a), which keeps every iteration vectorized.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch
from scipy import stats
from torch import Tensor


def coordinate_law(d: int):
    """scipy distribution of one coordinate of a uniformly random unit vector in dimension d >= 2."""
    a = (d - 1) / 2
    return stats.beta(a, a, loc=-1, scale=2)


def _cell_means(d: int):
    """A function: edges (in [-1, 1]) -> conditional means of the coordinate law on the cells between them."""
    a = (d - 1) / 2
    law, first_moment = stats.beta(a, a), stats.beta(a + 1, a)

    def means(edges: np.ndarray) -> np.ndarray:
        y = (edges + 1) / 2
        mass = np.diff(law.cdf(y))
        moment_y = 0.5 * np.diff(first_moment.cdf(y))  # E[Y; cell]
        return (2 * moment_y - mass) / np.maximum(mass, 1e-300)  # X = 2Y - 1

    return means


def lloyd(levels: np.ndarray, cell_means, lo: float, hi: float, tol: float, max_iter: int) -> np.ndarray:
    """Lloyd's iteration for a symmetric law on [lo, hi] from initial levels: boundaries at the midpoints of
    neighbouring levels, levels at the conditional means of their cells (`cell_means(edges)`), kept exactly
    symmetric, until no level moves by `tol`."""
    for _ in range(max_iter):
        edges = np.concatenate([[lo], (levels[1:] + levels[:-1]) / 2, [hi]])
        new = cell_means(edges)
        new = (new - new[::-1]) / 2
        done = np.max(np.abs(new - levels)) < tol
        levels = new
        if done:
            break
    return levels


@lru_cache(maxsize=64)
def lloyd_max(bits: int, d: int, tol: float = 1e-12, max_iter: int = 100_000) -> tuple[float, ...]:
    """The 2**bits Lloyd-Max levels (ascending) for the coordinate law in dimension d."""
    if not 1 <= bits <= 8 or d < 2:
        raise ValueError(f"need 1 <= bits <= 8 and d >= 2, got bits={bits}, d={d}")
    n = 2 ** bits
    levels = coordinate_law(d).ppf((np.arange(n) + 0.5) / n)
    levels = lloyd(levels, _cell_means(d), -1.0, 1.0, tol / np.sqrt(d), max_iter)
    return tuple(float(v) for v in levels)


def codebook(bits: int, d: int, device=None) -> Tensor:
    """Levels as a float32 tensor (2**bits,)."""
    return torch.tensor(lloyd_max(bits, d), dtype=torch.float32, device=device)


def encode(y: Tensor, levels: Tensor) -> Tensor:
    """Index of the nearest level for every coordinate of y, as uint8: the count of cell boundaries below it.
    Up to 5 bits one comparison per boundary beats torch.bucketize's binary search several times over."""
    bounds = (levels[1:] + levels[:-1]) / 2
    if len(bounds) > 31:
        return torch.bucketize(y, bounds).to(torch.uint8)
    code = torch.zeros(y.shape, dtype=torch.uint8, device=y.device)
    for b in bounds.tolist():
        code += y > b
    return code
