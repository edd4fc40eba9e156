"""An offline long-context suite after RULER (Hsieh et al., 2024), query-agnostic: the context is compressed
before the question is seen. Each task has a prose haystack (`name`, the pydoc text of `text.py`) and a code
haystack (`name_code`, stdlib sources of `code.py`, needles that are code facts):

- niah_single: one needle. Prose: "One of the special magic <kind>s for <key> is: <value>.", the value a
  7-digit number, a word or a uuid (by seed). Code: a module constant (number, word or uuid), the function an
  inserted function calls, or the class that defines an inserted method (by seed).
- niah_multikey: the asked needle among `distractors` needles of the same kind with other keys.
- niah_multivalue: `values` needles of one key (code: one constant assigned in several places); all asked.
- niah_multiquery: `queries` needles of different keys, all asked at once.
- vt: a chain of `hops` assignments `VAR X = <value>`, `VAR Y = VAR X`, ... (code: `X = <value>`, `Y = X`)
  beside `chains - 1` distractor chains; every variable of the asked chain is expected.
- cwe, fwe (`words.py`): common and frequent words extraction; the word list is the context, as in RULER.

Lengths: the whole prompt, context + question, is exactly the asked number of tokens (so a prompt of the model's
window still leaves room only for the answer); passkey and multikey count the context alone.
Scoring: recall of the expected values in the greedy answer (`prompt.recall`), `max_new_tokens` per task.

Seeds: `examples(seed=s)` with s >= 1000 is the dev split, s in 0..999 the test split (`kvsum eval --seed`,
default 0: test). The haystack text is shared; the split is over needles, keys, values, depths and paragraph
or file order. The prompt format is RULER's own template (a preamble naming what kind of fact will be asked,
never the key; the question and an answer prefix after the context), kept after checking it on dev seeds
with SmolLM2-135M-Instruct's full cache at 2k tokens; never tuned on test seeds.
"""

from __future__ import annotations

import random
import uuid
from dataclasses import dataclass
from functools import partial
from typing import ClassVar

from . import code
from .prompt import SuiteExample, build, recall
from .tasks import TASKS, WORDS, Task
from .words import CommonWords, FrequentWords

PROSE_KINDS = ("number", "word", "uuid")
CODE_KINDS = ("number", "word", "uuid", "call", "method")
VALUE_WORDS = ("sunflower", "avalanche", "porcelain", "blueberry", "telescope", "hurricane", "labyrinth", "mosaic",
               "nebula", "quartz", "saffron", "tornado", "velvet", "whistle", "zeppelin", "biscuit", "cathedral",
               "driftwood", "firefly", "gondola", "horizon", "igloo", "jasmine", "kaleidoscope", "lighthouse")


