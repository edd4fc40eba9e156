"""kvsum/methods/summary/scores.py: anchor scores, whole sentences."""

import pytest
import torch

import kvsum
from tests.helpers import SentenceTokenizer, reference_layer


def test_sentence_score_keeps_or_drops_whole_sentences():
    """Every token of a sentence gets one score: a sentence ranks by the better of its mean surprisal and its
    peak, so a fact whose value is unsurprising ranks with its surprising word; a stretch longer than
    MAX_SENTENCE without a sentence end is cut into pieces ranked apart."""
    from kvsum.methods.summary.scores import MAX_SENTENCE, sentences

    T = 2 * MAX_SENTENCE + 60
    x = reference_layer(T=T)
    s = torch.full((T,), 1.0)
    s[0] = float("inf")
    s[1:5] = 0.5  # sentence [0, 5): position 0 (no surprisal) ranks it with the most surprising
    s[5:20] = 0.3
    s[8] = 9.0  # sentence [5, 20): one surprising word, the rest (the "digits") low: mean below every other
    s[20:30] = 4.0  # sentence [20, 30): the highest mean (4.0), peak 4.0
    ends = torch.zeros(T, dtype=torch.bool)
    ends[[4, 19, 29]] = True  # then one long stretch [30, T) without an end
    s[30 + MAX_SENTENCE + 3] = 5.0  # in the long stretch's second piece only
    x.surprisal, x.sentence_ends = s, ends
    score = sentences(x)
    pieces = [(0, 5), (5, 20), (20, 30), (30, 30 + MAX_SENTENCE), (30 + MAX_SENTENCE, 30 + 2 * MAX_SENTENCE)]
    for a, b in pieces:
        assert torch.all(score[a:b] == score[a])  # whole sentences
    first, fact, dense, long1, long2 = (float(score[a]) for a, _ in pieces)
    # the fact by its peak, the dense sentence by its mean, the piece holding 5.0 above the flat one
    assert min(first, fact, dense) > long2 > long1
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
