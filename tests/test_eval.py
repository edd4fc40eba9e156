import json
import math
import re
from types import SimpleNamespace

import pytest
import torch

import kvsum
from kvsum.errors import KVSumError
from kvsum.eval import DEPTHS, get_task, markdown, run, text, write
from kvsum.eval.metrics import answer_margin, fidelity

from .conftest import tiny_llama


class CharTokenizer:
    """One token per ASCII character: real task text within the tiny Llama's 128-token vocabulary."""

    pad_token_id = eos_token_id = 0

    def __call__(self, s, add_special_tokens=False):
        return SimpleNamespace(input_ids=[ord(c) if ord(c) < 128 else ord("?") for c in s])

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(int(i)) for i in ids)


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(kvsum.models.resolve("smollm2"))


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


@pytest.mark.parametrize("name", ["passkey", "multikey", "lm"])
@pytest.mark.parametrize("length", [512, 2000])
def test_tasks_exact_length_and_deterministic(tok, name, length):
    task = get_task(name)
    a, b, c = (task.example(tok, length, seed=s, depth=0.4) for s in (7, 7, 8))
    assert a.context_ids.shape == (1, length)
    assert torch.equal(a.context_ids, b.context_ids) and torch.equal(a.question_ids, b.question_ids)
    assert a.answer == b.answer
    assert not torch.equal(a.context_ids, c.context_ids)


@pytest.mark.parametrize("depth", DEPTHS)
def test_passkey_needle_at_depth(tok, depth):
    ex = get_task("passkey").example(tok, 2000, seed=1, depth=depth)
    assert re.fullmatch(r"\d{5}", ex.answer)
    context = tok.decode(ex.context_ids[0])
    assert context.count(ex.answer) == 2  # stated twice in its own paragraph, nowhere else
    tail = tok.decode(ex.context_ids[0, ex.needle_pos:])
    assert tail.startswith(f"The pass key is {ex.answer}.")
    assert tok.decode(ex.context_ids[0, ex.needle_pos - 2:ex.needle_pos]) == "\n\n"
    assert abs(ex.needle_pos / 2000 - depth) < 0.06
    assert tok.decode(ex.question_ids[0]) == "\n\nThe pass key is"


@pytest.mark.parametrize("depth", [0.1, 0.5, 0.9])
def test_multikey_facts_and_asked_depth(tok, depth):
    ex = get_task("multikey").example(tok, 2000, seed=2, depth=depth)
    context = tok.decode(ex.context_ids[0])
    facts = re.findall(r"The ([a-z ]+) for the (\w+) is (\d{5})\.", context)
    assert len(facts) == 5 and all(len(set(col)) == 5 for col in zip(*facts))  # distinct relations, words, values
    asked = tok.decode(ex.question_ids[0]).strip()
    assert tok.decode(ex.context_ids[0, ex.needle_pos:]).startswith(f"{asked} {ex.answer}.")
    assert abs(ex.needle_pos / 2000 - depth) < 0.06


def test_lm_continuation_follows_prefix(tok):
    ex = get_task("lm").example(tok, 700, seed=5)
    assert ex.context_ids.shape == (1, 700) and ex.question_ids.shape == (1, 128)
    whole = text.join(text.haystack(tok, 828, seed=5), text.sep_ids(tok))
    assert torch.cat([ex.context_ids, ex.question_ids], -1)[0].tolist() == whole


def test_scores():
    pk, mk = get_task("passkey"), get_task("multikey")
    ex = SimpleNamespace(answer="84867")
    assert pk.score(ex, " 84867. Remember") == 1.0
    assert pk.score(ex, " 8486 7") == 0.0
    assert mk.score(ex, " 84867.") == 1.0
    assert mk.score(ex, " 12345 84867") == 0.0  # the first number must be the value
    assert mk.score(ex, " 848670") == 0.0
    assert mk.score(ex, " unknown") == 0.0


def test_fidelity_identical_is_exactly_zero_and_known_kl():
    logits = torch.randn(10, 50, generator=torch.Generator().manual_seed(0))
    targets = torch.randint(0, 50, (9,))
    f = fidelity(logits, logits, targets)
    assert f["kl"] == 0.0 and f["top1"] == 1.0 and f["nll"] == f["nll_full"]
    p, q = torch.tensor([[0.0, 0.0]]), torch.tensor([[math.log(3.0), 0.0]])  # (1/2, 1/2) vs (3/4, 1/4)
    g = fidelity(p, q, torch.tensor([0]))
    assert g["kl"] == pytest.approx(0.5 * math.log(0.5 / 0.75) + 0.5 * math.log(0.5 / 0.25))
    assert g["top1"] == 1.0  # tie in p resolves to index 0, as in q
    assert g["nll"] == pytest.approx(-math.log(0.75))


def test_answer_margin_is_the_worst_steps_lead_over_the_best_other_token():
    logits = torch.tensor([[1.0, 4.0, 2.5], [3.0, 0.0, 3.5]])
    assert answer_margin(logits, torch.tensor([1, 2])) == pytest.approx(0.5)  # step 2: 3.5 - 3.0
    assert answer_margin(logits, torch.tensor([1, 0])) == pytest.approx(-0.5)  # step 2 would pick token 2
    assert answer_margin(logits, torch.tensor([2, 2])) == pytest.approx(-1.5)  # step 1: 2.5 - 4.0


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


def test_write_json_and_markdown(tmp_path):
    rows = run(tiny_llama(), CharTokenizer(), ["passkey", "lm"], ["full", "streaming_llm"], [0.5], [260], n=1,
               progress=False)
    js, md = write(rows, tmp_path / "sub" / "res", model="tiny", command="eval --x")
    data = json.loads(js.read_text())
    assert data["rows"] == json.loads(json.dumps(rows))
    for key in ("model", "date", "transformers", "torch", "command"):
        assert data["meta"][key]
    assert data["meta"]["model"] == "tiny" and data["meta"]["command"] == "eval --x"
    report = md.read_text()
    assert report == markdown(rows, data["meta"])
    tables = [line for line in report.splitlines() if line.startswith("|")]
    assert len(tables) == 2 * (2 + 2)  # per task: header, rule, full row, streaming_llm row
    assert sum(line.startswith("| length | method |") for line in tables) == 2
    assert "| full % |" in report and "| KL | top-1 % | ppl ratio |" in report
    assert all(line.count("|") == tables[0].count("|") for line in tables[:4])


@pytest.mark.model
def test_full_cache_passkey_1k_is_perfect(smollm2):
    model, tokenizer = smollm2
    (row,) = run(model, tokenizer, "passkey", ["full"], [], [1024], n=3, progress=False)
    assert row["score"] == 100.0, row["examples"]
