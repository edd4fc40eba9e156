"""kvsum/methods/summary/default.py: `summary` with no knobs is configured by budget, by one rule."""

import pytest
import torch

import kvsum
from kvsum.methods import make_method, prefill_needs
from kvsum.methods.summary import default
from kvsum.shape import ModelShape
from tests.helpers import ProbeTokenizer, SentenceTokenizer, random_ids, tiny_llama, tiny_qwen2

QUERY = torch.tensor([[5, 6, 7, 8]])


def _shape(head_dim: int = 64, key_bias: bool = False) -> ModelShape:
    """A model's shape as kvsum.compress passes it to the rule: only the head dim and the key bias are read."""
    return ModelShape(n_layers=1, n_kv_heads=1, head_dim=head_dim, max_len=8192, scales=[1.0], key_bias=key_bias)


def _logits(model, cache, T):
    with torch.no_grad():
        return model(QUERY, past_key_values=cache, position_ids=torch.arange(T, T + 4)[None]).logits


def test_the_rule_orders_its_configurations_by_budget():
    top = [(c.name, c.knobs) for c in default.choices(0.25, 2048, sentences=True)]
    unbiased = {"unbiased": "values"}  # every code of the rule reads its values unbiased
    assert top[0] == ("summary", {"cover": kvsum.spec.Spec("turboquant", {"bits": 3.5, "center": True, **unbiased}),
                                  "score": "surprisal"})
    local = {"score": "sentence", "key_shift": 1, "center": True, **unbiased, "entropy_allocation": False,
             "summary_window": 64, "summary_recent_exact": 8, "summary_anchor_share": 1.0}
    assert top[1] == ("summary+turboquant", {**local, "summary_attention_share": 0.3, "skew": 1})  # the vote's 3 in 10
    tenth = [(c.name, c.knobs) for c in default.choices(0.1, 2048, sentences=True)]
    retrieval = {"summary_retrieval_score": 0.14, "summary_retrieval_weight": 2.0}
    # below RETRIEVAL_BELOW: the sentences in the retrieval heads alone
    assert tenth[0] == ("summary+turboquant", {**local, **retrieval, "skew": 1})
    assert tenth[1] == top[1]  # then, without scores, the sentences in every head
    assert default.choices(0.125, 2048, True)[0].knobs == top[1][1]  # from RETRIEVAL_BELOW the vote in every head
    rule = default.choices(0.1, 2048, True)[0].method
    first = rule.first
    assert not first.entropy_allocation  # a sentence kept alike in every layer
    assert (first.window, first.recent_exact) == (64, 8)  # at 3 bits the newest tokens stay exact
    assert (first.anchor_share, first.attention_share) == (1.0, 0.0)  # sentences alone in the retrieval heads,
    assert (first.retrieval_score, first.retrieval_weight) == (0.14, 2.0)  # those scoring 0.14, twice the bytes
    fallback = default.choices(0.1, 2048, True)[1].method.first
    assert (fallback.retrieval_score, fallback.attention_share) == (0.0, 0.3)  # the window's vote: 3 anchors in 10
    assert rule.quant.unbiased == "values"
    assert rule.quant.widths(3) == (4, 2)  # keys a bit wider than values
    assert top[-1] == ("summary", {"by_budget": False})  # summary's own defaults come last
    low = [(c.name, c.knobs) for c in default.choices(0.1, 2048, sentences=False)]
    assert low == [("summary+turboquant", {"center": True, **unbiased, "entropy_allocation": False}),
                   ("summary", {"by_budget": False})]  # no cover, no sentences
    low_vote = {**top[1][1], "summary_attention_share": 0.45}  # below 0.1 of the bytes the vote takes more anchors
    assert default.choices(0.05, 2048, True)[0].knobs == tenth[0][1]  # the retrieval row at every budget below
    assert default.choices(0.05, 2048, True)[1].knobs == low_vote  # 102 tokens' worth a head: 3 bits, the window
    assert default.choices(0.0999, 4096, True)[1].method.first.attention_share == 0.45
    assert default.choices(0.1, 4096, True)[1].method.first.attention_share == 0.3
    two = default.choices(0.03, 2048, sentences=True)  # 61 tokens' worth, under TWO_BITS_BELOW: the codes are 2-bit
    assert [c.knobs.get("bits") for c in two] == [None, 2, 2, None] and two[1].method.bits == 2
    assert two[0].knobs == tenth[0][1]  # but the retrieval row first, at 3 bits
    assert "61 < 80 tokens' worth" in two[1].why
    assert default.choices(0.03, 4096, True)[1].knobs == low_vote  # the same budget of a longer prompt: 3 bits
    assert default.choices(0.1, 700, True)[1].knobs.get("bits") == 2  # and a tenth of a short one: 2 bits
    two_first = two[1].method.first
    assert (two_first.window, two_first.recent_exact, two_first.attention_share) == (32, 0, 0)  # 2 bits: sentences
    for c in two:  # every configuration the rule builds stands for itself
        assert c.method.choices(0.03, 100, True)[0].method is c.method


