"""Scores: language-model fidelity of a compressed cache against the full cache, from logits."""

from __future__ import annotations

import math

import torch
from torch import Tensor


def token_kl(full_logits: Tensor, logits: Tensor) -> Tensor:
    """KL(full || compressed) in nats at every position, (n,) from (n, V) logits each; in float64 so that identical
    logits give exactly 0."""
    return _kl(torch.log_softmax(full_logits.double(), -1), torch.log_softmax(logits.double(), -1))


def _kl(p_log: Tensor, q_log: Tensor) -> Tensor:
    return (p_log.exp() * (p_log - q_log)).sum(-1).clamp_min(0)


def fidelity(full_logits: Tensor, logits: Tensor, targets: Tensor) -> dict[str, float]:
    """Compare next-token distributions at the same positions, (n, V) each.

    kl: mean over positions of KL(full || compressed) in nats; top1: fraction of positions whose
    argmax agrees; nll / nll_full: mean negative log-likelihood of `targets` (m <= n), the tokens that
    follow the first m positions. Computed in float64 so that identical logits give exactly 0.
    """
    p_log = torch.log_softmax(full_logits.double(), -1)
    q_log = torch.log_softmax(logits.double(), -1)
    kl = _kl(p_log, q_log)  # the log-probabilities once: the nll below reads them too
    top1 = (full_logits.argmax(-1) == logits.argmax(-1)).double()
    m = targets.numel()
    idx = targets.reshape(-1, 1).to(full_logits.device)
    nll_full = -p_log[:m].gather(-1, idx).mean()
    nll = -q_log[:m].gather(-1, idx).mean()
    return dict(kl=kl.mean().item(), top1=top1.mean().item(), nll=nll.item(), nll_full=nll_full.item())


def answer_margin(logits: Tensor, targets: Tensor) -> float:
    """The smallest, over an answer's teacher-forced steps, of the right token's logit less the best other's.
    logits (m, V) are the next-token logits before each of the m `targets`. Negative where some step would pick
    another token, so greedy decoding misses; unlike accuracy it says how near an example is to flipping."""
    logits = logits.double()
    idx = targets.reshape(-1, 1).to(logits.device)
    right = logits.gather(-1, idx)[:, 0]
    other = logits.scatter(-1, idx, -math.inf).max(-1).values
    return (right - other).min().item()


def summarize_fidelity(items: list[dict[str, float]]) -> dict[str, float]:
    """Mean over examples; the perplexity ratio pools the NLL of all examples (equal lengths)."""
    mean = {k: sum(d[k] for d in items) / len(items) for k in ("kl", "top1", "nll", "nll_full")}
    return dict(kl=mean["kl"], top1=100 * mean["top1"], ppl=math.exp(mean["nll"]),
                ppl_full=math.exp(mean["nll_full"]), ppl_ratio=math.exp(mean["nll"] - mean["nll_full"]))
