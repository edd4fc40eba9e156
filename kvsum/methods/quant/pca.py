"""Keys as query-weighted transform codes (TurboQuant's `key_basis="pca"`).

A random rotation makes every coordinate of a key equally important, which is what a data-blind quantizer
needs; but real keys are far from isotropic (in SmolLM2 the geometric over the arithmetic mean of a head's
key-covariance eigenvalues is 0.1-0.5) and the queries that read them are more anisotropic still. A query's
logit error is q.e, so over the reference queries its mean square is sum_i w_i lam_i D(b_i) on the keys'
principal axes (lam_i: key variance along axis i, w_i: mean squared query component along it, D(b): the
Lloyd-Max distortion of a unit Gaussian at b bits). D is convex, so giving bits one at a time to the axis
with the largest w_i lam_i (D(b_i) - D(b_i + 1)) minimizes it: the classic reverse water-filling, weighted by
the queries. Axes that get no bits are not stored at all. Per head: the mean (added back exactly), the
principal axes that get bits, their standard deviations and widths, in fp16/uint8, all counted.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ...state import tensor_bytes
from .codebook import encode, lloyd_max
from .packing import Packed

GAUSS_D = (1.0, 0.3634, 0.1175, 0.03454, 0.009497, 0.002499)  # Lloyd-Max MSE of N(0, 1), 0..5 bits (Max, 1960)
MAX_BITS = len(GAUSS_D) - 1  # wider codebooks take seconds to fit; the top axes rarely want more
_LAW_D = 2048  # a coordinate of a unit vector in 2048 dimensions is N(0, 1/2048) to within 1e-3


def gaussian_levels(bits: int) -> tuple[float, ...]:
    """Lloyd-Max levels of a unit Gaussian (from the codebook module's coordinate law at a large dimension)."""
    return tuple(v * math.sqrt(_LAW_D) for v in lloyd_max(bits, _LAW_D))


def allocate(weight: Tensor, total: int) -> Tensor:
    """Integer widths (d,) in 0..MAX_BITS summing to min(total, d * MAX_BITS): greedy by marginal return
    weight_i (D(b_i) - D(b_i + 1)), optimal for a convex D."""
    D = torch.tensor((*GAUSS_D, 0.0), dtype=torch.float64)
    w = weight.double().clamp_min(0)
    b = torch.zeros(weight.shape[0], dtype=torch.long)
    for _ in range(min(total, weight.shape[0] * MAX_BITS)):
        gain = torch.where(b < MAX_BITS, w * (D[b] - D[b + 1]), -1.0)
        b[int(gain.argmax())] += 1
    return b


def overhead_bits(d: int) -> int:
    """Upper bound on a head's side information: fp16 mean, axes (d x d), deviations; uint8 widths."""
    return 16 * (d + d * d + d) + 8 * d


class KeyTransform:
    """One layer's keys (H, T, d) as transform codes, `bits_per_token` code bits per head and token.

    `extend` codes decoding-time keys on the same axes and widths."""

    def __init__(self, keys: Tensor, queries: Tensor | None, bits_per_token: int):
        H, T, d = keys.shape
        self.H, self.T, self.d = H, 0, d
        self.heads = []
        for h in range(H):
            mean = keys[h].mean(0)
            x = (keys[h] - mean).double()
            lam, U = torch.linalg.eigh(x.T @ x / max(T, 1))
            w = (queries[h].double() @ U).pow(2).mean(0) if queries is not None else torch.ones_like(lam)
            b = allocate(w * lam.clamp_min(0), bits_per_token)
            used = (b > 0).nonzero()[:, 0]
            axes = U[:, used].to(torch.float16)
            std = lam[used].clamp_min(1e-12).sqrt().to(torch.float16)
            groups = [[(b[used] == k).nonzero()[:, 0], k, gaussian_levels(k), None] for k in range(1, MAX_BITS + 1)
                      if (b[used] == k).any()]
            self.heads.append(dict(mean=mean.to(torch.float16), axes=axes, std=std, widths=b[used].to(torch.uint8),
                                   groups=groups))
        self.extend(keys)

    def extend(self, keys: Tensor) -> None:
        """Code keys (H, n, d) after the current ones."""
        for h, head in enumerate(self.heads):
            z = (keys[h] - head["mean"].float()) @ head["axes"].float() / head["std"].float()
            for g in head["groups"]:
                cols, k, levels, codes = g
                c = encode(z[:, cols].contiguous(), torch.tensor(levels, device=keys.device))
                if codes is None:
                    g[3] = Packed(c, k, levels)
                else:
                    codes.append(c)
        self.T += keys.shape[1]

    def _coords(self, head: dict) -> Tensor:
        """Reconstructed coordinates on the head's axes (T, r), scaled by their deviations."""
        z = torch.zeros(self.T, head["axes"].shape[1], device=head["axes"].device)
        for cols, _, _, codes in head["groups"]:
            z[:, cols] = codes.lookup()
        return z * head["std"].float()

    def keys(self) -> Tensor:
        """Dequantized keys (H, T, d)."""
        return torch.stack([self._coords(hd) @ hd["axes"].float().t() + hd["mean"].float() for hd in self.heads])

    def scores(self, q: Tensor) -> Tensor:
        """q (1, H, M, d) against the keys -> (1, H, M, T) unscaled: the queries move onto each head's axes once;
        the mean's logit is exact."""
        out = [(q[0, h] @ hd["axes"].float()) @ self._coords(hd).t() + (q[0, h] @ hd["mean"].float())[:, None]
               for h, hd in enumerate(self.heads)]
        return torch.stack(out)[None]

    def nbytes(self) -> int:
        n = 0
        for hd in self.heads:
            n += tensor_bytes(hd["mean"], hd["axes"], hd["std"], hd["widths"])
            n += sum(codes.nbytes() + 4 * 2 ** k for _, k, _, codes in hd["groups"])  # fp32 levels, as TurboQuant
        return n


def key_bits_per_token(budget_bytes: int, H: int, T: int, d: int) -> int:
    """Code bits per head and token that keep a KeyTransform of (H, T, d) keys within `budget_bytes`: the side
    information, the codebooks and each width's packing padding are taken off first."""
    side = overhead_bits(d) + 8 * sum(k + 4 * 2 ** k for k in range(1, MAX_BITS + 1))
    return max(0, (8 * budget_bytes - H * side) // max(H * T, 1))