def _value(rng: random.Random, kind: str) -> str:
    if kind == "number":
        return str(rng.randint(1_000_000, 9_999_999))
    if kind == "word":
        return rng.choice(VALUE_WORDS)
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def _and(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


@dataclass
class Ruler(Task):
    """Shared by the suite's tasks: the haystack ("prose" or "code"), the chat template, recall scoring.

    Attributes:
        haystack: "prose" (pydoc paragraphs) or "code" (stdlib sources).
        chat: wrap the prompt in the tokenizer's chat template (one user turn; the answer prefix opens the reply).
    """

    haystack: str = "prose"
    chat: bool = False
    base: ClassVar[str] = ""

    @property
    def name(self) -> str:
        return self.base + ("_code" if self.haystack == "code" else "")

    def score(self, example, output):
        return recall(example.expected, output)

    def _example(self, tokenizer, length, seed, depth, preamble, needles, ask, prefix, expected, ordered=False,
                 asked=0):
        ctx, q, starts = build(tokenizer, length, seed, self.haystack, preamble, needles, ask, prefix, self.chat,
                               ordered)
        return SuiteExample(ctx, q, ", ".join(expected), depth, starts[asked], seed, tuple(expected))


@dataclass
class Niah(Ruler):
    """Needle-in-a-haystack: `keys` keys, `values` values each; `asked` of the keys are asked (all of their
    values expected); the first asked needle sits at `depth`, the others at random depths.

    Attributes:
        keys: distinct keys planted (the ones not asked are distractors).
        values: needles per key (all of them expected).
        asked: keys asked at once.
        kinds: value kinds cycled by seed; empty: the haystack's default (numbers only where several values).
    """

    keys: int = 1
    values: int = 1
    asked: int = 1
    kinds: tuple[str, ...] = ()
    max_new_tokens: ClassVar[int] = 48  # a uuid takes ~30 tokens on Qwen's tokenizer: 32 cut one off at 32k

    def _kind(self, seed: int) -> str:
        kinds = self.kinds or (("number",) if self.values > 1 or self.asked > 1
                               else CODE_KINDS if self.haystack == "code" else PROSE_KINDS)
        return kinds[seed % len(kinds)]

    def example(self, tokenizer, length, seed, depth=0.5):
        rng = random.Random(f"{self.base}-{seed}")
        kind = self._kind(seed)
        words = rng.sample(WORDS, self.keys)
        n = self.keys * self.values
        depths = [depth] + [rng.uniform(0.05, 0.95) for _ in range(n - 1)]
        if self.haystack == "code":
            return self._code(tokenizer, length, seed, depth, rng, kind, words, depths)
        keys = [f"{rng.choice(code.ADJECTIVES)}-{w}" for w in words]
        values = [[_value(rng, kind) for _ in range(self.values)] for _ in keys]
        thing = f"special magic {kind}"
        needles = [f"One of the {thing}s for {k} is: {v}." for k, vs in zip(keys, values) for v in vs]
        asked = keys[: self.asked]
        expected = [v for vs in values[: self.asked] for v in vs]
        preamble = (f"Some {thing}s are hidden within the following text. Make sure to memorize it. "
                    f"I will quiz you about the {thing}s afterwards.")
        if len(expected) == 1:
            ask = f"What is the {thing} for {asked[0]} mentioned in the provided text?"
            prefix = f"The {thing} for {asked[0]} mentioned in the provided text is"
        else:
            ask = f"What are all the {thing}s for {_and(asked)} mentioned in the provided text?"
            prefix = f"The {thing}s for {_and(asked)} mentioned in the provided text are"
        return self._example(tokenizer, length, seed, depth, preamble, list(zip(depths, needles)), ask, prefix,
                             expected)

    def _code(self, tokenizer, length, seed, depth, rng, kind, words, depths):
        preamble = ("Below is Python source code from several files of a codebase. Memorize the constants, "
                    "functions and classes it defines; I will quiz you about them afterwards.")
        if kind in ("call", "method"):
            funcs = code.names(rng, words, "function")
            others = code.names(rng, rng.sample([w for w in WORDS if w not in words], self.keys), "function")
            if kind == "call":
                needles = [code.call(f, g) for f, g in zip(funcs, others)]
                ask = f"Which function does the function {funcs[0]} call in the code above?"
                prefix = f"The function {funcs[0]} calls"
            else:
                others = code.names(rng, words, "class")
                needles = [code.method(c, m) for c, m in zip(others, funcs)]
                ask = f"Which class defines the method {funcs[0]} in the code above?"
                prefix = f"The method {funcs[0]} is defined in the class"
            return self._example(tokenizer, length, seed, depth, preamble, list(zip(depths, needles)), ask, prefix,
                                 [others[0]])
        consts = code.names(rng, words, "constant")
        values = [[_value(rng, kind) for _ in range(self.values)] for _ in consts]
        needles = [code.constant(c, v, kind != "number") for c, vs in zip(consts, values) for v in vs]
        asked = consts[: self.asked]
        expected = [v for vs in values[: self.asked] for v in vs]
        if self.values > 1:
            ask = f"What are all the values assigned to the constant {asked[0]} in the code above?"
            prefix = f"The values assigned to {asked[0]} are"
        elif self.asked > 1:
            ask = f"What are the values of the constants {_and(asked)} defined in the code above?"
            prefix = f"The values of {_and(asked)} are"
        else:
            ask = f"What is the value of the constant {asked[0]} defined in the code above?"
            prefix = f"{asked[0]} ="
        return self._example(tokenizer, length, seed, depth, preamble, list(zip(depths, needles)), ask, prefix,
                             expected)


@dataclass
class NiahSingle(Niah):
    base: ClassVar[str] = "niah_single"


@dataclass
class NiahMultiKey(Niah):
    keys: int = 4
    base: ClassVar[str] = "niah_multikey"


@dataclass
class NiahMultiValue(Niah):
    values: int = 4
    base: ClassVar[str] = "niah_multivalue"
    max_new_tokens: ClassVar[int] = 64


@dataclass
class NiahMultiQuery(Niah):
    keys: int = 4
    asked: int = 4
    base: ClassVar[str] = "niah_multiquery"
    max_new_tokens: ClassVar[int] = 64


@dataclass
class VariableTracking(Ruler):
    """Chains of `hops` assignments from a 5-digit value; the first chain is asked: all its variables expected.

    Attributes:
        hops: assignments after the first in each chain (hops + 1 variables hold the value).
        chains: chains planted (the others are distractors with other values).
    """

    hops: int = 4
    chains: int = 2
    base: ClassVar[str] = "vt"
    max_new_tokens: ClassVar[int] = 48

    def example(self, tokenizer, length, seed, depth=0.5):
        rng = random.Random(f"{self.base}-{seed}")
        letters = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
        n = self.chains * (1 + self.hops)
        names = list(dict.fromkeys("".join(rng.choices(letters, k=5)) for _ in range(4 * n)))
        values = [str(v) for v in rng.sample(range(10000, 100000), self.chains)]
        fmt = ("{} = {}\n", "{} = {}\n") if self.haystack == "code" else ("VAR {} = {}.", "VAR {} = VAR {}.")
        needles = []
        for c, value in enumerate(values):
            chain = names[c * (self.hops + 1): (c + 1) * (self.hops + 1)]
            depths = sorted(rng.uniform(0.05, 0.95) for _ in chain)
            needles.append((depths[0], fmt[0].format(chain[0], value), c))
            needles += [(d, fmt[1].format(b, a), c) for d, a, b in zip(depths[1:], chain, chain[1:])]
            if c == 0:
                expected = chain
        needles.sort(key=lambda t: t[0])
        if self.haystack == "code":
            preamble = ("Below is Python source code from several files of a codebase. Memorize and track the "
                        "chains of variable assignments in it; I will quiz you about them afterwards.")
            ask = f"Which variables hold the value {values[0]} in the code above?"
            prefix = (f"According to the chain of assignments in the code above, {len(expected)} variables hold "
                      f"the value {values[0]}, they are:")
        else:
            preamble = "Memorize and track the chain(s) of variable assignment hidden in the following text."
            ask = f"Find all variables that are assigned the value {values[0]} in the text above."
            prefix = (f"According to the chain(s) of variable assignment in the text above, {len(expected)} "
                      f"variables are assigned the value {values[0]}, they are:")
        first = next(k for k, (_, _, c) in enumerate(needles) if c == 0)
        return self._example(tokenizer, length, seed, needles[first][0], preamble, [(d, t) for d, t, _ in needles],
                             ask, prefix, expected, ordered=True, asked=first)


SUITE: tuple[type[Ruler], ...] = (NiahSingle, NiahMultiKey, NiahMultiValue, NiahMultiQuery, VariableTracking)
# registered as "<base>" (prose) and "<base>_code"; cwe and fwe have no haystack


for _cls in SUITE:
    TASKS[_cls.base] = _cls
    TASKS[_cls.base + "_code"] = partial(_cls, haystack="code")
TASKS.update({CommonWords.name: CommonWords, FrequentWords.name: FrequentWords})
