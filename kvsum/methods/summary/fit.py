"""Shared numerics for summarization: surprisal spans, byte splits, mass and value fits, low-rank factors.

Everything here runs in float32 on one KV head at a time, whatever the model's dtype. The reference-attention
statistics (causal logits, entropy, head diffuseness) live in kvsum/methods/attention_stats.py.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..attention_stats import pool1d


def surprisal_spans(surprisal: Tensor, span: int) -> Tensor:
    """Token surprisal (T,) averaged over `span` neighbours (facts are spans of tokens); position 0, which has
    no surprisal, ranks with the most surprising."""
    s = surprisal.clone()
    s[0] = s[1:].max() if len(s) > 1 else 0.0
    if span > 1:
        s = pool1d(s[None], span, edges=True)[0]
    return s


def split_by_weight(total: int, weights: Tensor, floor: int, cap: int) -> list[int]:
    """Integers proportional to `weights`, each in [floor, cap], summing to at most `total`."""
    w = weights.clamp_min(1e-6)
    n = (w / w.sum() * total).floor().long().clamp(floor, cap)
    while n.sum() > total and (n > floor).any():  # rounding and floors may overshoot
        i = int(torch.where(n > floor, n, -1).argmax())
        n[i] -= 1
    return [int(v) for v in n]


def spread(means: Tensor, budget: float, base: float) -> list[float]:
    """Layer fractions averaging `budget`: `base` each, the rest spread within [0.5, 1.5] x the mean by the
    layers' diffuseness `means` (diffuse layers get more, no layer starves), none above 1."""
    w = 0.5 + (means - means.min()) / (means.max() - means.min()).clamp_min(1e-6)
    f = (base + (budget - base) * w / w.mean()).clamp(max=1.0)
    return [float(v) for v in f * (budget * len(means) / f.sum()).clamp(max=1.0)]


def floored(fractions: list[float], need: list[float]) -> tuple[list[float] | None, str]:
    """`fractions` with each raised to its `need`, taken from the others' surplus in proportion (and a note), or
    (None, "") where the surplus cannot pay for it."""
    short = sum(max(0.0, n - f) for f, n in zip(fractions, need))
    if not short:
        return fractions, ""
    surplus = sum(max(0.0, f - n) for f, n in zip(fractions, need))
    if surplus < short:
        return None, ""
    return [n if f < n else f - (f - n) * short / surplus for f, n in zip(fractions, need)], \
        "layer shares floored at the cover and sinks"


def fit_chunk_summaries(logits: Tensor, q: Tensor, scale: float, keys: Tensor, values: Tensor, chunk: Tensor,
                        n_chunks: int, key_mode: str = "max", ridge: float = 1.0, refit: bool = True
                        ) -> tuple[Tensor, Tensor, Tensor]:
    """One summary entry (key, log-mass bias, value) per chunk of consecutive dropped tokens.

    logits: (n, m) causal reference logits against the m dropped tokens, q: (n, d) the references,
    keys/values: (m, d), chunk: (m,) chunk id in [0, n_chunks).
    The bias solves the 1-D non-negative least squares  min_w sum_q s_q (w e_q / Z_q - 1)^2  (relative mass
    error, weighted by the chunk's attention share s_q), so the entry carries the chunk's mass Z for the
    references. The value is the ridge least-squares fit of the chunk's attention outputs over the
    references; with one entry per chunk it reduces to the mass-weighted mean of the chunk's values,
    pulled towards the representative's own value by `ridge` (in units of received attention).
    """
    n = logits.shape[0]
    d = values.shape[1]
    dev = logits.device
    row_max = logits.max(-1, keepdim=True).values.clamp_min(-1e30)
    e = torch.exp(logits - row_max)  # a per-query scale that cancels in every ratio below
    Z = torch.zeros(n, n_chunks, device=dev).index_add_(1, chunk, e)  # (n, C) chunk masses
    mass = e.t() @ (1.0 / Z.sum(-1).clamp_min(1e-30))  # (m,) attention each dropped token receives over the references
    # representative of each chunk: its most attended token (ties and unseen chunks: the last one)
    order = torch.argsort(chunk.double() * (float(mass.max()) + 1.0) + mass.double())
    rep = torch.zeros(n_chunks, dtype=torch.long, device=dev).scatter_(0, chunk[order], order)
    wsum = torch.zeros(n_chunks, device=dev).index_add_(0, chunk, mass)
    if key_mode == "mean":
        w_tok = mass + 1e-12
        ck = torch.zeros(n_chunks, d, device=dev).index_add_(0, chunk, keys * w_tok[:, None])
        ck = ck / torch.zeros(n_chunks, device=dev).index_add_(0, chunk, w_tok)[:, None]
    else:
        ck = keys[rep]
    if not refit:  # ablation: the representative as it is, no bias and no value fit
        return ck, torch.zeros(n_chunks, device=dev), values[rep]
    e_rep = torch.exp(q @ ck.t() * scale - row_max)  # (n, C)
    seen = Z > 0
    a = torch.where(seen, e_rep / Z.clamp_min(1e-30), torch.zeros_like(e_rep))
    s = Z / Z.sum(-1, keepdim=True).clamp_min(1e-30)
    w = (s * a).sum(0) / (s * a * a).sum(0).clamp_min(1e-30)
    size = chunk.bincount(minlength=n_chunks).float()
    w = torch.where(seen.any(0) & torch.isfinite(w), w, size)  # no reference saw the chunk: count its tokens
    bias = torch.log(w.clamp(1e-6, 1e6))
    num = torch.zeros(n_chunks, d, device=dev).index_add_(0, chunk, values * mass[:, None])
    cv = (num + ridge * values[rep]) / (wsum + ridge)[:, None]
    return ck, bias, cv


def lowrank_factors(x: Tensor, rank: int) -> tuple[Tensor, Tensor, Tensor]:
    """x (m, d) ~ mean + coef @ basis^T with an orthonormal basis (d, rank): truncated SVD, float32."""
    mean = x.mean(0)
    if rank <= 0 or x.shape[0] == 0:
        return mean, x.new_zeros(x.shape[0], 0), x.new_zeros(x.shape[1], 0)
    _, _, vh = torch.linalg.svd(x - mean, full_matrices=False)
    basis = vh[:rank].t().contiguous()
    return mean, (x - mean) @ basis, basis
