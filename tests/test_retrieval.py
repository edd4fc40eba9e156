"""kvsum/retrieval.py: the retrieval-head probe (its prompt, its scores, when it runs)."""


import pytest
import torch

import kvsum
from kvsum.errors import KVSumError
from kvsum.prefill import prefill
from kvsum.retrieval import FACTS, _Probe, probe_ids, retrieval_scores
from tests.helpers import CharTokenizer, random_ids, tiny_llama


def test_probe_asks_every_planted_fact_with_its_digits_forced():
    tok = CharTokenizer()
    ids, rows, targets = probe_ids(tok, tokens=600)
    assert len(rows) == len(targets) == FACTS * 6  # " 12345": a space and five digits, each one a row
    for r, t in zip(rows.tolist(), targets):
        assert r + 1 > int(t.max())  # the answer comes after the fact it copies
    # row k of a fact predicts the fact's k-th answer token: the forced answer is the planted value
    for i in range(0, len(rows), 6):
        got = ids[0, rows[i:i + 6] + 1]
        assert torch.equal(got, ids[0, targets[i]]), (got, targets[i])


def test_scores_per_global_layer_in_unit_range_and_memoized():
    model, tok = tiny_llama(layers=3), CharTokenizer()
    s = retrieval_scores(model, tok)
    assert sorted(s) == [0, 1, 2]
    for v in s.values():
        assert v.shape == (2,) and bool(((v >= 0) & (v <= 1 + 1e-5)).all())
    assert retrieval_scores(model, tok) is s


def test_a_head_that_copies_scores_above_one_that_does_not():
    """A head whose query at each answer row is its target digit's key scores near 1; a uniform head near 0."""
    torch.manual_seed(0)
    T, d = 300, 16
    key = torch.nn.functional.normalize(torch.randn(1, 2, T, d), dim=-1) * 4  # equal norms: a key reads itself best
    rows = torch.tensor([250, 251, 260])
    targets = [torch.tensor([10]), torch.tensor([11]), torch.tensor([40, 41])]
    query = torch.zeros(1, 2, T, d)
    for r, t in zip(rows.tolist(), targets):
        query[0, 0, r] = key[0, 0, t[0]] * 30  # head 0 points at a target; head 1 reads evenly (a zero query)
    probe = _Probe(rows, targets)
    probe.add(0, query, key, d ** -0.5)
    assert probe.scores[0][0] > 0.9 and probe.scores[0][1] < 0.05, probe.scores[0]


def test_a_model_whose_window_cannot_hold_the_probe_gets_none():
    model = tiny_llama(seed=1)
    model.config.max_position_embeddings = 256
    assert retrieval_scores(model, CharTokenizer()) is None


def test_prefill_probes_only_when_asked_and_needs_a_tokenizer_unless_optional():
    model, ids, tok = tiny_llama(seed=2), random_ids(200, 5), CharTokenizer()
    assert prefill(model, ids).retrieval is None
    assert prefill(model, ids, retrieval="optional").retrieval is None  # no tokenizer: skipped
    with pytest.raises(KVSumError, match="tokenizer"):
        prefill(model, ids, retrieval=True)
    pre = prefill(model, ids, tokenizer=tok, retrieval=True, surprisal=True)
    assert pre.retrieval is retrieval_scores(model, tok)
    cache = kvsum.compress_prefill(pre, kvsum.make_method("summary", retrieval_score=0.5, entropy_allocation=False),
                                   0.3)
    assert cache.get_seq_length() == ids.shape[1]


def test_scores_are_saved_by_fingerprint_and_read_back_without_a_forward(tmp_path, monkeypatch):
    import kvsum.retrieval as retrieval
    monkeypatch.setattr(retrieval, "cache_dir", lambda: tmp_path)
    model, tok = tiny_llama(seed=3), CharTokenizer()
    first = retrieval_scores(model, tok)
    assert len(list((tmp_path / "retrieval").glob("*.pt"))) == 1
    retrieval._memo.clear()
    monkeypatch.setattr(retrieval, "_Probe", None)  # no forward this time: the file is read
    again = retrieval_scores(model, tok)
    assert again is not first and all(torch.equal(again[i], first[i]) for i in first)
