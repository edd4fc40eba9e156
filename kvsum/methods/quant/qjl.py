"""QJL (Zandieh et al.): a 1-bit sketch of a key residual whose inner products with queries are unbiased.

With `qjl`, TurboQuant keys get one bit less of MSE codes plus the sign bits of a seeded Gaussian projection
of the residual and its norm; attention adds the sketch's estimate of <q, r> to each logit.
"""

from __future__ import annotations

import math

from torch import Tensor


def qjl_encode(r: Tensor, S: Tensor) -> tuple[Tensor, Tensor]:
    """1-bit sketch of residuals r (..., d): sign(S r) as bools and |r|."""
    return (r @ S.t()) >= 0, r.norm(dim=-1)


def qjl_estimate(q: Tensor, signs: Tensor, r_norm: Tensor, S: Tensor) -> Tensor:
    """Unbiased estimate of <q, r> from the sketch: sqrt(pi/2) / m |r| <S q, sign(S r)>; q (..., M, d),
    signs (..., T, m) -> (..., M, T)."""
    pm = signs.float() * 2 - 1
    return math.sqrt(math.pi / 2) / S.shape[0] * (q @ S.t()) @ pm.transpose(-1, -2) * r_norm.unsqueeze(-2)