def test_every_code_of_the_rule_takes_the_hadamard_rotation_where_the_head_dim_has_one():
    """The dense rotation's d * d fp16 bytes a layer are bytes the codes' tokens do not get: the rule's codes (the
    compositions', the covers') take the seeded-sign Hadamard rotation (d bytes) where the head dim is a power of
    2, else the dense one; kvsum.compress passes the model's head dim, and at a budget where the dense rotation
    costs a large share of the bytes the same budget holds more coded tokens."""
    cover = default.choices(0.25, 2048, True, _shape(key_bias=True))
    assert [c.knobs["cover"].knobs["rotation"] for c in cover[:2]] == ["hadamard"] * 2
    assert [c.method.cover.rotation for c in cover[:2]] == ["hadamard"] * 2
    assert {**default.PRE_ROPE.knobs, "rotation": "hadamard"} == cover[0].knobs["cover"].knobs
    for budget, tokens in ((0.1, 2048), (0.03, 2048)):
        hd = default.choices(budget, tokens, True, _shape())
        dense = default.choices(budget, tokens, True)
        assert [c.knobs.get("rotation") for c in hd] == ["hadamard"] * (len(hd) - 1) + [None]  # not summary's own
        assert [c.knobs for c in dense] == [{k: v for k, v in c.knobs.items() if k != "rotation"} for c in hd]
        assert hd[0].method.quant.rotation == "hadamard" and dense[0].method.quant.rotation == "qr"
    no_h = [c.knobs for c in default.choices(0.1, 2048, True, _shape(96))]  # no Hadamard matrix of order 96
    assert no_h == [c.knobs for c in default.choices(0.1, 2048, True)]
    model, ids, tok = tiny_llama(head_dim=64, heads=2, kv_heads=1), random_ids(600, 4), SentenceTokenizer()
    ids = ids % len(SentenceTokenizer.chars)
    cache = kvsum.compress(model, ids, method="summary", budget=0.1, tokenizer=tok)
    assert cache.decision.knobs["rotation"] == "hadamard" and "Hadamard" in cache.decision.reason
    dense = kvsum.compress(model, ids, method="summary+turboquant", budget=0.1, tokenizer=tok,
                           **{k: v for k, v in cache.decision.knobs.items() if k != "rotation"})
    kept = [sum(s.lengths()) for s in (cache.layers[0].state.parts[-1], dense.layers[0].state.parts[-1])]
    assert kept[0] > kept[1] and cache.nbytes() <= 0.1 * cache.reference_nbytes * 1.02


@pytest.mark.parametrize("budget, sentences, want", [(0.5, True, "summary"), (0.1, True, "summary+turboquant"),
                                                     (0.1, False, "summary+turboquant")])
def test_bare_summary_is_the_configuration_the_rule_picks_bit_for_bit(budget, sentences, want):
    """method="summary" with no knobs gives exactly what the rule's configuration gives when asked for by name,
    and cache.decision says which and why."""
    model, tok = tiny_llama(), SentenceTokenizer() if sentences else None
    ids = torch.randint(0, len(SentenceTokenizer.chars), (1, 600), generator=torch.Generator().manual_seed(4))
    cache = kvsum.compress(model, ids, method="summary", budget=budget, tokenizer=tok)
    d = cache.decision
    assert d.method == want == cache.method and "configured by budget" in d.reason and d.budget == budget
    assert ("sentence" in str(d.knobs)) == (sentences and budget < default.COVER_FROM)
    same = kvsum.compress(model, ids, method=d.method, budget=budget, tokenizer=tok, **d.knobs)
    assert not hasattr(same, "decision")  # a configured method stands for itself
    assert cache.nbytes() == same.nbytes() <= budget * cache.reference_nbytes * 1.02
    assert torch.equal(_logits(model, cache, 600), _logits(model, same, 600))


