"""`kvsum demo`: a long real document with a few facts in it, compressed, then asked about them.

The document is compressed before any question is seen (the query-agnostic setting a server meets);
every question is then answered once from the full cache and once from the compressed one.
"""

from __future__ import annotations

import random
import time

import torch

from .compress import compress_prefill, prefill
from .eval.tasks import _tensor, _with_needles
from .eval.text import SEP, encode
from .methods import make_method

# The flagship at budget 0.25 (benchmarks/results/summary_cover_quarter.md): exact anchors by surprisal (at 0.25
# little more than the sinks and the recent window), every other token as 3.5-bit TurboQuant codes, keys centered.
DEFAULT_METHOD, DEFAULT_KNOBS = "summary", {"cover_bits": 3.5, "cover_center": True, "score": "surprisal"}


def _document(tok, tokens: int, seed: int = 7):
    rng = random.Random(seed)
    key, code_a, code_b = (str(rng.randint(10000, 99999)) for _ in range(3))
    facts = [(0.3, f"The pass key is {key}. Remember it. {key} is the pass key."),
             (0.6, f"The locker number for the lantern is {code_a}."),
             (0.85, f"The serial number for the falcon is {code_b}.")]
    ids, _ = _with_needles(tok, tokens, seed, facts)
    cues = [("The pass key is", key), ("The locker number for the lantern is", code_a),
            ("The serial number for the falcon is", code_b)]
    return _tensor(ids), cues


def _answer(model, tok, pre, method, budget, ctx, cue):
    q = _tensor(encode(tok, SEP + cue))
    cache = compress_prefill(pre, method, budget)
    held = cache.nbytes()
    t = time.perf_counter()
    out = model.generate(torch.cat([ctx, q], -1), cache=cache, max_new_tokens=8, do_sample=False)
    seconds = time.perf_counter() - t  # the answer alone: compression is timed once, above
    return tok.decode(out[0, ctx.shape[1] + q.shape[1]:], skip_special_tokens=True).strip(), held, seconds


def run_demo(model, tok, method: str | None = None, budget: float = 0.25, tokens: int = 2000, console=None) -> dict:
    knobs = DEFAULT_KNOBS if method is None else {}
    method = method or DEFAULT_METHOD
    m, full = make_method(method, **knobs), make_method("full")
    ctx, cues = _document(tok, tokens)
    t = time.perf_counter()
    pre = prefill(model, ctx, tokenizer=tok, **m.prefill_options())
    prefill_s = time.perf_counter() - t
    t = time.perf_counter()
    compress_prefill(pre, m, budget)
    compress_s = time.perf_counter() - t
    answers, times = [], {"full": 0.0, "compressed": 0.0}
    for cue, expected in cues:
        row = {"cue": cue, "expected": expected}
        for label, mm, b in (("full", full, 1.0), ("compressed", m, budget)):
            row[label], held, seconds = _answer(model, tok, pre, mm, b, ctx, cue)
            times[label] += seconds
            row[label + "_bytes"] = held
        answers.append(row)
    label = method + (f"({', '.join(f'{k}={v}' for k, v in knobs.items())})" if knobs else "")
    return dict(method=label, tokens=ctx.shape[1], full16_bytes=pre.cache.reference_nbytes,
                full_bytes=answers[0]["full_bytes"], bytes=answers[0]["compressed_bytes"], prefill_s=prefill_s,
                compress_s=compress_s, answers=answers, full_answer_s=times["full"], answer_s=times["compressed"])
