"""kvsum/eval/runner.py: rows of tasks x methods x budgets over shared prefills."""

import pytest

from kvsum.errors import KVSumError
from kvsum.eval import run
from tests.helpers import CharTokenizer, tiny_llama


def test_run_lm_full_is_exact_and_eviction_is_not():
    rows = run(tiny_llama(), CharTokenizer(), "lm", ["full", "streaming_llm"], [0.25], [300], n=2, progress=False)
    full, sl = rows
    assert (full["method"], full["budget"], sl["method"], sl["budget"]) == ("full", 1.0, "streaming_llm", 0.25)
    assert full["kl"] == 0.0 and full["top1"] == 100.0 and full["ppl_ratio"] == 1.0
    assert sl["kl"] > 0 and sl["ppl_ratio"] != 1.0
    assert sl["score"] == sl["kl"] and sl["full_score"] == 0.0


def test_run_retrieval_rows_have_full_score_and_bytes():
    methods = ["full", ("streaming_llm", {"sinks": 2}), "random"]
    rows = run(tiny_llama(), CharTokenizer(), "passkey", methods, [0.5, 0.25], [300], n=2, progress=False)
    assert [(r["method"], r["budget"]) for r in rows] == [
        ("full", 1.0), ("streaming_llm", 0.5), ("streaming_llm", 0.25), ("random", 0.5), ("random", 0.25)]
    for r in rows:
        assert r["task"] == "passkey" and r["length"] == 300 and r["n"] == 2 and len(r["examples"]) == 2
        assert r["full_score"] == rows[0]["score"]  # the same examples under the full cache
        assert 0 <= r["score"] <= 100 and r["bytes"] > 0 and r["seconds"] > 0
        assert r["full_bytes"] == 2 * 2 * 2 * 16 * 2 * 300  # layers x K,V x heads x dim x 2 bytes x T
        assert r["ratio"] == pytest.approx(r["bytes"] / r["full_bytes"])
        if r["method"] != "full":
            assert r["ratio"] <= r["budget"] + 0.02
    assert rows[1]["knobs"] == {"sinks": 2} and rows[3]["knobs"] == {}
    assert rows[2]["bytes"] < rows[1]["bytes"] < rows[0]["bytes"]


def test_run_rejects_unknown_method_before_work():
    with pytest.raises(KVSumError, match="unknown method"):
        run(None, None, "passkey", ["nope"], [0.5], [300], n=1, progress=False)


def test_rows_say_what_summary_by_budget_became():
    """summary with no knobs records the configuration the rule chose per example (and the table shows it)."""
    from kvsum.eval.report import _chosen
    rows = run(tiny_llama(), CharTokenizer(), "passkey", ["summary", ("summary", {"by_budget": False})], [0.1],
               [300], n=1, progress=False)
    auto, plain = rows
    # no sentences; 30 tokens' worth a head
    chosen = "summary+turboquant:center=True,unbiased=values,entropy_allocation=False,bits=2,rotation=hadamard"
    assert auto["chosen"] == [chosen] and auto["examples"][0]["chosen"] == chosen
    assert "chosen" not in plain and _chosen(auto) == "by budget: " + chosen


def test_a_refusal_ends_the_run_unless_recorded():
    """turboquant's codes do not fit 0.03 of the bytes: the run raises, or with refusals=True records it on its
    row and still scores the configurations that fit (the same prefills)."""
    model, tok, methods = tiny_llama(), CharTokenizer(), ["full", "turboquant", "streaming_llm"]
    with pytest.raises(KVSumError, match="turboquant"):
        run(model, tok, "passkey", methods, [0.03], [300], n=1, progress=False)
    full, tq, sl = run(model, tok, "passkey", methods, [0.03], [300], n=2, progress=False, refusals=True)
    assert tq["refused"] and "turboquant" in tq["refused"] and "\n" not in tq["refused"] and "score" not in tq
    assert (tq["method"], tq["budget"], tq["length"]) == ("turboquant", 0.03, 300)
    assert full["n"] == sl["n"] == 2 and sl["ratio"] <= 0.03 + 0.02


def test_a_prompt_at_the_window_leaves_room_for_its_answer():
    """RULER's sizing: prompt + answer (or lm continuation) fit the model's window; a shorter length is as asked."""
    from kvsum.eval.runner import prompt_length
    from kvsum.eval.tasks import get_task
    model = tiny_llama()
    model.config.max_position_embeddings = 320
    passkey, lm = get_task("passkey"), get_task("lm")
    assert prompt_length(model, passkey, 300) == 300
    assert prompt_length(model, passkey, 320) == 320 - passkey.max_new_tokens
    assert prompt_length(model, lm, 320) == 320 - lm.continuation
    full, = run(model, CharTokenizer(), "passkey", ["full"], [1.0], [320], n=1, progress=False)
    assert full["length"] == 320 and full["full_bytes"] == 2 * 2 * 2 * 16 * 2 * (320 - passkey.max_new_tokens)
