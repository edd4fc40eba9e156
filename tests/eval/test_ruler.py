"""The long-context suite (kvsum.eval.ruler, words, code, prompt): exact lengths, determinism, needles, scoring."""

import re
from collections import Counter

import pytest
import torch

from kvsum.errors import KVSumError
from kvsum.eval import TASKS, code, get_task, run
from kvsum.eval.prompt import recall

SUITE = [n for n in TASKS if n not in ("passkey", "multikey", "lm")]
NIAH = [n for n in SUITE if n.startswith("niah")]


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    from kvsum.models import resolve

    return AutoTokenizer.from_pretrained(resolve("smollm2"))


def one(tok, name, length=1024, seed=1000, i=0):
    return list(get_task(name).examples(tok, length, i + 1, seed))[i]


def test_suite_names():
    assert {"niah_single", "niah_single_code", "niah_multikey", "niah_multivalue", "niah_multiquery", "vt",
            "vt_code", "cwe", "fwe"} <= set(SUITE)
    for n in SUITE:
        assert get_task(n).name == n


@pytest.mark.parametrize("name", SUITE)
@pytest.mark.parametrize("length", [700, 2048, 4099])
def test_exact_length(tok, name, length):
    for ex in get_task(name).examples(tok, length, 3, seed=1000):
        assert ex.context_ids.shape[0] == ex.question_ids.shape[0] == 1
        assert ex.context_ids.shape[1] + ex.question_ids.shape[1] == length
        assert ex.expected


@pytest.mark.parametrize("name", SUITE)
def test_deterministic_per_seed(tok, name):
    a, b, c = one(tok, name, seed=1000), one(tok, name, seed=1000), one(tok, name, seed=1001)
    assert torch.equal(a.context_ids, b.context_ids) and torch.equal(a.question_ids, b.question_ids)
    assert a.expected == b.expected
    assert not torch.equal(a.context_ids, c.context_ids)


@pytest.mark.parametrize("name", NIAH + ["vt", "vt_code"])
def test_needles_once(tok, name):
    for i in range(5):  # every value kind of niah_single(_code)
        ex = one(tok, name, 1500, i=i)
        ctx = tok.decode(ex.context_ids[0])
        for v in ex.expected:
            n = len(re.findall(rf"\b{re.escape(v)}\b", ctx))
            assert n == (1 if name.startswith("niah") else 2 if v != ex.expected[-1] else 1), (v, n)
        assert not any(v in tok.decode(ex.question_ids[0]) for v in ex.expected if not name.startswith("vt"))


def test_niah_single_kinds(tok):
    prose = [one(tok, "niah_single", i=i).expected[0] for i in range(3)]
    assert any(re.fullmatch(r"\d{7}", v) for v in prose)
    assert any(re.fullmatch(r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[0-9a-f]{4}-[0-9a-f]{12}", v) for v in prose)
    asks = {tok.decode(one(tok, "niah_single_code", i=i).question_ids[0]).split("?")[0] for i in range(5)}
    assert any("value of the constant" in a for a in asks) and any("function" in a for a in asks)
    assert any("class defines" in a for a in asks)


@pytest.mark.parametrize("name", [n for n in SUITE if n.endswith("_code")])
def test_code_needles_at_statement_boundaries(tok, name):
    for i in range(5):
        ex = one(tok, name, 3000, i=i)
        tail = tok.decode(ex.context_ids[0, ex.needle_pos:])  # from the asked needle: whole statements only
        first, *files = tail.split("\n# file: ")
        compile(first, "<needle>", "exec")
        for body in files:
            compile(body.split("\n", 1)[1], "<haystack>", "exec")
        for line in tail.splitlines()[:3]:
            assert not line[:1].isspace() or line.startswith("    ")  # the needle is at the top level


def test_code_haystack_files_sorted_and_parse():
    fs = code.files()
    paths = [p for p, _, _ in fs]
    assert paths == sorted(paths) and len(paths) > 100
    assert not any("/test" in p or p.startswith("pydoc_data") for p in paths)
    path, units, first = fs[0]
    assert all(u.endswith("\n") for u in units) and first >= 1


def test_cwe_profile(tok):
    ex = one(tok, "cwe", 3000)
    words = Counter(re.findall(r"\d+\. ([a-z]+)", tok.decode(ex.context_ids[0])))
    top = [w for w, _ in words.most_common(len(ex.expected))]
    assert set(top) == set(ex.expected)
    assert min(words[w] for w in ex.expected) > max(c for w, c in words.items() if w not in ex.expected)


def test_fwe_top_words(tok):
    ex = one(tok, "fwe", 3000)
    body = tok.decode(ex.context_ids[0]).split("\n", 1)[1]
    words = Counter(body.split()[1:])  # the first word may be cut
    assert [w for w, _ in words.most_common(3)] == list(ex.expected)


def test_recall():
    assert recall(("4821305",), " 4821305.") == 1.0
    assert recall(("Lantern",), "the LANTERN") == 1.0
    assert recall(("12", "34", "56", "78"), "12, 34 and 99") == 0.5
    assert recall(("a1b2",), "nothing") == 0.0
    with pytest.raises(KVSumError):
        recall((), "x")
    task = get_task("niah_multivalue")
    ex = type("E", (), {"expected": ("1", "2")})()
    assert task.score(ex, "1 and 3") == 0.5


def test_errors(tok):
    with pytest.raises(KVSumError, match="at most"):
        code.haystack(tok, 10**6, 0, packages=("json",))
    with pytest.raises(KVSumError, match="too short"):
        one(tok, "niah_multiquery", 60)
    with pytest.raises(KVSumError, match="too short"):
        one(tok, "niah_single_code", 80)
    with pytest.raises(KVSumError, match="too short"):
        one(tok, "cwe", 200)
    with pytest.raises(KVSumError, match="haystack"):
        get_task("niah_single").__class__(haystack="poetry").example(tok, 1000, 0)


def test_chat_template(tok):
    task = get_task("niah_single").__class__(chat=True)
    ex = task.example(tok, 1024, 1000)
    assert ex.context_ids.shape[1] + ex.question_ids.shape[1] == 1024
    assert tok.decode(ex.context_ids[0]).startswith("<|im_start|>")
    assert "<|im_start|>assistant" in tok.decode(ex.question_ids[0])


@pytest.mark.model
def test_smoke_runner(smollm2):
    model, tok = smollm2
    rows = run(model, tok, ["niah_single", "vt_code"], ["full"], [1.0], [400], n=1, seed=1000, progress=False)
    assert [r["task"] for r in rows] == ["niah_single", "vt_code"]
    assert all(0 <= r["score"] <= 100 and r["n"] == 1 for r in rows)