def test_a_model_whose_keys_have_a_bias_gets_the_cover_coded_before_rope():
    """Where the key projection has a bias (Qwen2; ModelShape.key_bias), the cover's keys are coded before RoPE,
    the rotated cover next (a RoPE kvsum cannot read); below the cover's budgets and on Llama nothing changes.
    Bare summary on a random Qwen2 picks it, bit for bit the configuration asked for by name, and on that model
    (keys less a large bias, turned with the position) it reads the continuation closer than the rotated cover."""
    assert [c.knobs for c in default.choices(0.25, 2048, True, _shape(96, key_bias=True))][:2] == [
        {"cover": default.PRE_ROPE, "score": "surprisal"}, default.COVER[1]]
    assert [c.knobs for c in default.choices(0.25, 2048, True)][0] == default.COVER[1]
    assert ([c.knobs for c in default.choices(0.1, 2048, True, _shape(96, key_bias=True))]
            == [c.knobs for c in default.choices(0.1, 2048, True)])
    model, ids = tiny_qwen2(), random_ids(1200, 7)
    assert ModelShape.of(model).key_bias and not ModelShape.of(tiny_llama()).key_bias
    cache = kvsum.compress(model, ids, method="summary", budget=0.3)
    assert cache.decision.knobs == default.hadamard(default.COVER_PRE_ROPE)[1]  # head dim 16: in the Hadamard rotation
    assert "before RoPE" in cache.decision.reason
    same = kvsum.compress(model, ids, method="summary", budget=0.3, **cache.decision.knobs)
    rotated = kvsum.compress(model, ids, method="summary", budget=0.3, **default.hadamard(default.COVER)[1])
    full = kvsum.compress(model, ids, method="full", budget=1.0)
    ref = _logits(model, full, 1200)
    assert torch.equal(_logits(model, cache, 1200), _logits(model, same, 1200))
    err = [(_logits(model, c, 1200) - ref).abs().max() for c in (cache, rotated)]
    assert err[0] < err[1]


def test_any_knob_or_by_budget_false_gives_summary_as_configured():
    model, ids = tiny_llama(), random_ids(300, 5)
    for knobs in ({"by_budget": False}, {"score": "surprisal"}, {"window": 16}):
        cache = kvsum.compress(model, ids, method="summary", budget=0.25, **knobs)
        assert cache.method == "summary" and not hasattr(cache, "decision")
    part = make_method("summary+turboquant").first  # a composition's summary is never the rule
    assert part.by_budget is False and part.choices(0.1, 300, True)[0].method is part


def test_a_configuration_that_does_not_fit_gives_way_and_the_decision_says_so():
    """On 300 tokens of the tiny model the 3.5-bit cover needs more than 0.25: the next configuration runs."""
    model, ids = tiny_llama(), random_ids(300, 3)
    cache = kvsum.compress(model, ids, method="summary", budget=0.25)
    assert cache.decision.method == "summary+turboquant" and "does not fit this prompt" in cache.decision.reason
    with pytest.raises(kvsum.KVSumError, match="budget"):  # a bad budget is refused before any configuration
        kvsum.compress(model, ids, method="summary", budget=0.0)


def test_sentence_ends_are_optional_for_the_rule_and_required_when_asked_for():
    auto, sentence = make_method("summary"), make_method("summary", score="sentence")
    assert prefill_needs([auto]) == {"surprisal": True, "sentences": "optional", "retrieval": "optional"}
    assert prefill_needs([auto, sentence])["sentences"] is True
    model, ids = tiny_llama(), torch.randint(0, len(SentenceTokenizer.chars), (1, 200))
    assert kvsum.prefill(model, ids, **prefill_needs([auto])).sentence_ends is None  # no tokenizer: none
    assert kvsum.prefill(model, ids, tokenizer=SentenceTokenizer(), **prefill_needs([auto])).sentence_ends is not None
    with pytest.raises(kvsum.KVSumError, match="tokenizer"):
        kvsum.prefill(model, ids, **prefill_needs([sentence]))


def test_the_rule_keeps_sentences_in_the_retrieval_heads_where_the_tokenizer_can_probe_them():
    """With a tokenizer that encodes (the probe runs), the rule's first row below the cover holds the sentences in
    the heads of retrieval score at least 0.14, the vote in the others, and equals that row asked for by name;
    with one that only decodes (no scores) it takes the next row and says why."""
    model = tiny_llama(layers=4, kv_heads=2)
    ids = torch.randint(0, len(SentenceTokenizer.chars), (1, 900), generator=torch.Generator().manual_seed(5))
    cache = kvsum.compress(model, ids, method="summary", budget=0.1, tokenizer=ProbeTokenizer())
    assert cache.decision.knobs["summary_retrieval_score"] == 0.14
    lengths = [s.parts[-1].lengths() for s in (layer.state for layer in cache.layers)]
    assert sum(len(set(n)) > 1 for n in lengths) == 1  # none scores 0.14: the top head alone, its layer ragged
    same = kvsum.compress(model, ids, method="summary+turboquant", budget=0.1, tokenizer=ProbeTokenizer(),
                          **cache.decision.knobs)
    assert cache.nbytes() == same.nbytes() and [s.parts[-1].lengths() for s in (x.state for x in same.layers)] \
        == lengths
    plain = kvsum.compress(model, ids, method="summary", budget=0.1, tokenizer=SentenceTokenizer())
    assert plain.decision.knobs["summary_attention_share"] == 0.3 and "retrieval score" in plain.decision.reason
