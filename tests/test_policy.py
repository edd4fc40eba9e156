"""kvsum/policy.py: full cache where compression does not pay, compressed where it does."""

import pytest

import kvsum
from kvsum.breakeven import crossing
from kvsum.errors import KVSumError
from tests.helpers import CharTokenizer, random_ids, tiny_llama

# the rule below the cover without a tokenizer, on 300 tokens at 0.1 (30 tokens' worth a head, under TWO_BITS_BELOW;
# head dim 16: in the Hadamard rotation)
CODES = {"center": True, "unbiased": "values", "entropy_allocation": False, "bits": 2, "rotation": "hadamard"}
LENGTHS = [256, 512, 1024, 2048, 4096]


def table(mid=(2.0, 1.9, 1.8, 1.7, 1.6), long=(1.5, 1.3, 1.1, 0.95, 0.8), budget=0.25):
    rows = {"turboquant": {"ratio": list(mid)}, "summary": {"ratio": list(long)}}
    return {"lengths": LENGTHS, "new_tokens": 64, "budget": budget, "methods": rows}


def test_thresholds_come_from_the_table():
    p = kvsum.Policy(table=table())
    assert (p.mid, p.long) == ("turboquant", "summary")
    th = p.thresholds("fast")
    assert th["compress_from"] == crossing(LENGTHS, list(table()["methods"]["summary"]["ratio"]), 1.0)
    assert th["long_from"] == 256  # summary is cheaper than turboquant everywhere in this table
    assert p.thresholds("memory")["compress_from"] == 0
    slower = kvsum.Policy(table=table(long=(1.5, 1.4, 1.3, 1.2, 1.1)))
    assert slower.thresholds()["compress_from"] is None  # never pays within the grid


def test_full_below_break_even_mid_then_long():
    # turboquant cheaper than summary below ~1.4k, and both pay from 512 on
    p = kvsum.Policy(table=table(mid=(1.2, 0.9, 0.85, 0.8, 0.8), long=(2.0, 1.5, 0.9, 0.6, 0.5)), latency="fast")
    th = p.thresholds()
    assert 256 < th["compress_from"] < 512 < th["long_from"] < 2048
    assert p.choose(200).method == "full" and p.choose(200).budget == 1.0
    d = p.choose(700)
    assert (d.method, d.budget) == ("turboquant", 0.25)
    assert p.choose(3000).method == "summary"
    assert "compress_from" in d.reason


def test_memory_binding_compresses_whatever_the_length():
    p = kvsum.Policy(table=table(mid=(1.2, 0.9, 0.85, 0.8, 0.8), long=(2.0, 1.5, 0.9, 0.6, 0.5)), latency="fast")
    assert p.choose(100, memory=0.5).method == "turboquant" and p.choose(100, memory=0.5).budget == 0.5
    low = p.choose(100, memory=0.1)  # below what low-bit codes reach: the flagship, configured when it compresses
    assert (low.method, low.knobs) == ("summary", {}) and "configured by budget" in low.reason
    own = kvsum.Policy(table=p.table, latency="fast", knobs={"summary": {"score": "mass"}})
    assert own.choose(100, memory=0.1).knobs == {"score": "mass"}  # the user's own knobs: no rule
    assert p.choose(100, memory=1.0).method == "full"


def test_balanced_keeps_quantization_until_it_costs_half_again_the_full_cache():
    p = kvsum.Policy(table=table(mid=(1.2, 1.3, 1.6, 1.8, 2.0), long=(1.3, 1.3, 1.3, 1.3, 1.3)))
    th = p.thresholds()
    assert th["compress_from"] is None  # nothing pays: the full cache unless memory binds
    assert 512 < th["long_from"] < 1024
    assert p.choose(3000).method == "full"
    assert p.choose(600, memory=0.3).method == "turboquant"
    assert p.choose(1500, memory=0.3).method == "summary"  # configured by budget: its cover fits 0.3
    assert p.thresholds("fast")["long_from"] == 512  # from where summary is no slower than turboquant
    assert p.thresholds("memory") == {"compress_from": 0, "long_from": None}
    assert p.choose(3000, latency="memory").method == "turboquant"


