"""kvsum/methods/summary/scores.py: anchor scores, whole sentences."""

import pytest
import torch

import kvsum
from tests.helpers import SentenceTokenizer, reference_layer


def test_sentence_score_keeps_or_drops_whole_sentences():
    """Every token of a sentence gets one score: its peak surprisal over the square root of its length, the length
    counted up to LENGTH_CAP; a stretch longer than MAX_SENTENCE without a sentence end is cut into pieces ranked
    apart. A short fact with one surprising word ranks above a longer sentence with a more surprising one."""
    from kvsum.methods.summary.scores import LENGTH_CAP, MAX_SENTENCE, sentences

    assert 14 < LENGTH_CAP < 40 < MAX_SENTENCE
    T = 59 + 2 * MAX_SENTENCE
    x = reference_layer(T=T)
    s = torch.full((T,), 1.0)
    s[0] = float("inf")
    s[1:5] = 0.5  # sentence [0, 5): position 0 (no surprisal) ranks it with the most surprising
    s[5:19] = 0.3
    s[8] = 6.0  # sentence [5, 19), 14 tokens: one surprising word, the rest (the "digits") low
    s[19:59] = 2.0
    s[30] = 8.0  # sentence [19, 59), 40 tokens: a higher mean and a higher peak, but almost three times the bytes
    s[70] = 8.5  # a stretch [59, T) without an end: its first piece (MAX_SENTENCE tokens) holds the peak
    ends = torch.zeros(T, dtype=torch.bool)
    ends[[4, 18, 58]] = True
    x.surprisal, x.sentence_ends = s, ends
    score = sentences(x)
    pieces = [(0, 5), (5, 19), (19, 59), (59, 59 + MAX_SENTENCE), (59 + MAX_SENTENCE, T)]
    for a, b in pieces:
        assert torch.all(score[a:b] == score[a])  # whole sentences
    first, fact, prose, long1, long2 = (float(score[a]) for a, _ in pieces)
    # the fact above the longer prose sentence; past LENGTH_CAP a piece is not ranked lower for its length (64
    # tokens with a peak of 8.5 above 40 with 8.0); the flat piece last
    assert first > fact > long1 > prose > long2
    x.sentence_ends = None
    with pytest.raises(kvsum.KVSumError, match="tokenizer"):
        sentences(x)


def test_sentence_score_needs_the_tokenizer(tiny, ids):
    with pytest.raises(kvsum.KVSumError, match="tokenizer="):
        kvsum.compress(tiny, ids, method="summary", budget=0.25, score="sentence")
    tok = SentenceTokenizer()
    small = ids % len(tok.chars)
    cache = kvsum.compress(tiny, small, method="summary", budget=0.25, score="sentence", tokenizer=tok)
    assert cache.nbytes() <= 0.27 * cache.reference_nbytes


def test_interleave_takes_its_share_by_the_votes():
    """The kept tokens (the top of the interleaved score) are `share` by the votes and the rest by the score; a
    token both rankings want is kept once."""
    from kvsum.methods.summary.scores import interleave

    score, votes = torch.arange(100.0, 0, -1), torch.arange(100.0)  # opposite rankings: no token wanted by both
    top = torch.argsort(interleave(score, votes, 0.25), descending=True)[:40]
    assert (top >= 50).sum() == 10 and set(range(30)) <= set(top.tolist())  # 10 by the votes, 30 by the score
    same = torch.argsort(interleave(score, score, 0.25), descending=True)[:40]
    assert set(same.tolist()) == set(range(40))  # one ranking twice: its top 40
