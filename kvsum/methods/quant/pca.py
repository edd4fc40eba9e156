"""Keys as query-weighted transform codes (TurboQuant's `key_basis="pca"`).

A random rotation makes every coordinate of a key equally important, which is what a data-blind quantizer
needs; but real keys are far from isotropic (a head's key-covariance eigenvalues spread widely; see
docs/results/quant.md) and the queries that read them are more anisotropic still. A query's
logit error is q.e, so over the reference queries its mean square is sum_i w_i lam_i D(b_i) on the keys'
principal axes (lam_i: key variance along axis i, w_i: mean squared query component along it, D(b): the
Lloyd-Max distortion of a unit Gaussian at b bits). D is convex, so giving bits one at a time to the axis
with the largest w_i lam_i (D(b_i) - D(b_i + 1)) minimizes it: the classic reverse water-filling, weighted by
the queries. Axes that get no bits are not stored at all. Per head: the mean (added back exactly), the
principal axes that get bits, their standard deviations and widths, in fp16/uint8, all counted.
"""

from __future__ import annotations

from functools import cache

import numpy as np
import torch
from scipy import stats
from torch import Tensor

from ... import kernels
from ...rope import RopeFrame, rotate, rotate_half
from ...state import tensor_bytes
from . import native
from .codebook import encode, lloyd
from .packing import Packed, packed_nbytes

MAX_BITS = 8


@cache
def gaussian_lloyd_max(bits: int, tol: float = 1e-9, max_iter: int = 20_000) -> tuple[tuple[float, ...], float]:
    """(levels, mean squared error) of the Lloyd-Max quantizer of a unit Gaussian: the cell means have a
    closed form, (phi(a) - phi(b)) / (Phi(b) - Phi(a)) (8 bits converge in about 2 s, once per process)."""
    def cell_means(edges):
        return -np.diff(stats.norm.pdf(edges)) / np.maximum(np.diff(stats.norm.cdf(edges)), 1e-300)

    n = 2 ** bits
    levels = lloyd(stats.norm.ppf((np.arange(n) + 0.5) / n), cell_means, -np.inf, np.inf, tol, max_iter)
    # E[(X - c)^2; cell] = mass (1 + c^2) - 2 c E[X; cell] + [a phi(a) - b phi(b)]
    edges = np.concatenate([[-np.inf], (levels[1:] + levels[:-1]) / 2, [np.inf]])
    mass, pdf = np.diff(stats.norm.cdf(edges)), stats.norm.pdf(edges)
    first = -np.diff(pdf)
    xphi = np.where(np.isfinite(edges), edges, 0.0) * pdf
    mse = float(np.sum(mass * (1 + levels ** 2) - 2 * levels * first - np.diff(xphi)))
    return tuple(float(v) for v in levels), mse


def gaussian_levels(bits: int) -> tuple[float, ...]:
    return gaussian_lloyd_max(bits)[0]


def allocate(weight: Tensor, total: int) -> Tensor:
    """Integer widths (d,) in 0..MAX_BITS summing to min(total, d * MAX_BITS): greedy by marginal return
    weight_i (D(b_i) - D(b_i + 1)), optimal for a convex D."""
    D = torch.tensor([1.0, *(gaussian_lloyd_max(b)[1] for b in range(1, MAX_BITS + 1)), 0.0], dtype=torch.float64)
    w = weight.double().clamp_min(0).cpu()  # a greedy loop over d widths: metadata, on the CPU whatever the keys
    b = torch.zeros(weight.shape[0], dtype=torch.long)
    for _ in range(min(total, weight.shape[0] * MAX_BITS)):
        gain = torch.where(b < MAX_BITS, w * (D[b] - D[b + 1]), -1.0)
        b[int(gain.argmax())] += 1
    return b


def held_bytes(widths: Tensor, T: int, d: int) -> int:
    """Bytes a head with these per-axis widths holds for T tokens: fp16 mean, used axes and deviations, uint8
    widths, per width its packed codes and its fp32 levels."""
    used = widths[widths > 0]
    n = 2 * d + 2 * d * len(used) + 3 * len(used)
    for k in used.unique().tolist():
        n += packed_nbytes(T * int((used == k).sum()), k) + 4 * 2 ** k
    return n


