"""`kvsum.Policy`: full cache where compression does not pay, compressed where memory binds or where it pays.

The thresholds come from a break-even table measured on the machine (`kvsum bench breakeven`, see
kvsum/breakeven.py; one measured here ships with kvsum as kvsum/data/breakeven.json), never from constants
picked by hand. Per method the table holds, per context length, the total time of one request (prefill,
compression, `new_tokens` decode steps) over the full cache's:
  - `compress_from`: the break-even length, from which the middle or the long method takes less total time
    than the full cache (None: never within the lengths measured);
  - `long_from`: where the long method (summarization) takes over from the middle one (low-bit
    quantization, more faithful per byte; its cost grows with the context where no kernel reads its codes
    in place, e.g. off AVX2): for latency="fast" where the long method's total time
    falls below the middle one's; for "balanced" where the middle one's exceeds the full cache's by more
    than LATENCY["balanced"] (50%); for "memory" never (quantization as long as low-bit codes reach the budget).
Rules, for a context of T tokens and a memory budget `memory` (a fraction of the full 16-bit cache, or
bytes; None: memory does not bind):
  1. memory does not bind: the full cache below `compress_from` (latency="memory": compress anyway);
     from it the middle method below `long_from` and the long method from it, at the table's budget;
  2. memory binds: compress to it; the middle method below `long_from` unless the budget is under what
     low-bit codes reach (`mid_min_budget`), the long method otherwise.
The long method `summary` (the default, with no knobs of the user's) is configured by budget when it compresses
(kvsum/methods/summary/default.py); `cache.decision` says what it became.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import DynamicCache

from .breakeven import crossing, load
from .compress import Decision, compress
from .errors import KVSumError
from .prefill import check_ids
from .shape import ModelShape

# extra total time over the full cache the middle (quantized) range may take before the long range takes over
LATENCY = {"fast": 0.0, "balanced": 0.5, "memory": None}


def _gap(long: float | None, mid: float | None) -> float:
    """long - mid total-time ratios; a method that refused a length (None) loses there."""
    if long is None:
        return math.inf
    return -math.inf if mid is None else long - mid


def _fmt(tokens: int | None) -> str:
    return "never" if tokens is None else str(tokens)


@dataclass
class Policy:
    """Rules from a request to (method, knobs, budget); see the module docstring.

    `memory`: fraction in (0, 1] of the full 16-bit cache, or bytes (an int > 1); `latency`: "fast",
    "balanced" or "memory"; `mid` and `long`: the methods of the middle and long ranges (e.g.
    long="summary+turboquant" for fewer bytes per summary entry); `knobs`: per-method knobs;
    `table`: a break-even table or the path of one (None: the table shipped with kvsum).
    """

    memory: float | int | None = None
    latency: str = "balanced"
    mid: str = "turboquant"
    long: str = "summary"
    budget: float | None = None  # budget when only time drives compression (None: the table's)
    mid_min_budget: float = 0.15  # under ~2 bits per coordinate (incl. norms), quantization is left to `long`
    knobs: dict = field(default_factory=dict)
    table: dict | str | Path | None = None

    def __post_init__(self):
        if self.latency not in LATENCY:
            raise KVSumError(f"latency={self.latency!r}; accepted: {', '.join(LATENCY)}")
        self._check_memory(self.memory)
        self.table = self.table if isinstance(self.table, dict) else load(self.table)
        if self.budget is None:
            self.budget = float(self.table.get("budget", 0.25))

    @staticmethod
    def _check_memory(memory) -> None:
        ok = memory is None or (isinstance(memory, (int, float)) and not isinstance(memory, bool) and memory > 0
                                and (memory <= 1 or float(memory).is_integer()))
        if not ok:
            raise KVSumError(f"memory must be None, a fraction in (0, 1] of the full 16-bit cache or a number of "
                             f"bytes (an integer > 1), got {memory!r}")

    def thresholds(self, latency: str | None = None) -> dict:
        """{"compress_from": tokens or None (never), "long_from": tokens or None} for a latency preference."""
        latency = latency or self.latency
        Ls, rows = self.table["lengths"], self.table["methods"]

        def ratios(m):  # a method the table did not measure counts as refused everywhere
            return rows[m]["ratio"] if m in rows else [None] * len(Ls)

        if latency == "memory":
            start = 0
        else:
            found = [x for x in (crossing(Ls, ratios(m), 1.0) for m in (self.mid, self.long)) if x is not None]
            start = min(found) if found else None
        if latency == "memory":
            long_from = None
        elif latency == "fast":
            long_from = crossing(Ls, [_gap(a, b) for a, b in zip(ratios(self.long), ratios(self.mid))], 0.0)
        else:  # the middle method's ratio stays above 1 + slack (refused lengths count as above)
            neg = [-math.inf if r is None else -r for r in ratios(self.mid)]
            long_from = crossing(Ls, neg, -(1 + LATENCY[latency]))
        return {"compress_from": start, "long_from": long_from}

    def choose(self, context_len: int, model=None, memory=None, latency: str | None = None) -> Decision:
        """The decision for a context of `context_len` tokens (`model` is needed for a memory budget in bytes)."""
        if latency is not None and latency not in LATENCY:
            raise KVSumError(f"latency={latency!r}; accepted: {', '.join(LATENCY)}")
        memory = self.memory if memory is None else memory
        self._check_memory(memory)
        frac = self._fraction(memory, context_len, model)
        th = self.thresholds(latency)
        start, long_from = th["compress_from"], th["long_from"]
        is_long = long_from is not None and context_len >= long_from
        where = f"compress_from={_fmt(start)}, long_from={_fmt(long_from)} tokens"
        if frac is None or frac >= 1:
            if start is None or context_len < start:
                return Decision("full", 1.0, {}, f"{context_len} tokens: below the break-even length ({where})")
            method = self.long if is_long else self.mid
            return self._decide(method, self.budget, f"{context_len} tokens: compression pays ({where})")
        if is_long or frac < self.mid_min_budget:
            why = "long context" if is_long else f"budget under {self.mid_min_budget} (beyond low-bit codes)"
            return self._decide(self.long, frac, f"memory binds at {frac:.3f}; {why} ({where})")
        return self._decide(self.mid, frac, f"memory binds at {frac:.3f}; middle range ({where})")

    def _decide(self, method: str, budget: float, reason: str) -> Decision:
        knobs = dict(self.knobs.get(method, {}))
        if method == "summary" and not knobs:
            reason += "; summary configured by budget when it compresses (cache.decision says how)"
        return Decision(method, min(1.0, budget), knobs, reason)

    @staticmethod
    def _fraction(memory, context_len: int, model) -> float | None:
        if memory is None or memory <= 1:
            return None if memory is None else float(memory)
        if model is None:
            raise KVSumError("a memory budget in bytes needs the model (choose(context_len, model=...))")
        _, glob = ModelShape.of(model).reference_nbytes(context_len)
        return float(memory) / glob if glob else 1.0

    def compress(self, model, input_ids, memory=None, latency: str | None = None, **kwargs):
        """kvsum.compress with the method and budget this policy picks for `input_ids`; `cache.decision` says why."""
        ids = check_ids(model, input_ids)
        d = self.choose(ids.shape[-1], model, memory, latency)
        cache = compress(model, ids, method=d.method, budget=d.budget, **{**d.knobs, **kwargs})
        made = getattr(cache, "decision", None)  # what a method configured by budget became (summary)
        if made is not None:
            d = Decision(made.method, d.budget, made.knobs, f"{d.reason}; {made.reason}")
        cache.decision = d
        return cache


def generate(model, tokenizer, context, question: str = "", policy: Policy | None = None,
             max_new_tokens: int = 64, return_cache: bool = False, *, questions: list[str] | None = None,
             cache=None, **gen_kwargs):
    """Answer `question` about `context` (text or (1, T) ids) greedily, the context's cache chosen by `policy`.

    When the policy keeps the full cache, this is exactly `model.generate` on context + question (no kvsum
    prefill, no extra work); otherwise the context is compressed first and the question read on top of it.
    Returns the generated text, or (text, cache) with `return_cache` (the cache's `decision` says why).

    `questions=[...]`: several questions about one context, from one compression (or from `cache`, a cache of
    the context already compressed or loaded, e.g. from a kvsum.Store): each question reads its own
    `cache.fork()`, so it gets what it would get on a fresh compression. Returns the list of answers (and the
    untouched prefix cache with `return_cache`). With the full cache the context is prefilled once too.
    """
    policy = policy if policy is not None else Policy()
    ctx = context if isinstance(context, torch.Tensor) else tokenizer(context, return_tensors="pt").input_ids
    device = next(model.parameters()).device
    ctx = check_ids(model, ctx.to(device))
    gen = dict(max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.eos_token_id, **gen_kwargs)
    if questions is not None or cache is not None:
        return _many(model, tokenizer, ctx, [question] if questions is None else questions, policy, cache, gen,
                     return_cache, single=questions is None)
    q = tokenizer(question, return_tensors="pt", add_special_tokens=False).input_ids.to(device)
    ids = torch.cat([ctx, q], dim=-1)
    if q.shape[-1] == 0:  # generate needs one token the cache has not seen: read the context's last on top
        ctx = check_ids(model, ctx[:, :-1])
    d = policy.choose(ctx.shape[-1], model)
    if d.method == "full":
        cache = None
        if return_cache:
            cache = gen["past_key_values"] = DynamicCache()
            cache.decision = d
        out = model.generate(ids, **gen)
    else:  # its decision is policy.compress's: what summary by budget became, too
        cache = policy.compress(model, ctx, tokenizer=tokenizer)
        out = model.generate(ids, past_key_values=cache, **gen)
    text = tokenizer.decode(out[0, ids.shape[-1]:], skip_special_tokens=True)
    return (text, cache) if return_cache else text


def _many(model, tokenizer, ctx, questions, policy, cache, gen, return_cache, single):
    """Every question answered on a fork of one compressed prefix (see generate)."""
    if isinstance(questions, str) or not questions:
        raise KVSumError("questions must be a non-empty list of strings")
    qs = [tokenizer(q, return_tensors="pt", add_special_tokens=False).input_ids.to(ctx.device) for q in questions]
    if any(q.shape[-1] == 0 for q in qs):
        raise KVSumError("every question needs at least one token (the cache holds the whole context)")
    if cache is None:  # the full cache too: policy.compress prefills it once
        cache = policy.compress(model, ctx, tokenizer=tokenizer)
    elif cache.get_seq_length() != ctx.shape[-1]:
        raise KVSumError(f"the cache given holds {cache.get_seq_length()} tokens; the context has {ctx.shape[-1]} "
                         "(pass the cache of this context, before any question was read on it)")
    answers = []
    for q in qs:
        ids = torch.cat([ctx, q], dim=-1)
        out = model.generate(ids, cache=cache.fork(), **gen)
        answers.append(tokenizer.decode(out[0, ids.shape[-1]:], skip_special_tokens=True))
    result = answers[0] if single else answers
    return (result, cache) if return_cache else result
