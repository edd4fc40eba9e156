import math

import pytest
import torch

import kvsum
from kvsum.compress import prefill
from kvsum.methods.base import LayerInput, make_method
from kvsum.methods.quant.pca import KeyTransform
from kvsum.methods.summary.fit import causal_logits, fit_chunk_summaries

from .conftest import tiny_llama

BUDGETS = [0.5, 0.25, 0.125, 0.0625]


@pytest.mark.parametrize("method", ["summary", "hae"])
@pytest.mark.parametrize("budget", BUDGETS)
def test_budget_compliance(tiny, ids, method, budget):
    cache = kvsum.compress(tiny, ids, method=method, budget=budget)
    assert cache.nbytes() <= (budget + 0.02) * cache.reference_nbytes
    out = tiny.generate(torch.cat([ids, ids[:, :4]], -1), cache=cache, max_new_tokens=4, min_new_tokens=4,
                        do_sample=False)
    assert out.shape[1] == ids.shape[1] + 8


def test_surprisal_matches_model_logits(tiny, ids):
    pre = prefill(tiny, ids, surprisal=True)
    with torch.no_grad():
        logp = torch.log_softmax(tiny(ids).logits[0].float(), -1)
    expected = -logp[:-1].gather(-1, ids[0, 1:, None])[:, 0]
    torch.testing.assert_close(pre.surprisal[1:], expected, rtol=1e-4, atol=1e-4)
    assert math.isinf(pre.surprisal[0])


def test_identical_keys_chunk_is_summarized_exactly():
    """A chunk of m copies of one key: one entry with bias log(m) and the chunk's mean value is exact."""
    g = torch.Generator().manual_seed(0)
    d, m = 8, 5
    key = torch.randn(d, generator=g)
    keys = key.repeat(m, 1)
    values = torch.randn(m, d, generator=g)
    q = torch.randn(12, d, generator=g)
    pos = torch.full((12,), 100)
    logits = causal_logits(q, pos, keys, 0.5)
    ck, bias, cv = fit_chunk_summaries(logits, q, 0.5, keys, values, torch.zeros(m, dtype=torch.long), 1, ridge=0.0)
    assert torch.allclose(bias, torch.tensor([math.log(m)]), atol=1e-5)
    torch.testing.assert_close(cv[0], values.mean(0))
    torch.testing.assert_close(ck[0], key)


def _layer_input(seed=0, T=200, d=16, H=1, G=2, n=48, budget=0.25):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(H, T, d, generator=g)
    values = torch.randn(H, T, d, generator=g)
    queries = torch.randn(H * G, n, d, generator=g) + keys[:, -n:].repeat_interleave(G, 0) * 0.5
    pos = torch.arange(T - n, T)
    full = 2 * H * T * d * 2
    return LayerInput(keys, values, queries, pos, d ** -0.5, 0, 1, budget * full, torch.float32,
                      surprisal=torch.rand(T, generator=g))


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
        x = _layer_input()
        state = make_method("summary", refit=refit, anchor_share=0.5, entropy_allocation=False).compress(x)
        errs[refit] = _attention_error(state, x)
    assert errs[True] < 0.8 * errs[False], errs


