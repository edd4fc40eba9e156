"""Assembly of the long-context suite's prompts: exact token length, needles placed by depth, RULER scoring.

A prompt is [chat prefix] preamble, haystack with needles, then the question (appended after compression):
"\\n\\n<ask>\\nAnswer: <answer prefix>" in plain text, or "\\n\\n<ask>" closed by the chat template's end of the
user turn, the assistant turn opening with the answer prefix. Context + question is exactly the asked length.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import KVSumError
from . import code, text
from .tasks import Example


@dataclass
class SuiteExample(Example):
    """An Example that carries every value the answer must contain (scored by recall)."""

    expected: tuple[str, ...] = ()


def recall(expected: tuple[str, ...], output: str) -> float:
    """RULER's string-match score: the fraction of `expected` values found in `output`, case-insensitive."""
    if not expected:
        raise KVSumError("an example without expected values cannot be scored")
    low = output.lower()
    return sum(v.lower() in low for v in expected) / len(expected)


def chat_parts(tokenizer, chat: bool) -> tuple[str, str]:
    """(text before the context, text between the ask and the answer prefix): the tokenizer's chat template
    around one user turn when `chat`, else plain text."""
    if not chat:
        return "", "\nAnswer: "
    if not getattr(tokenizer, "chat_template", None):
        raise KVSumError("chat=True needs a tokenizer with a chat template")
    mark = "\x00KVSUM\x00"
    whole = tokenizer.apply_chat_template([{"role": "user", "content": mark}], tokenize=False,
                                          add_generation_prompt=True)
    before, _, after = whole.partition(mark)
    return before, after


def question_ids(tokenizer, ask: str, prefix: str, chat: bool) -> list[int]:
    return text.encode(tokenizer, text.SEP + ask + chat_parts(tokenizer, chat)[1] + prefix)


def trim_front(units: list[list[int]], excess: int) -> bool:
    """Drop `excess` tokens from the front of `units` (whole units first, then the front of the first one, in
    place); True if the first unit left was cut."""
    while units and excess >= len(units[0]):
        excess -= len(units.pop(0))
    if excess and units:
        units[0] = units[0][excess:]
    return excess > 0


def place(units: list[list[int]], sep: list[int], allowed: list[bool], needles: list[tuple[float, list[int]]],
          ordered: bool = False) -> tuple[list[int], list[int]]:
    """Join haystack `units` with `sep`, each needle its own unit at the allowed boundary nearest its depth (a
    fraction of the haystack), placed in list order (the asked needle first gets its boundary; several share one
    only when every allowed boundary holds one). `allowed[j]`: a needle may go before unit j (one more entry:
    after the last). With `ordered`, needles keep list order.
    Returns (ids, start of each needle)."""
    offsets, pos = [], 0
    for u in units:
        offsets.append(pos)
        pos += len(u) + len(sep)
    offsets.append(pos)
    allowed_at = [j for j, ok in enumerate(allowed) if ok]
    if not allowed_at:
        raise KVSumError(f"a haystack of {pos} tokens has no place for needles: ask a longer length")
    taken: dict[int, list[int]] = {}  # boundary -> needles there (several only once every boundary has one)
    for k, (depth, _) in enumerate(needles):
        free = [j for j in allowed_at if j not in taken] or allowed_at
        taken.setdefault(min(free, key=lambda j: abs(offsets[j] - depth * pos)), []).append(k)
    if ordered:
        flat = sorted(j for j, ks in taken.items() for _ in ks)
        taken = {}
        for j, k in zip(flat, range(len(needles))):
            taken.setdefault(j, []).append(k)
    return text.splice(units, [ids for _, ids in needles], taken, sep)


def build(tokenizer, length: int, seed: int, haystack: str, preamble: str, needles: list[tuple[float, str]],
          ask: str, prefix: str, chat: bool, ordered: bool = False) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """(context ids (1, T), question ids (1, q), start of each needle in the context), T + q == `length`.

    `haystack` is "prose" (pydoc paragraphs, each needle its own paragraph) or "code" (stdlib sources, needles
    between top-level statements)."""
    before = chat_parts(tokenizer, chat)[0]
    q = question_ids(tokenizer, ask, prefix, chat)
    if haystack == "prose":
        sep = text.sep_ids(tokenizer)
        pre = text.encode(tokenizer, before + preamble) + sep
        ids = [(d, text.encode(tokenizer, t)) for d, t in needles]
        n_hay = length - len(q) - len(pre) - sum(len(i) + len(sep) for _, i in ids)
    elif haystack == "code":
        sep = []
        pre = text.encode(tokenizer, before + preamble + "\n")
        ids = [(d, text.encode(tokenizer, t)) for d, t in needles]
        n_hay = length - len(q) - len(pre) - sum(len(i) for _, i in ids)
    else:
        raise KVSumError(f"unknown haystack {haystack!r}; accepted: prose, code")
    if n_hay < 1:
        raise KVSumError(f"a length of {length} tokens is too short: the task's prompt and needles alone take "
                         f"{length - n_hay} tokens; ask at least {length - n_hay + 64}")
    if haystack == "prose":
        units = text.haystack(tokenizer, n_hay, seed)
        allowed = [True] * (len(units) + 1)
    else:
        units, allowed = code.haystack(tokenizer, n_hay, seed)
        allowed = allowed + [True]
    body, starts = place(units, sep, allowed, ids, ordered)
    ctx = pre + body
    assert len(ctx) + len(q) == length, (len(ctx), len(q), length)
    return torch.tensor([ctx]), torch.tensor([q]), [len(pre) + s for s in starts]
