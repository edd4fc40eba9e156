"""Summary's anchor scores: which tokens of a head are kept exact (surprisal, whole sentences, attention)."""

from __future__ import annotations

import torch
from torch import Tensor

from ...errors import KVSumError
from ..attention_stats import VOTE_KERNEL, VOTE_WINDOW, causal_logits, normalized_entropy, pool1d
from .fit import surprisal_spans

SCORES = ("hybrid", "surprisal", "sentence", "repeat", "sharp_mass", "max", "mass")
MAX_SENTENCE = 64  # tokens: a longer stretch without a sentence end is cut into pieces of this length
LENGTH_CAP = 32  # tokens: a sentence's rank stops falling with its length here (a uuid is 42-49 of Qwen's tokens)


def rank(score: Tensor) -> Tensor:
    """Rank of every token by descending score (0 = best)."""
    r = torch.empty_like(score)
    r[torch.argsort(score, descending=True)] = torch.arange(len(score), device=score.device, dtype=score.dtype)
    return r


def information(x, score: str, span: int):
    """The head-independent part of the anchor score: surprisal spans ("hybrid", "surprisal") or whole
    sentences ("sentence"); None for the scores read from attention."""
    if score in ("hybrid", "surprisal"):
        return token_surprisal(x, score, span)
    return sentences(x) if score == "sentence" else None


def importance(x, q: Tensor, pos: Tensor, h: int, info, score: str) -> Tensor:
    """Anchor score per token of head h (a new tensor): `info` (surprisal spans or sentences), or a statistic of
    reference attention.

    "hybrid" interleaves two rankings: attention of the observation window (what the next tokens
    read) and surprisal spans (information the model cannot rebuild from context)."""
    if score == "hybrid":
        win = pos >= x.T - VOTE_WINDOW
        p = torch.softmax(causal_logits(q[win], pos[win], x.keys[h], x.scale), -1).mean(0)
        p = pool1d(p[None], VOTE_KERNEL, edges=True)[0]
        return interleave(info, p, 0.5)  # kept as soon as either ranking wants it
    if info is not None:
        return info.clone()
    if score == "repeat":
        if x.key_scores is None:
            raise KVSumError("score='repeat' needs kvsum.prefill(..., repeat=True) (kvsum.compress asks for it)")
        return x.key_scores[h].clone()
    p = torch.softmax(causal_logits(q, pos, x.keys[h], x.scale), -1)
    if score == "max":
        return p.max(0).values
    if score == "mass":
        return p.sum(0)
    return ((1 - normalized_entropy(p, pos))[:, None] * p).sum(0)


def interleave(score: Tensor, votes: Tensor, share: float) -> Tensor:
    """Anchor scores taking `share` of the kept tokens by `votes`, the rest by `score`: the token ranked r by the
    votes is taken with the one ranked r (1 - share) / share by the score (one both want counts once)."""
    return -torch.minimum(rank(votes) * (1 - share) / share, rank(score))


def token_surprisal(x, score: str, span: int = 1) -> Tensor:
    """Token surprisal (averaged over `span` neighbours), position 0 ranked with the most surprising."""
    if x.surprisal is None:
        raise KVSumError(f"score={score!r} needs the prefill's token surprisal (kvsum.prefill computes it)")
    return surprisal_spans(x.surprisal, span)


def sentences(x) -> Tensor:
    """Whole sentences ranked by their peak surprisal over the square root of their length (at most LENGTH_CAP):
    one token the model could not guess, for the bytes the sentence costs.

    A fact's digits carry less surprisal than the prose around them; scored alone they rank below the cut and
    the fact survives without its value, so a sentence is kept or dropped whole. A fact in a template read
    before (the fourth of five) has a low mean surprisal but one surprising word, and it is short: by its mean
    it ranks below the prose, by its peak alone below prose sentences that cost three times its bytes for one
    rare word. Past LENGTH_CAP tokens a sentence is not ranked lower for its length: a long value (a uuid, a
    hash, a line of code) needs every token. Sentences end at tokens holding . ! ? or a newline."""
    if x.sentence_ends is None:
        raise KVSumError("score='sentence' needs sentence ends: kvsum.compress(..., tokenizer=tokenizer)")
    s = token_surprisal(x, "sentence")
    ends = x.sentence_ends.to(s.device)
    pos = torch.arange(x.T, device=s.device)
    start = torch.cat([pos.new_zeros(1), pos[:-1][ends[:-1]] + 1])  # first token of every sentence
    sent = torch.bucketize(pos, start, right=True) - 1
    piece = sent * x.T + (pos - start[sent]) // MAX_SENTENCE  # long sentences cut into pieces
    seg = torch.unique_consecutive(piece, return_inverse=True)[1]
    n = int(seg[-1]) + 1
    length = s.new_zeros(n).index_add(0, seg, torch.ones_like(s))
    peak = s.new_full((n,), -float("inf")).scatter_reduce(0, seg, s, "amax")
    return -rank(peak / length.clamp(max=LENGTH_CAP).sqrt())[seg]