def test_lowrank_tier_full_rank_is_exact():
    from kvsum.methods.summary.lowrank import LowRankState

    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(30, 8, generator=g), torch.randn(30, 8, generator=g)
    st = LowRankState([(k, v, 8)], dtype=torch.float32)
    q = torch.randn(1, 1, 3, 8, generator=g)
    torch.testing.assert_close(st.scores(q, 0.3)[0, 0], q[0, 0] @ k.t() * 0.3, rtol=1e-4, atol=1e-4)
    p = torch.softmax(torch.randn(1, 1, 3, 30, generator=g), -1)
    torch.testing.assert_close(st.mix(p)[0, 0], p[0, 0] @ v, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("method", ["summary", "hae"])
def test_low_precision_models_stay_finite(dtype, method, ids):
    model = tiny_llama(dtype=dtype)
    cache = kvsum.compress(model, ids, method=method, budget=0.125, lowrank_share=0.2) if method == "summary" \
        else kvsum.compress(model, ids, method=method, budget=0.125)
    with torch.no_grad():
        logits = model(ids[:, :5], cache=cache).logits
    assert torch.isfinite(logits).all()


def test_bad_knobs_are_clear_errors():
    with pytest.raises(kvsum.KVSumError, match="anchor_share"):
        make_method("summary", anchor_share=1.5)
    with pytest.raises(kvsum.KVSumError, match="no knob"):
        make_method("summary", nonsense=1)


def test_repeat_prefill_scores_keys_and_leaves_the_cache_as_it_was(tiny, ids):
    plain = prefill(tiny, ids)
    rich = prefill(tiny, ids, repeat=True)
    for a, b in zip(plain.cache.layers, rich.cache.layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)  # the re-read is cropped off
    assert set(rich.repeat_scores) == {0, 1}
    s = rich.repeat_scores[0]
    assert s.shape == (2, ids.shape[1]) and float(s.min()) >= 0 and float(s.max()) <= 1


def test_repeat_scores_do_not_depend_on_the_chunk_size(tiny, ids, monkeypatch):
    from kvsum import attention

    results = []
    for chunk in (7, 4096):
        monkeypatch.setattr(attention.RepeatScorer, "__init__",
                            lambda self, T, c=chunk: (setattr(self, "T", T), setattr(self, "chunk", c),
                                                      setattr(self, "scores", {}))[-1])
        results.append(prefill(tiny, ids, repeat=True).repeat_scores[1])
    torch.testing.assert_close(results[0], results[1])


def test_entropy_allocation_spreads_bytes_and_keeps_the_budget(tiny, ids):
    cache = kvsum.compress(tiny, ids, method="summary", budget=0.25, entropy_allocation=True)
    assert cache.nbytes() <= 0.27 * cache.reference_nbytes
    lengths = [n for layer in cache.layers for n in layer.state.lengths()]
    assert len(set(lengths)) > 1  # heads and layers no longer hold equal shares


def test_prefill_extras_run_only_when_a_method_asks(tiny, ids):
    assert prefill(tiny, ids).surprisal is None  # eviction, quantization, calibration: no output-layer pass
    assert make_method("summary").prefill_options()["surprisal"]
    assert not any(make_method("summary", score="sharp_mass").prefill_options().values())
    assert make_method("streaming_llm").prefill_options() == {}


@pytest.mark.parametrize("rope", [True, False])
def test_cover_at_full_rank_is_exact_and_masks_anchors(rope):
    """The low-rank cover at full rank reproduces attention over its tokens (RoPE undone and redone exactly),
    and the tokens held as anchors are masked out of it for their own head only."""
    from kvsum.calibrate import rope_tables, rotate
    from kvsum.methods.summary.cover import CoverState

    g = torch.Generator().manual_seed(0)
    H, T, d = 3, 50, 16
    tables = {"inv_freq": 1 / 10000 ** (torch.arange(0, d, 2).float() / d), "scaling": 1.0}
    keys = rotate(torch.randn(H, T, d, generator=g), *rope_tables(tables["inv_freq"], 1.0, T))
    values = torch.randn(H, T, d, generator=g)
    exclude = torch.zeros(H, T, dtype=torch.bool)
    exclude[:, :2] = True
    exclude[1, 10] = True
    state = CoverState(keys, values, H * d, H * d, exclude, tables if rope else None, torch.float32)
    q = torch.randn(1, H, 4, d, generator=g)
    ref = (q[0] @ keys.transpose(1, 2) * 0.25).masked_fill(exclude[:, None], float("-inf"))[None]
    s = state.scores(q, 0.25)
    assert torch.equal(torch.isinf(s), torch.isinf(ref))
    torch.testing.assert_close(s.masked_fill(torch.isinf(s), 0), ref.masked_fill(torch.isinf(ref), 0),
                               atol=1e-4, rtol=1e-4)
    p = torch.softmax(s, -1)
    torch.testing.assert_close(state.mix(p), p @ values[None], atol=1e-4, rtol=1e-4)
    assert state.lengths() == [48, 47, 48]


@pytest.mark.parametrize("rows", [1, 3])  # a decoding step's one query row (one index_fill) and several
@pytest.mark.parametrize("center", [False, True])
def test_code_cover_skips_its_anchors_at_a_few_bytes_each(center, rows):
    """The code cover's logits are -inf at the tokens its head holds exactly and unchanged elsewhere; the skipped
    tokens cost their indices (8 bytes each), not a byte for every token of every head."""
    from kvsum.methods.quant.turboquant import TurboQuant
    from kvsum.methods.summary.cover import EXCLUDED_BYTES, MaskedState

    torch.manual_seed(1)
    H, T, d = 3, 301, 64
    inner = TurboQuant(bits=3.5, center=center).build(torch.randn(H, T, d), torch.randn(H, T, d), 3.5, 0)
    exclude = torch.rand(H, T) < 0.1
    state = MaskedState(inner, exclude)
    q = torch.randn(1, H, rows, d)
    s, plain = state.scores(q, 0.125), inner.scores(q, 0.125)
    assert torch.isneginf(s[0].transpose(0, 1)[:, exclude]).all()
    assert torch.equal(s[0].transpose(0, 1)[:, ~exclude], plain[0].transpose(0, 1)[:, ~exclude])
    assert state.lengths() == (T - exclude.sum(1)).tolist()
    assert state.nbytes() == inner.nbytes() + EXCLUDED_BYTES * int(exclude.sum())


@pytest.mark.parametrize("knobs", [dict(cover_share=0.6), dict(cover_bits=2), dict(cover_bits=1.5, cover_basis="pca"),
                                   dict(cover_bits=1.5, cover_center=True), dict(cover_bits=2, cover_unbiased="values"),
                                   dict(cover_bits=2, cover_rotation="hadamard")])
@pytest.mark.parametrize("budget", [0.5, 0.3])
def test_cover_modes_keep_every_token_within_budget(tiny, ids, knobs, budget):
    cache = kvsum.compress(tiny, ids, method="summary", budget=budget, **knobs)
    assert (budget - 0.03) * cache.reference_nbytes <= cache.nbytes() <= (budget + 0.02) * cache.reference_nbytes
    assert all(n == ids.shape[1] for layer in cache.layers for n in layer.lengths())  # anchors + cover = all
    out = tiny.generate(torch.cat([ids, ids[:, :4]], -1), cache=cache, max_new_tokens=4, do_sample=False)
    assert out.shape[1] == ids.shape[1] + 8


def test_code_cover_leaves_the_sinks_to_the_exact_anchors():
    """The sinks' keys are unlike the others: coded with them they would skew the cover's channel split and mean."""
    x = _layer_input(T=300, H=2, budget=0.4)
    x.keys[:, :4] = x.keys[:, :4] * 10 + 20  # sinks far from every other key, as in real models
    state = make_method("summary", cover_bits=3.5, cover_center=True, sinks=4).compress(x)
    anchors, cover = state.parts
    assert cover.inner.T == 296 and (cover.exclude.H, cover.exclude.T) == (2, 296)
    starts = [0, *torch.tensor(anchors.lengths()).cumsum(0)[:-1].tolist()]
    for h, s in enumerate(starts):  # every head's first anchors are the sinks, exact
        assert torch.equal(anchors.keys[s:s + 4].float(), x.keys[h, :4])
    torch.testing.assert_close(cover.inner.k_mean.float()[:, 0], x.keys[:, 4:].mean(1), atol=2e-3, rtol=0)
    assert state.lengths() == [300, 300]


def test_code_cover_widens_keys_in_sharp_layers(tiny, ids):
    cache = kvsum.compress(tiny, ids, method="summary", budget=0.3, cover_bits=2)
    covers = [layer.state.parts[1].inner for layer in cache.layers]  # ConcatState([anchors, MaskedState])
    assert sorted(c.widths[0] for c in covers) == [1.5, 3.5]  # keys 2.5 +- 1 (2 layers), values 1.5
    assert {c.widths[1] for c in covers} == {1.5}
    flat = kvsum.compress(tiny, ids, method="summary", budget=0.3, cover_bits=2, entropy_allocation=False)
    assert {layer.state.parts[1].inner.widths for layer in flat.layers} == {(2.5, 1.5)}


def test_centered_cover_holds_each_layers_mean_key(tiny, ids):
    cache = kvsum.compress(tiny, ids, method="summary", budget=0.3, cover_bits=2, cover_center=True)
    plain = kvsum.compress(tiny, ids, method="summary", budget=0.3, cover_bits=2)
    pre = kvsum.prefill(tiny, ids)
    for layer, ref, full in zip(cache.layers, plain.layers, pre.cache.layers):
        cover = layer.state.parts[1].inner
        assert torch.allclose(cover.k_mean.float(), full.keys[0].float().mean(1, keepdim=True), atol=1e-2)
        assert cover.nbytes() == ref.state.parts[1].inner.nbytes() + cover.k_mean.numel() * 2


def test_unbiased_cover_reads_its_values_unshrunk_in_the_same_bytes(tiny, ids):
    cache = kvsum.compress(tiny, ids, method="summary", budget=0.3, cover_bits=2, cover_unbiased="values")
    plain = kvsum.compress(tiny, ids, method="summary", budget=0.3, cover_bits=2)
    pre = kvsum.prefill(tiny, ids)
    for layer, ref, full in zip(cache.layers, plain.layers, pre.cache.layers):
        cover, plain_cover = layer.state.parts[1].inner, ref.state.parts[1].inner
        v = full.values[0].float()[:, ids.shape[1] - cover.T:]  # the cover codes every token after the sinks
        proj = (cover.values() * v).sum(-1) / v.pow(2).sum(-1)
        assert (proj - 1).abs().max() < 2e-3 < (1 - (plain_cover.values() * v).sum(-1) / v.pow(2).sum(-1)).mean()
        assert torch.equal(cover.keys(), plain_cover.keys()) and cover.nbytes() == plain_cover.nbytes()
    with pytest.raises(kvsum.KVSumError, match="unbiased='yes'"):
        make_method("summary", cover_bits=2, cover_unbiased="yes")


def test_pca_cover_codes_keys_on_the_queries_axes_without_a_layer_shift(tiny, ids):
    cache = kvsum.compress(tiny, ids, method="summary", budget=0.3, cover_bits=2, cover_basis="pca")
    covers = [layer.state.parts[1].inner for layer in cache.layers]
    assert all(isinstance(c.k, KeyTransform) for c in covers)
    assert {c.widths for c in covers} == {(2.5, 1.5)}  # no key shift: pca spreads bits by the queries
    random = kvsum.compress(tiny, ids, method="summary", budget=0.3, cover_bits=2)
    assert cache.nbytes() <= random.nbytes()


def test_unknown_cover_basis_or_rotation_is_a_clear_error():
    with pytest.raises(kvsum.KVSumError, match="cover_basis"):
        make_method("summary", cover_bits=2, cover_basis="hadamard")
    with pytest.raises(kvsum.KVSumError, match="cover_rotation must be one of qr, hadamard"):
        make_method("summary", cover_bits=2, cover_rotation="pca")


def test_hadamard_cover_holds_d_sign_bytes_where_the_dense_rotation_does_not_fit():
    H, T, d = 1, 256, 64  # one KV head, few tokens: the dense fp16 rotation is 1/8 of the layer
    g = torch.Generator().manual_seed(0)
    keys, values, queries = (torch.randn(*shape, generator=g) for shape in ((H, T, d), (H, T, d), (4, 32, d)))
    x = LayerInput(keys, values, queries, torch.arange(T - 32, T), d ** -0.5, 0, 1, 0.25 * 2 * H * T * d * 2,
                   torch.float16)
    with pytest.raises(kvsum.KVSumError, match=r"rotation alone takes 0\.125 .* cover_rotation='hadamard'"):
        make_method("summary", cover_bits=3, score="max").compress(x)
    state = make_method("summary", cover_bits=3, score="max", cover_rotation="hadamard").compress(x)
    assert state.parts[1].inner.R.nbytes() == d
    assert state.nbytes() <= 0.25 * 2 * H * T * d * 2


def test_cover_beyond_the_budget_is_a_clear_error(tiny, ids):
    with pytest.raises(kvsum.KVSumError, match="cover"):
        kvsum.compress(tiny, ids, method="summary", budget=0.1, cover_bits=2)


class _CharTokenizer:
    """Token id i is the i-th character of `chars` (enough to mark sentence ends)."""

    chars = "abcdefgh .!?\n"

    def batch_decode(self, ids):
        return ["".join(self.chars[i] for i in row) for row in ids]


def test_sentence_ends_marks_tokens_holding_an_end_character():
    from kvsum.compress import sentence_ends

    ids = torch.tensor([0, 1, 9, 2, 10, 12, 3, 11, 4, 8])  # a b . c ! \n d ? e space
    assert sentence_ends(_CharTokenizer(), ids).tolist() == [False, False, True, False, True, True, False, True,
                                                             False, False]
    with pytest.raises(kvsum.KVSumError, match="tokenizer"):
        sentence_ends(object(), ids)


def test_sentence_score_keeps_or_drops_whole_sentences():
    """Every token of a sentence gets one score: a sentence ranks by the better of its mean surprisal and its
    peak, so a fact whose value is unsurprising ranks with its surprising word; a stretch longer than
    MAX_SENTENCE without a sentence end is cut into pieces ranked apart."""
    from kvsum.methods.summary.summary import MAX_SENTENCE

    T = 2 * MAX_SENTENCE + 60
    x = _layer_input(T=T)
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
    m = make_method("summary", score="sentence")
    score = m._sentences(x)
    pieces = [(0, 5), (5, 20), (20, 30), (30, 30 + MAX_SENTENCE), (30 + MAX_SENTENCE, 30 + 2 * MAX_SENTENCE)]
    for a, b in pieces:
        assert torch.all(score[a:b] == score[a])  # whole sentences
    first, fact, dense, long1, long2 = (float(score[a]) for a, _ in pieces)
    # the fact by its peak, the dense sentence by its mean, the piece holding 5.0 above the flat one
    assert min(first, fact, dense) > long2 > long1
    x.sentence_ends = None
    with pytest.raises(kvsum.KVSumError, match="tokenizer"):
        m._sentences(x)


def test_sentence_score_needs_the_tokenizer(tiny, ids):
    with pytest.raises(kvsum.KVSumError, match="tokenizer="):
        kvsum.compress(tiny, ids, method="summary", budget=0.25, score="sentence")
    tok = _CharTokenizer()
    small = ids % len(tok.chars)
    cache = kvsum.compress(tiny, small, method="summary", budget=0.25, score="sentence", tokenizer=tok)
    assert cache.nbytes() <= 0.27 * cache.reference_nbytes


@pytest.mark.model
def test_whole_sentences_keep_facts_on_smollm2(smollm2):
    """On the bundled model, at budget 0.125: with whole-sentence anchors summary+turboquant answers multi-key
    questions that single-token surprisal anchors lose (the fact survives without its digits)."""
    from kvsum.eval import run

    model, tok = smollm2
    specs = [("summary+turboquant", dict(score=s), [0.125]) for s in ("sentence", "surprisal")]
    rows = run(model, tok, "multikey", specs, [], [1024], n=4, progress=False)
    sentence, surprisal = (r["score"] for r in rows)
    assert all(r["ratio"] <= 0.125 + 0.02 for r in rows)
    assert sentence >= 50 and sentence > surprisal, (sentence, surprisal)
