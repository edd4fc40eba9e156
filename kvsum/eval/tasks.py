"""Evaluation tasks in the query-agnostic setting: the context is compressed before the question is seen.

Each task turns (tokenizer, length in tokens, seed, depth) into an `Example`: `context_ids` (1, T)
is what gets compressed, `question_ids` (1, q) is appended after compression.

Prompt format (plain text, no chat template), chosen on SmolLM2-135M-Instruct with the full cache
(needle depths cycling 0.1..0.9):
- passkey: the key is stated as its own paragraph, "The pass key is 48213. Remember it. 48213 is
  the pass key.", and the question is a bare cue after the context, "\\n\\nThe pass key is".
  Asked "What is the pass key?", a 135M model tends to answer with a definition.
- multikey: five facts "The <relation> for the <word> is <5 digits>." (relations such as "locker
  number", "serial number", all different), each its own paragraph, one asked with the cue
  "\\n\\nThe <relation> for the <word> is". With one shared relation ("The special code for the
  <word> is ...") the model copies the code of a nearby later fact, with or without each fact repeated,
  a question before the cue, or a "<word>: <code>" format.
The haystack is real prose (`text.py`); T is exact: the first paragraph is cut at its front.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from ..errors import KVSumError
from . import text

DEPTHS = tuple(round(0.1 * i, 1) for i in range(1, 10))  # needle depths, cycled over the examples

WORDS = ("apple", "river", "candle", "tiger", "violin", "harbor", "pepper", "glacier", "lantern", "falcon",
         "meadow", "copper", "orchid", "saddle", "thunder", "walnut", "compass", "emerald", "pillow", "canyon",
         "dolphin", "feather", "garden", "hammer", "island", "jacket", "kettle", "ladder", "marble", "needle")

RELATIONS = ("special code", "locker number", "room number", "serial number", "ticket number", "account number",
             "order number", "license number")


@dataclass
class Example:
    context_ids: Tensor  # (1, T): compressed
    question_ids: Tensor  # (1, q): appended after compression (for lm: the teacher-forced continuation)
    answer: str | None = None
    depth: float | None = None
    needle_pos: int | None = None  # token index where the asked fact's paragraph starts in the context
    seed: int = 0


def example_seed(seed: int, i: int) -> int:
    return seed * 1_000_003 + i


class Task:
    """A family of examples. `kind` is "retrieval" (generate, then score text) or "lm" (teacher forcing)."""

    name: ClassVar[str] = ""
    kind: ClassVar[str] = "retrieval"
    max_new_tokens: ClassVar[int] = 8

    def example(self, tokenizer, length: int, seed: int, depth: float = 0.5) -> Example:
        raise NotImplementedError

    def score(self, example: Example, output: str) -> float:
        """1.0 if the generated `output` answers the example, else 0.0."""
        raise NotImplementedError

    @property
    def tokens_after(self) -> int:
        """Tokens read after the prompt: the answer generated (`max_new_tokens`)."""
        return self.max_new_tokens

    def examples(self, tokenizer, length: int, n: int, seed: int = 0):
        """`n` examples, the needle depth cycling over 0.1..0.9."""
        for i in range(n):
            yield self.example(tokenizer, length, example_seed(seed, i), DEPTHS[i % len(DEPTHS)])


def _with_needles(tokenizer, length: int, seed: int, needles: list[tuple[float, str]]) -> tuple[list[int], list[int]]:
    """Context ids of exactly `length` tokens: haystack paragraphs with each needle text its own paragraph,
    at the free paragraph boundary nearest its depth, placed in order (so list the asked one first).
    Returns (ids, start of each needle)."""
    sep = text.sep_ids(tokenizer)
    needle_ids = [text.encode(tokenizer, t) for _, t in needles]
    n_hay = length - sum(len(ids) + len(sep) for ids in needle_ids)
    if n_hay < 1:
        raise KVSumError(f"a context of {length} tokens is too short for the task's facts")
    hay = text.haystack(tokenizer, n_hay, seed)
    offsets, pos = [], 0
    for p in hay:
        offsets.append(pos)
        pos += len(p) + len(sep)
    offsets.append(pos)  # after the last paragraph
    if len(needles) > len(offsets):
        raise KVSumError(f"a context of {length} tokens is too short for {len(needles)} facts")
    taken: dict[int, int] = {}  # boundary -> needle index
    for k in range(len(needles)):  # in the caller's order: the asked fact first gets its boundary
        free = [j for j in range(len(offsets)) if j not in taken]
        taken[min(free, key=lambda j: abs(offsets[j] - needles[k][0] * n_hay))] = k
    return text.splice(hay, needle_ids, {j: [k] for j, k in taken.items()}, sep)


def _tensor(ids: list[int]) -> Tensor:
    return torch.tensor([ids], dtype=torch.long)


class Passkey(Task):
    """One random 5-digit pass key as its own paragraph; the question is the bare cue "The pass key is"."""

    name = "passkey"

    def example(self, tokenizer, length, seed, depth=0.5):
        key = str(random.Random(f"passkey-{seed}").randint(10000, 99999))
        needle = f"The pass key is {key}. Remember it. {key} is the pass key."
        ids, (start,) = _with_needles(tokenizer, length, seed, [(depth, needle)])
        question = text.encode(tokenizer, text.SEP + "The pass key is")
        return Example(_tensor(ids), _tensor(question), key, depth, start, seed)

    def score(self, example, output):
        return float(example.answer in output)


@dataclass
class MultiKey(Task):
    """`keys` facts "The <relation> for the <word> is <5 digits>." scattered; one asked at `depth`.

    Each fact has its own relation: with a single shared one the 135M model answers with a nearby
    fact's value (see the module docstring). `fact` and `cue` are format strings.
    """

    keys: int = 5
    fact: str = "The {relation} for the {word} is {value}."
    cue: str = "The {relation} for the {word} is"
    name: ClassVar[str] = "multikey"

    def example(self, tokenizer, length, seed, depth=0.5):
        rng = random.Random(f"multikey-{seed}")
        words = rng.sample(WORDS, self.keys)
        values = [str(v) for v in rng.sample(range(10000, 100000), self.keys)]
        depths = [depth] + [rng.uniform(0.05, 0.95) for _ in range(self.keys - 1)]  # fact 0 is asked
        relations = rng.sample(RELATIONS, self.keys)
        facts = [self.fact.format(word=w, value=v, relation=r) for w, v, r in zip(words, values, relations)]
        ids, starts = _with_needles(tokenizer, length, seed, list(zip(depths, facts)))
        question = text.encode(tokenizer, text.SEP + self.cue.format(word=words[0], relation=relations[0]))
        return Example(_tensor(ids), _tensor(question), values[0], depth, starts[0], seed)

    def score(self, example, output):
        first = re.search(r"\d+", output)
        return float(first is not None and first.group() == example.answer)


@dataclass
class LMFidelity(Task):
    """A prefix of real text is compressed; the next `continuation` tokens are teacher-forced."""

    continuation: int = 128
    name: ClassVar[str] = "lm"
    kind: ClassVar[str] = "lm"

    def example(self, tokenizer, length, seed, depth=0.5):
        ids = text.join(text.haystack(tokenizer, length + self.continuation, seed), text.sep_ids(tokenizer))
        return Example(_tensor(ids[:length]), _tensor(ids[length:]), seed=seed)

    @property
    def tokens_after(self) -> int:
        """The teacher-forced continuation."""
        return self.continuation

    def score(self, example, output):
        raise KVSumError("the lm task is scored from logits (kvsum.eval.metrics.fidelity), not from text")


TASKS: dict[str, type[Task]] = {t.name: t for t in (Passkey, MultiKey, LMFidelity)}


def get_task(task: str | Task, chat: bool = False) -> Task:
    """The task by name; `chat`: its prompts in the tokenizer's chat template (the long-context suite's tasks)."""
    if isinstance(task, Task):
        return task
    if task not in TASKS:
        raise KVSumError(f"unknown task {task!r}; accepted: {', '.join(TASKS)}")
    made = TASKS[task]()
    if chat and not hasattr(made, "chat"):
        raise KVSumError(f"chat prompts are for the long-context suite's tasks, not {task!r}")
    if chat:
        made.chat = True
    return made