def test_memory_in_bytes_uses_the_model_shape():
    model = tiny_llama()  # 2 layers, 2 KV heads, head dim 16: 256 bytes per token at 16 bits
    p = kvsum.Policy(table=table(mid=(1.2, 0.9, 0.85, 0.8, 0.8), long=(2.0, 1.5, 0.9, 0.6, 0.5)), latency="fast")
    d = p.choose(100, model, memory=256 * 100 // 2)
    assert (d.method, d.budget) == ("turboquant", 0.5)
    assert p.choose(100, model, memory=10 ** 9).method == "full"
    with pytest.raises(KVSumError, match="needs the model"):
        p.choose(100, memory=4096)


@pytest.mark.parametrize("kwargs, match", [(dict(latency="quick"), "latency"), (dict(memory=-1), "memory"),
                                           (dict(memory=2.5), "memory"),
                                           (dict(table="/nonexistent.json"), "cannot read")])
def test_bad_arguments_name_what_is_accepted(kwargs, match):
    with pytest.raises(KVSumError, match=match):
        kvsum.Policy(**{"table": table(), **kwargs})


def test_compress_with_policy_follows_the_decision(ids):
    model = tiny_llama()
    t = table(mid=(1.2, 0.9, 0.85, 0.8, 0.8), long=(2.0, 1.5, 0.9, 0.6, 0.5))
    t["methods"] = {"streaming_llm": t["methods"]["turboquant"], "snapkv": t["methods"]["summary"]}
    p = kvsum.Policy(table=t, mid="streaming_llm", long="snapkv", knobs={"streaming_llm": {"sinks": 2}})
    short = kvsum.compress(model, ids[:, :200], policy=p)
    assert short.decision.method == "full" and short.method == "full"
    assert short.get_seq_length() == 200
    mid = p.compress(model, ids, memory=0.5)
    assert mid.decision.method == "streaming_llm" and mid.method == "streaming_llm"
    assert mid.ratio() <= 0.5 + 0.02
    assert mid.layers[0].state.lengths() == kvsum.compress(model, ids, method="streaming_llm", budget=0.5,
                                                          sinks=2).layers[0].state.lengths()


def test_shipped_table_loads_and_gives_a_policy():
    p = kvsum.Policy()
    assert set(p.table["lengths"]) and p.mid in p.table["methods"] and p.long in p.table["methods"]
    assert p.choose(64).method == "full"  # compression never pays on a 64-token prompt


@pytest.mark.parametrize("memory", [0.25, None])
def test_several_questions_from_one_compression_answer_as_each_alone(tiny, memory):
    """questions=[...] answers each question on a fork of one compressed prefix: what each gets on its own fresh
    compression (memory binds: compressed; it does not: the full cache, prefilled once)."""
    tok, ctx = CharTokenizer(), random_ids(400, 3)
    policy = kvsum.Policy(memory=memory)
    questions = ["Where is the key?", "And the value"]
    answers, prefix = kvsum.generate(tiny, tok, ctx, questions=questions, policy=policy, max_new_tokens=12,
                                     return_cache=True)
    assert prefix.get_seq_length() == ctx.shape[1]  # the prefix itself read no question
    assert prefix.method != "full" if memory else prefix.method == "full"
    alone = [kvsum.generate(tiny, tok, ctx, q, policy=policy, max_new_tokens=12) for q in questions]
    if memory:
        assert answers == alone
    again = kvsum.generate(tiny, tok, ctx, questions=questions[::-1], cache=prefix, max_new_tokens=12)
    assert again == answers[::-1]  # a given (e.g. loaded) prefix serves any number of questions
    for bad, match in ((dict(questions=[]), "non-empty list"), (dict(questions=["a", ""]), "at least one token"),
                       (dict(questions=["a"], cache=kvsum.compress(tiny, ctx[:, :300], method="snapkv")),
                        "holds 300 tokens")):
        with pytest.raises(KVSumError, match=match):
            kvsum.generate(tiny, tok, ctx, policy=policy, **bad)


def test_the_policy_falls_back_where_the_flagship_cannot_run(tiny):
    """Summary's configuration by budget needs a tokenizer below its cover (whole sentences) and a prompt long
    enough for the cover: without either, the policy takes the next configuration and says so."""
    ids = random_ids(300, 3)
    p = kvsum.Policy(memory=0.1)
    cache = kvsum.compress(tiny, ids, policy=p)  # no tokenizer: no sentences
    assert (cache.decision.method, cache.decision.knobs) == ("summary+turboquant", CODES)
    assert "no tokenizer" in cache.decision.reason and cache.ratio() <= 0.1 + 0.02
    cache = kvsum.compress(tiny, ids, policy=kvsum.Policy(memory=0.26, latency="memory", mid_min_budget=0.3))
    assert "does not fit this prompt" in cache.decision.reason  # tiny head dims: the cover needs 0.3 here
    assert cache.decision.method == "summary+turboquant"


def test_generate_keeps_what_summary_by_budget_became():
    """generate's cache.decision is the compressed cache's: the configuration summary became, not bare summary."""
    model, tok, ctx = tiny_llama(), CharTokenizer(), random_ids(300, 3)
    _, cache = kvsum.generate(model, tok, ctx, "Where?", policy=kvsum.Policy(memory=0.1), max_new_tokens=2,
                              return_cache=True)
    assert (cache.decision.method, cache.decision.knobs) == ("summary+turboquant", CODES)
    assert cache.decision.spec == ("summary+turboquant:center=True,unbiased=values,entropy_allocation=False,bits=2,"
                                   "rotation=hadamard")
    assert "configured by budget" in cache.decision.reason
