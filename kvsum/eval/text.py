"""Real English prose for haystacks: the Python documentation topics every Python install ships.

`pydoc_data.topics.topics` holds the language reference as plain text. We keep its prose paragraphs
(no headings, grammar rules, code or tables), reflowed to one line each, the long ones split at
sentence ends (haystacks longer than the text reuse its paragraphs in a new order). The text is fixed
for a given Python version, so a haystack is a pure function of (Python version, tokenizer, length, seed).
"""

from __future__ import annotations

import random
import re
from functools import lru_cache

SEP = "\n\n"  # between paragraphs; also what precedes the question cue

_HEADING = re.compile(r"^[*=\-~^\"#+]{3,}\s*$")


def _is_prose(block: str) -> bool:
    lines = block.splitlines()
    if not lines or lines[0][:1].isspace():  # indented: code, grammar, tables, quoted examples
        return False
    if any(_HEADING.match(line) for line in lines) or "::=" in block or ">>>" in block:
        return False
    text = " ".join(line.strip() for line in lines)
    return len(text.split()) >= 12 and text.endswith(".") and not text.startswith(("See also", "Note:", "["))


def _split(para: str, max_words: int = 80) -> list[str]:
    """Long paragraphs cut at sentence ends into pieces of at most ~`max_words`: finer needle depths."""
    out, cur = [], []
    for sentence in re.split(r"(?<=[.!?])\s+(?=[A-Z\"*(])", para):
        if cur and len(" ".join(cur + [sentence]).split()) > max_words:
            out.append(" ".join(cur))
            cur = []
        cur.append(sentence)
    out.append(" ".join(cur))
    return [p for p in out if p.endswith(".")]


@lru_cache(maxsize=1)
def paragraphs() -> tuple[str, ...]:
    """Every prose paragraph of the documentation topics, in a fixed order, one line each."""
    from pydoc_data.topics import topics

    out = []
    for key in sorted(topics):
        for block in re.split(r"\n\s*\n", topics[key]):
            if _is_prose(block):
                out += _split(" ".join(block.split()).removeprefix("* "))
    return tuple(dict.fromkeys(out))  # some topics repeat paragraphs of others; keep the first


def shuffled(seed: int):
    """Paragraphs in an order fixed by `seed`, reshuffled (new order) each time all have been used."""
    rng = random.Random(seed)
    paras = list(paragraphs())
    while True:
        rng.shuffle(paras)
        yield from paras


def haystack(tokenizer, n_tokens: int, seed: int, sep: str = SEP) -> list[list[int]]:
    """Token ids of paragraphs that, joined with `sep`'s tokens, are exactly `n_tokens` long.

    The first paragraph is cut at its front (the text reads as an excerpt that starts mid-way),
    so every other paragraph is whole and the length is exact.
    """
    if n_tokens <= 0:
        return []
    sep_len = len(sep_ids(tokenizer, sep))
    source = shuffled(seed)
    paras: list[list[int]] = []
    excess = -n_tokens - sep_len
    while excess < 0:
        paras.append(encode(tokenizer, next(source)))
        excess += sep_len + len(paras[-1])
    while True:
        while excess >= len(paras[0]) + sep_len:  # a whole paragraph (and its separator) too many
            excess -= len(paras.pop(0)) + sep_len
        if excess < len(paras[0]):
            break
        paras.append(encode(tokenizer, next(source)))  # the cut would fall in a separator: take one more
        excess += sep_len + len(paras[-1])
    paras[0] = paras[0][excess:]
    return paras


def join(parts: list[list[int]], sep_ids: list[int]) -> list[int]:
    out: list[int] = []
    for i, p in enumerate(parts):
        if i:
            out += sep_ids
        out += p
    return out


def splice(units: list[list[int]], needles: list[list[int]], taken: dict[int, list[int]],
           sep: list[int]) -> tuple[list[int], list[int]]:
    """`units` joined by `sep`, needle k inserted before unit j for each k in taken[j] (j = len(units): after the
    last): (the token ids, the offset where each needle starts)."""
    parts, which = [], []
    for j in range(len(units) + 1):
        for k in taken.get(j, ()):
            parts.append(needles[k])
            which.append(k)
        if j < len(units):
            parts.append(units[j])
            which.append(None)
    starts, pos = [0] * len(needles), 0
    for p, k in zip(parts, which):
        if k is not None:
            starts[k] = pos
        pos += len(p) + len(sep)
    return join(parts, sep), starts


def sep_ids(tokenizer, sep: str = SEP) -> list[int]:
    """Tokens of `sep` as they appear between two paragraphs (BPE may merge it differently alone)."""
    word = encode(tokenizer, "Word")
    both = encode(tokenizer, "Word" + sep + "Word")
    if both[: len(word)] == word and both[-len(word):] == word:
        return both[len(word): -len(word)]
    return encode(tokenizer, sep)


def encode(tokenizer, text: str) -> list[int]:
    """Token ids of `text` alone: no special tokens, so pieces can be concatenated."""
    return list(tokenizer(text, add_special_tokens=False).input_ids)


def prose_ids(tokenizer, n: int, seed: int = 11):
    """(1, n) token ids (a torch tensor) of real prose: a haystack of `n` tokens, e.g. for timing runs."""
    import torch  # here, so that reading the text needs no torch

    return torch.tensor([join(haystack(tokenizer, n, seed), sep_ids(tokenizer))])
