"""kvsum/eval/text.py: prose paragraphs and exact-length haystacks."""

import pytest

from kvsum.eval import text


def test_paragraphs_are_prose():
    paras = text.paragraphs()
    assert len(paras) > 300
    for p in paras:
        assert "\n" not in p and "::=" not in p and ">>>" not in p and p.endswith(".")


@pytest.mark.parametrize("n", [1, 37, 1000, 2048])
def test_haystack_exact_length_and_deterministic(tok, n):
    sep = text.sep_ids(tok)
    a = text.join(text.haystack(tok, n, seed=3), sep)
    assert len(a) == n
    assert a == text.join(text.haystack(tok, n, seed=3), sep)
    if n > 100:
        assert a != text.join(text.haystack(tok, n, seed=4), sep)
        assert text.encode(tok, tok.decode(a)) == a  # the pieces join into the text's own tokenization
