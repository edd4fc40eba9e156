"""`kvsum demo`: a long real document with a few facts in it, compressed, then asked about them.

The document is compressed before any question is seen (the query-agnostic setting a server meets): once
into the full cache and once under the method. `generate()` grows the cache it is given, so every question
is answered from a fork of the compressed cache (`cache.fork()`: the same answer as a fresh compression).
"""

from __future__ import annotations

import random
import re
import time

import torch

from .compress import compress_prefill
from .eval.tasks import _tensor, _with_needles
from .eval.text import SEP, encode
from .extras import progress as progress_bar
from .methods import make_method
from .prefill import prefill
from .spec import Spec, format_spec, parse_spec

# The flagship: `summary` with no knobs, configured by budget (kvsum/methods/summary/default.py).
DEFAULT_METHOD = "summary"


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


def right(answer: str, expected: str) -> bool:
    """The answer's first number is the expected one."""
    first = re.search(r"\d+", answer)
    return first is not None and first.group() == expected


def one_line(text: str) -> str:
    """`text` on one line: surrounding blanks cut, inner newlines written as \\n."""
    return text.strip().replace("\r", "").replace("\n", "\\n")


def _answer(model, tok, cache, ctx, cue) -> tuple[str, float]:
    q = _tensor(encode(tok, SEP + cue))
    t = time.perf_counter()
    out = model.generate(torch.cat([ctx, q], -1), cache=cache, max_new_tokens=8, do_sample=False)
    seconds = time.perf_counter() - t  # the answer alone: compression is timed once, before
    return tok.decode(out[0, ctx.shape[1] + q.shape[1]:], skip_special_tokens=True).strip(), seconds


def run_demo(model, tok, method: str | Spec | None = None, budget: float = 0.25, tokens: int = 2000,
             progress: bool = True) -> dict:
    """Prefill the document, compress it once per cache (full, and `method` at `budget`), answer each question
    from a copy of each. `method`: a spec string ("summary:score=surprisal") or Spec; None: the flagship."""
    spec = Spec(DEFAULT_METHOD, {}) if method is None else (
        method if isinstance(method, Spec) else parse_spec(method))
    m, full = make_method(spec), make_method("full")
    ctx, cues = _document(tok, tokens)
    with progress_bar("prefill", 3 + 2 * len(cues), enabled=progress, transient=True) as bar:
        t = time.perf_counter()
        pre = prefill(model, ctx, tokenizer=tok, **m.prefill_options())
        prefill_s = time.perf_counter() - t
        bar.advance(f"compressing with {spec.name}")
        t = time.perf_counter()
        caches = {"compressed": compress_prefill(pre, m, budget)}
        compress_s = time.perf_counter() - t
        bar.advance("building the full cache")
        caches["full"] = compress_prefill(pre, full, 1.0)
        held = {label: c.nbytes() for label, c in caches.items()}
        bar.advance()
        answers, times = [], {"full": 0.0, "compressed": 0.0}
        for i, (cue, expected) in enumerate(cues):
            row = {"cue": cue, "expected": expected}
            for label in ("full", "compressed"):
                bar.update(f"question {i + 1}/{len(cues)} from the {label} cache")
                row[label], seconds = _answer(model, tok, caches[label].fork(), ctx, cue)
                row[label + "_right"] = right(row[label], expected)
                times[label] += seconds
                bar.advance()
            answers.append(row)
    made = getattr(caches["compressed"], "decision", None)  # summary configured by budget: what it became
    chosen = made and made.spec
    return dict(method=format_spec(spec), chosen=chosen, tokens=ctx.shape[1], full16_bytes=pre.cache.reference_nbytes,
                full_bytes=held["full"], bytes=held["compressed"], prefill_s=prefill_s, compress_s=compress_s,
                answers=answers, full_answer_s=times["full"], answer_s=times["compressed"])
