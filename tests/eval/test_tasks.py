"""kvsum/eval/tasks.py: the tasks' examples (exact length, deterministic, needles at depth) and their scores."""

import re
from types import SimpleNamespace

import pytest
import torch

from kvsum.eval import DEPTHS, get_task, text


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
