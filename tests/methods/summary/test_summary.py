"""kvsum/methods/summary/summary.py: refits, knob checks, entropy allocation across heads and layers."""

import pytest
import torch

import kvsum
from kvsum.methods import make_method
from kvsum.methods.attention_stats import causal_logits, window_votes
from kvsum.methods.summary.summary import Summary
from tests.helpers import reference_layer


def _attention_error(state, x):
    """Relative error of the attention output over the reference queries: state vs. the full block."""
    G = x.queries.shape[0] // x.H
    q = x.queries.reshape(1, x.H, -1, x.d)  # queries grouped by KV head
    s = state.scores(q, x.scale)
    approx = state.mix(torch.softmax(s, -1))[0, 0]
    logits = causal_logits(x.queries.reshape(-1, x.d), x.query_pos.repeat(G), x.keys[0], x.scale)
    exact = torch.softmax(logits, -1) @ x.values[0]
    return float((approx - exact).norm() / exact.norm())


def test_refit_reduces_attention_error_over_references():
    errs = {}
    for refit in (False, True):
        x = reference_layer()
        state = make_method("summary", refit=refit, anchor_share=0.5, entropy_allocation=False).compress(x)
        errs[refit] = _attention_error(state, x)
    assert errs[True] < 0.8 * errs[False], errs


def test_bad_knobs_are_clear_errors():
    with pytest.raises(kvsum.KVSumError, match="anchor_share"):
        make_method("summary", anchor_share=1.5)
    with pytest.raises(kvsum.KVSumError, match="no knob"):
        make_method("summary", nonsense=1)
    with pytest.raises(kvsum.KVSumError, match=r"attention_share must be in \[0, 1\)"):
        make_method("summary", attention_share=1.0)


def test_attention_share_keeps_what_the_observation_window_votes_for():
    """With attention_share, SnapKV's most voted token is an anchor even where the score ranks it last."""
    x = reference_layer(T=200, budget=0.6)  # 58 entries: 36 sinks and window, 22 by the ranking
    votes = window_votes(x)[0]
    votes[:4], votes[-64:] = -1, -1  # the sinks and the window are anchors anyway
    top = int(votes.argmax())
    x.surprisal[top] = -1.0  # the least surprising token
    for share, kept in ((0.0, False), (0.3, True)):
        state = Summary(score="surprisal", span=1, anchor_share=1.0, attention_share=share).compress(x)
        assert any(torch.equal(k, x.keys[0, top]) for k in state.keys) == kept


def test_entropy_allocation_spreads_bytes_and_keeps_the_budget(tiny, ids):
    cache = kvsum.compress(tiny, ids, method="summary", budget=0.25, entropy_allocation=True, by_budget=False)
    assert cache.nbytes() <= 0.27 * cache.reference_nbytes
    lengths = [n for layer in cache.layers for n in layer.state.lengths()]
    assert len(set(lengths)) > 1  # heads and layers no longer hold equal shares


def test_anchors_alone_hold_no_bias_and_spend_its_bytes_on_entries(monkeypatch):
    """anchor_share=1 keeps no fitted summary, so no entry needs a log-mass bias: none is stored, and the bytes an
    all-zero bias would take hold more anchors (alone and as a composition's codes, selected once, not again to
    find out that no bias came back)."""
    x = reference_layer(T=400, budget=0.3)
    calls = []
    compress = Summary.compress
    monkeypatch.setattr(Summary, "compress", lambda self, *a, **k: calls.append(1) or compress(self, *a, **k))
    plain = Summary(score="surprisal", anchor_share=1.0, entropy_allocation=False).compress(x)
    fitted = Summary(score="surprisal", anchor_share=0.99, entropy_allocation=False).compress(x)
    assert plain.bias is None and fitted.bias is not None
    assert plain.nbytes() <= x.budget_bytes
    assert sum(plain.lengths()) > sum(fitted.lengths())
    composed = make_method("summary+turboquant", score="surprisal", summary_anchor_share=1.0, bits=3,
                           entropy_allocation=False).compress(x)
    assert composed.parts[-1].bias is None and composed.nbytes() <= x.budget_bytes  # the sinks exact, then codes
    assert len(calls) == 3  # plain, fitted, and the composition's one selection
