"""Closed-form fits from calibrated moments: echokv's channel choice and ridge maps, lowrank's PCA bases.

`stats` is one kind's moments (kvsum.calibrate.artifact says which): `mean` (L, n), `cov` (L, n, n) and
`cross` (L, n, n) with cross[i] = Cov(x_i, x_{i-1}), n = KV heads x head dim. Every fit is a pure function
of them, so one artifact serves every budget, keep fraction and rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from ..errors import KVSumError

RIDGE = 1e-3  # ridge strength, relative to each predictor's variance (scale-free: key channels differ in scale)


@dataclass
class EchoPlan:
    """Which channels of a layer to store (`sel`), which to rebuild (`rest`), and the ridge map."""

    sel: Tensor  # (k,) long, sorted: stored channels of this layer
    rest: Tensor  # (n - k,) long: rebuilt channels
    prev: Tensor  # (k',) long: the previous layer's stored channels, used as predictors too
    mean_in: Tensor  # (k + k',) mean of the predictors [this layer's sel, previous layer's prev]
    mean_out: Tensor  # (n - k,)
    W: Tensor  # (k + k', n - k): rest = mean_out + (predictors - mean_in) @ W


def channel_groups(n: int, d: int, pairs: bool) -> Tensor:
    """Selection units: single channels, or RoPE pairs (j, j + d/2) of one head, so kept keys can be un-rotated."""
    if not pairs:
        return torch.arange(n)[:, None]
    first = torch.tensor([i for i in range(n) if i % d < d // 2])
    return torch.stack([first, first + d // 2], 1)


def greedy_channels(C: Tensor, k: int, groups: Tensor) -> Tensor:
    """Greedy column-subset selection: repeatedly store the unit whose exact value explains the most remaining
    variance of all channels, sum_i C_ig C_gg^-1 C_gi, then condition on it (Schur complement, one rank-1 update
    per channel). Units are single channels or pairs. In float64 numpy: a few small vector operations a step."""
    C = C.double().cpu().numpy().copy()
    g = groups.cpu().numpy()
    a, b = g[:, 0], g[:, -1]
    free = np.ones(len(g), dtype=bool)
    tiny = 1e-12 * max(float(np.mean(np.diag(C))), 1e-30)
    chosen: list[int] = []
    while len(chosen) * g.shape[1] < k:
        sq = (C * C).sum(0)  # sum_i C_ij^2 (C is symmetric)
        diag = np.diag(C)
        caa, cbb = diag[a], diag[b]
        if g.shape[1] == 2:
            cab = C[a, b]
            explained = (cbb * sq[a] - 2 * cab * np.einsum("ij,ij->j", C[:, a], C[:, b]) + caa * sq[b]) / \
                np.maximum(caa * cbb - cab * cab, tiny * tiny)
        else:
            explained = sq[a] / np.maximum(caa, tiny)
        explained[~free] = -1.0
        best = int(np.argmax(explained))
        free[best] = False
        chosen.append(best)
        for j in g[best]:
            col = C[:, j].copy()
            C -= np.outer(col, col) / max(col[j], tiny)
    return torch.from_numpy(g[chosen].flatten()).sort().values


def echo_plan(s: dict[str, Tensor], d: int, pairs: bool, layer: int, k: int, prev: Tensor) -> EchoPlan:
    """Store `k` channels of `layer` (in RoPE pairs with `pairs`), rebuild the rest from them and the previous
    layer's `prev` channels: greedy selection on what `prev` leaves unexplained, then ridge regression."""
    mean, C = s["mean"][layer].double(), s["cov"][layer].double()
    n = C.shape[0]
    if layer > 0 and len(prev):
        Cpp = s["cov"][layer - 1].double()[prev][:, prev]
        Cxp = s["cross"][layer].double()[:, prev]
        m_prev = s["mean"][layer - 1].double()[prev]
    else:
        prev = prev[:0]
        Cpp, Cxp, m_prev = C[:0, :0], C[:, :0], mean[:0]
    if k >= n:
        sel = torch.arange(n)
    else:
        # choose this layer's channels on the variance the previous layer's stored channels leave unexplained.
        ridge_p = Cpp + RIDGE * torch.diag(Cpp.diagonal())
        Cres = C - Cxp @ torch.linalg.solve(ridge_p, Cxp.T) if len(prev) else C
        sel = greedy_channels(Cres, k, channel_groups(n, d, pairs))
    keep = torch.zeros(n, dtype=torch.bool)
    keep[sel] = True
    rest = torch.arange(n)[~keep]
    # ridge regression of rest on [sel, prev], in closed form from the moments.
    Cin = torch.cat([torch.cat([C[sel][:, sel], Cxp[sel]], 1),
                     torch.cat([Cxp[sel].T, Cpp], 1)], 0)
    Cout = torch.cat([C[sel][:, rest], Cxp[rest].T], 0)
    W = torch.linalg.solve(Cin + RIDGE * torch.diag(Cin.diagonal()), Cout)
    # solve returns W column-major; a saved cache loads it row-major, and the matmul over a transposed layout rounds
    # differently: held row-major, a loaded cache decodes bit for bit as the saved one
    return EchoPlan(sel, rest, prev, torch.cat([mean[sel], m_prev]).float(), mean[rest].float(),
                    W.float().contiguous())


def lowrank_basis(s: dict[str, Tensor], layers: tuple[int, ...]) -> tuple[Tensor, Tensor]:
    """PCA of the joint channels of `layers` (one, or two adjacent): mean (g*n,), basis (g*n, g*n) whose
    columns are sorted by explained variance, so the first r columns are the best rank-r basis."""
    if len(layers) == 1:
        C = s["cov"][layers[0]].double()
    elif len(layers) == 2 and layers[1] == layers[0] + 1:
        a, b = layers
        X = s["cross"][b].double()  # Cov(x_b, x_a)
        C = torch.cat([torch.cat([s["cov"][a].double(), X.T], 1),
                       torch.cat([X, s["cov"][b].double()], 1)], 0)
    else:
        raise KVSumError(f"lowrank: the artifact holds moments of adjacent layers only, not of {layers}")
    vals, vecs = torch.linalg.eigh(C)
    mean = torch.cat([s["mean"][i] for i in layers]).float()
    return mean, vecs.flip(-1).float().contiguous()
