"""Common and frequent words extraction (RULER's CWE and FWE): the context is a word list, no haystack.

- cwe: a numbered list " 1. word 2. word ..." of English words from the Python documentation topics
  (`pydoc_data`, fixed per Python version): `common` words appear `common_freq` times each (fewer in short
  prompts, never under rare_freq + 2), the others `rare_freq` times, in a seeded order; the `common` words are
  expected.
- fwe: seeded random "coded words" drawn with Zipf frequencies (rank r has weight r^-alpha); the `top` most
  frequent words of the list as written are expected (the draw is repeated until they lead the rest by 2).

The whole prompt is exactly the asked length: items are added one by one until the list fills it, then the
first item loses its front tokens (it is a rare word, so no expected count changes). Seeds and the prompt
format follow `ruler.py` (RULER's templates, plain text or the chat template).
"""

from __future__ import annotations

import random
import re
from collections import Counter
from dataclasses import dataclass
from functools import lru_cache
from typing import ClassVar

import torch

from ..errors import KVSumError
from . import text
from .prompt import SuiteExample, chat_parts, question_ids, recall, trim_front
from .tasks import Task


@lru_cache(maxsize=1)
def vocabulary() -> tuple[str, ...]:
    """Distinct lowercase words (4-12 letters) of the Python documentation topics, sorted."""
    from pydoc_data.topics import topics

    words: set[str] = set()
    for body in topics.values():
        words.update(re.findall(r"\b[a-z]{4,12}\b", body))
    return tuple(sorted(words))


@dataclass
class _WordList(Task):
    """Shared: the prompt around a list of word units, exact length, recall scoring.

    Attributes:
        chat: wrap the prompt in the tokenizer's chat template.
    """

    chat: bool = False
    preamble: ClassVar[str] = ""

    def score(self, example, output):
        return recall(example.expected, output)

    def _frame(self, tokenizer, ask, prefix) -> tuple[list[int], list[int]]:
        pre = text.encode(tokenizer, chat_parts(tokenizer, self.chat)[0] + self.preamble + "\n")
        return pre, question_ids(tokenizer, ask, prefix, self.chat)

    def _too_short(self, length: int, need: int):
        return KVSumError(f"a length of {length} tokens is too short for {self.name}: its prompt and planted "
                          f"words take {need} tokens")

    def _example(self, pre, q, units, expected, seed) -> SuiteExample:
        ctx = pre + [t for u in units for t in u]
        return SuiteExample(torch.tensor([ctx]), torch.tensor([q]), ", ".join(expected), None, None, seed,
                            tuple(expected))


@dataclass
class CommonWords(_WordList):
    """CWE: `common` words `common_freq` times each among words `rare_freq` times each; the common ones asked.

    Attributes:
        common: words planted with the high frequency (all expected).
        common_freq: how often each common word appears (lowered for short prompts, see the module docstring).
        rare_freq: how often each other word appears.
    """

    common: int = 10
    common_freq: int = 30
    rare_freq: int = 3
    name: ClassVar[str] = "cwe"
    max_new_tokens: ClassVar[int] = 120
    preamble: ClassVar[str] = ("Below is a numbered list of words. In these words, some appear more often than "
                               "others. Memorize the ones that appear most often.")

    def example(self, tokenizer, length, seed, depth=0.5):
        rng = random.Random(f"cwe-{seed}")
        vocab = list(vocabulary())
        rng.shuffle(vocab)
        common, pool = vocab[: self.common], vocab[self.common:]
        pre, q = self._frame(tokenizer, f"What are the {self.common} most common words in the above list?",
                             f"The top {self.common} words that appear most often in the list are:")
        budget = length - len(pre) - len(q)
        word = {w: text.encode(tokenizer, " " + w) for w in common}
        nums: list[list[int]] = []

        def num(i: int) -> list[int]:  # tokens of the i-th item's number, " <i+1>."
            while len(nums) <= i:
                nums.append(text.encode(tokenizer, f" {len(nums) + 1}."))
            return nums[i]

        avg = len(num(0)) + len(text.encode(tokenizer, f" {budget // 6}.")) // 2 + 2
        freq = min(self.common_freq, max(self.rare_freq + 2, budget // avg // (2 * self.common)))
        items = [w for w in common for _ in range(freq)]
        total = sum(len(num(i)) + len(word[w]) for i, w in enumerate(items))
        if total > budget:
            raise self._too_short(length, total + len(pre) + len(q))
        k = 0
        while total < budget:
            w = pool[k // self.rare_freq] if k // self.rare_freq < len(pool) else None
            if w is None:
                raise KVSumError(f"cwe cannot reach {length} tokens: its {len(vocabulary())} words give at most "
                                 f"{total + len(pre) + len(q)}")
            word.setdefault(w, text.encode(tokenizer, " " + w))
            total += len(num(len(items))) + len(word[w])
            items.append(w)
            k += 1
        rng.shuffle(items)
        excess = total - budget
        rare = [w for w in items if w not in common]
        front, held = [], 0
        while held <= excess:  # the items cut away (and the one cut) are rare: no expected count changes
            front.append(rare.pop())
            held += len(num(len(front) - 1)) + len(word[front[-1]])
        for w in front:
            items.remove(w)
        items = front + items
        units = [num(i) + word[w] for i, w in enumerate(items)]
        trim_front(units, excess)
        return self._example(pre, q, units, common, seed)


@dataclass
class FrequentWords(_WordList):
    """FWE: coded words drawn with Zipf(alpha) frequencies from `vocab` random words; the `top` most frequent asked.

    Attributes:
        top: most frequent words expected.
        alpha: the Zipf exponent of the word frequencies.
        vocab: distinct coded words to draw from.
    """

    top: int = 3
    alpha: float = 2.0
    vocab: int = 1000
    name: ClassVar[str] = "fwe"
    max_new_tokens: ClassVar[int] = 50
    preamble: ClassVar[str] = ("Read the following coded text and track the frequency of each coded word. "
                               "Find the three most frequently appeared coded words.")

    def example(self, tokenizer, length, seed, depth=0.5):
        rng = random.Random(f"fwe-{seed}")
        coded = list(dict.fromkeys("".join(rng.choices("abcdefghijklmnopqrstuvwxyz", k=rng.randint(3, 6)))
                                   for _ in range(2 * self.vocab)))[: self.vocab]
        weights = [(r + 1) ** -self.alpha for r in range(len(coded))]
        pre, q = self._frame(tokenizer, f"What are the {self.top} most frequently appeared words in the above "
                             "coded text?", f"According to the coded text above, the {self.top} most frequently "
                             "appeared words are:")
        budget = length - len(pre) - len(q)
        if budget < 8 * self.top:
            raise self._too_short(length, len(pre) + len(q) + 8 * self.top)
        ids = {w: text.encode(tokenizer, " " + w) for w in coded}
        for _ in range(20):
            units, total = [], 0
            while total < budget:
                units.append(ids[rng.choices(coded, weights)[0]])
                total += len(units[-1])
            cut = trim_front(units, total - budget)
            counts = Counter(tuple(u) for u in units[int(cut):]).most_common(self.top + 1)
            if len(counts) > self.top and counts[self.top - 1][1] >= counts[self.top][1] + 2:
                by_ids = {tuple(v): w for w, v in ids.items()}
                return self._example(pre, q, units, [by_ids[c] for c, _ in counts[: self.top]], seed)
        raise self._too_short(length, length + 1)