def fit_widths(weight: Tensor, budget_bytes: int, T: int, d: int) -> Tensor:
    """The allocation with the most code bits per token whose head, side information included, fits
    `budget_bytes`."""
    bits = max(0, 8 * (budget_bytes - 2 * d) // max(T, 1))
    while True:
        b = allocate(weight, bits)
        over = held_bytes(b, T, d) - budget_bytes
        if over <= 0 or bits == 0:
            return b
        bits = max(0, bits - max(1, -(-8 * over // max(T, 1))))


class KeyTransform:
    """One layer's keys (H, T, d) as transform codes, each head in at most `head_bytes`.

    With `outliers` > 0, that fraction of each head's tokens, those the codes serve worst (the largest
    expected logit error over the queries), is also held exact (fp16 keys, int32 positions, paid out of the
    head's bytes): a few tokens lie outside what the per-axis codebooks and the zero-bit axes can hold, and
    unlike a rotation's codes with per-token norms, the transform codes would lose most of such a key.
    `extend` codes decoding-time keys on the same axes and widths. With a `frame` the keys are coded before
    RoPE (see the module) and turned back to their positions when read."""

    def __init__(self, keys: Tensor, queries: Tensor | None, head_bytes: int, outliers: float = 0.0,
                 frame: RopeFrame | None = None):
        H, T, d = keys.shape
        self.H, self.T, self.d = H, 0, d
        self.frame = frame
        if frame is not None:
            keys = frame.undo(keys, 0)
            queries = frame.queries(queries) if queries is not None else None
        self.heads, fits = [], []  # fits: each head's (axes U, query weights w), for the outliers' error
        n_out = min(T, round(outliers * T))
        head_bytes -= n_out * (2 * d + 4)
        for h in range(H):
            mean = keys[h].mean(0)
            x = (keys[h] - mean).double()
            lam, U = torch.linalg.eigh(x.T @ x / max(T, 1))
            w = (queries[h].double() @ U).pow(2).mean(0) if queries is not None else torch.ones_like(lam)
            b = fit_widths(w * lam.clamp_min(0), head_bytes, T, d)
            used = (b > 0).nonzero()[:, 0]
            axes = U[:, used].to(torch.float16)
            std = lam[used].clamp_min(1e-12).sqrt().to(torch.float16)
            groups = [[(b[used] == k).nonzero()[:, 0], k, torch.tensor(gaussian_levels(k), device=keys.device), None]
                      for k in range(1, MAX_BITS + 1) if (b[used] == k).any()]
            self.heads.append(dict(mean=mean.to(torch.float16), axes=axes, std=std, widths=b[used].to(torch.uint8),
                                   groups=groups))
            fits.append((U, w))
        self._extend(keys)
        self.exact = None
        if n_out:  # (H, n) positions and their fp16 keys
            # each token's expected squared logit error over the queries: sum_i w_i (x_i - x_hat_i)^2
            err = torch.stack([((keys[h] - self._head_keys(hd)).double() @ U).pow(2) @ w
                               for h, (hd, (U, w)) in enumerate(zip(self.heads, fits))])
            idx = err.topk(n_out, dim=1).indices.sort(1).values
            self.exact = (idx.to(torch.int32), torch.stack([keys[h, idx[h]] for h in range(H)]).to(torch.float16))

    def extend(self, keys: Tensor) -> None:
        """Code keys (H, n, d) after the current ones."""
        self._extend(self.frame.undo(keys, self.T) if self.frame is not None else keys)

    def _extend(self, keys: Tensor) -> None:
        for h, head in enumerate(self.heads):
            z = (keys[h] - head["mean"].float()) @ head["axes"].float() / head["std"].float()
            for g in head["groups"]:
                cols, k, levels, codes = g
                c = encode(z[:, cols].contiguous(), levels)
                if codes is None:
                    g[3] = Packed(c, k, gaussian_levels(k))
                else:
                    codes.append(c)
        self.T += keys.shape[1]

    @staticmethod
    def _weights(head: dict) -> list[Tensor]:
        """Each width group's axes times their deviations (c, d): a head's keys are its mean plus, per group, the
        looked-up levels (T, c) times these, with no (T, r) coordinates scattered together."""
        axes = head["axes"].float() * head["std"].float()
        return [axes[:, cols].t() for cols, _, _, _ in head["groups"]]

    def _parts(self, head: dict):
        """Each width group's looked-up levels (T, c) and weights (c, d)."""
        return zip((codes.lookup() for _, _, _, codes in head["groups"]), self._weights(head))

    def _head_keys(self, head: dict) -> Tensor:
        """One head's decoded keys (T, d), codes only."""
        k = head["mean"].float().expand(self.T, -1).clone()
        for z, w in self._parts(head):
            k.addmm_(z, w)
        return k

    def _coded_keys(self) -> Tensor:
        """Dequantized keys (H, T, d) as coded (before RoPE with a frame), the exact outliers in place."""
        k = torch.stack([self._head_keys(hd) for hd in self.heads])
        if self.exact is not None:
            idx, ek = self.exact
            k.scatter_(1, idx.long()[..., None].expand(-1, -1, self.d), ek.float())
        return k

    def keys(self) -> Tensor:
        """Dequantized keys (H, T, d), the exact outliers in place."""
        k = self._coded_keys()
        return self.frame.apply(k) if self.frame is not None else k

    def scores(self, q: Tensor) -> Tensor:
        """q (1, H, M, d) against the keys -> (1, H, M, T) unscaled: the queries move onto each head's axes once;
        the mean's logit is exact, and so are the outliers'. Keys coded before RoPE are read at their positions
        (each position turns them differently), rebuilt and turned in registers at a decoding step by the packed-code
        kernel on the CPU, by the Triton one on CUDA (kvsum/kernels/prerope.py); else (many query rows, where a
        matmul is faster) dequantized, with RoPE's rotate-half moved onto the queries: q.(k cos + rot(k) sin) =
        (k cos).q + (k sin).(-rot(q)), the tables' two halves being equal, so no turned key is built."""
        if self.frame is not None:
            cos, sin = self.frame.tables(0, self.T, q.device)
            kernel = self._prerope_kernel(q, cos)
            if kernel is not None:  # no (T, d) tensor written; the exact outliers' logits after, turned the same way
                return self._with_exact(kernel(self.heads, cos, sin, q[0]), q, cos, sin)
            k = self._coded_keys()
            s = torch.bmm(q[0], (k * cos).transpose(1, 2))
            return s.baddbmm_(-rotate_half(q[0]), (k.mul_(sin)).transpose(1, 2))[None]
        out = []
        for h, hd in enumerate(self.heads):
            s = (q[0, h] @ hd["mean"].float())[:, None].expand(-1, self.T).clone()
            for z, w in self._parts(hd):
                s.addmm_(q[0, h] @ w.t(), z.t())
            out.append(s)
        return self._with_exact(torch.stack(out), q)

    def _prerope_kernel(self, q: Tensor, cos: Tensor):
        """The kernel that scores keys coded before RoPE from the held tensors at a decoding step (few query rows):
        Triton's on CUDA (kernels/prerope.py), the packed-code one on the CPU (native.score_prerope); None where
        neither runs."""
        if q.shape[2] > native.MAX_ROWS:
            return None
        if kernels.serves(q, cos):
            from ...kernels import prerope
            return prerope.score_prerope
        if q.device.type == "cpu" and self.H <= native.MAX_HEADS and native.library() is not None:
            return native.score_prerope
        return None

    def _with_exact(self, out: Tensor, q: Tensor, cos: Tensor | None = None, sin: Tensor | None = None) -> Tensor:
        """Scores (H, M, T) with the exact outliers' logits in place (their keys turned by the tables, if given)
        -> (1, H, M, T)."""
        if self.exact is not None:
            idx, ek = self.exact
            idx, ek = idx.long(), ek.float()
            if cos is not None:
                ek = rotate(ek, cos[idx], sin[idx])
            out.scatter_(2, idx[:, None, :].expand(-1, out.shape[1], -1), q[0] @ ek.transpose(1, 2))
        return out[None]

    def nbytes(self) -> int:
        n = tensor_bytes(*self.exact) if self.exact is not None else 0
        for hd in self.heads:
            n += tensor_bytes(hd["mean"], hd["axes"], hd["std"], hd["widths"])
            n += sum(codes.nbytes() + 4 * 2 ** k for _, k, _, codes in hd["groups"])  # fp32 levels, as TurboQuant
        return n
