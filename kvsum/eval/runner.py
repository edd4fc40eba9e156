"""Run tasks x lengths x methods x budgets on one model, sharing each example's prefill.

The prefill (the expensive part) runs once per example; every (method, budget) cache and the
full-cache reference are built from it with `kvsum.compress_prefill`. Each row aggregates the same
examples, so a method's score and the full cache's score beside it are directly comparable.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import torch

from ..compress import compress_prefill
from ..errors import KVSumError
from ..extras import progress as progress_bar
from ..methods import Method, make_method, prefill_needs
from ..prefill import prefill
from ..shape import ModelShape
from .metrics import fidelity, summarize_fidelity
from .report import write  # noqa: F401  (re-exported: run, then write)
from .tasks import Example, Task, get_task

MethodSpec = str | Method | tuple[str | Method, dict] | tuple[str | Method, dict, Sequence[float]]


def _build(name: str | Method, knobs: dict) -> Method:
    """A configuration's method: built from its name and knobs, or given already built (a variant that is not
    registered, e.g. a diagnosis), whose knobs are then its fields that differ from their defaults."""
    return name if isinstance(name, Method) else make_method(name, **knobs)


def _label(name: str | Method, knobs: dict) -> tuple[str, dict]:
    """(method name, knobs) as a result row names them."""
    if not isinstance(name, Method):
        return name, knobs
    return name.name, {f.name: getattr(name, f.name) for f in dataclasses.fields(name)
                       if getattr(name, f.name) != f.default}


def _configs(methods: Sequence[MethodSpec], budgets: Sequence[float]) -> list[tuple[str, dict, float]]:
    """(name, knobs, budget) per configuration; a spec may carry its own budgets as a third element."""
    out = []
    for m in methods:
        name, knobs, own = (m, {}, None) if isinstance(m, str | Method) else (m[0], dict(m[1]),
                                                                               m[2] if len(m) > 2 else None)
        _build(name, knobs)  # fail before any prefill on a bad name or knob
        out += [(name, knobs, b) for b in ([1.0] if name == "full" else own or budgets)]
    return out


@torch.no_grad()
def answer(model, tokenizer, task: Task, ex: Example, cache) -> tuple[float, str]:
    """Append the question to the compressed context, generate greedily, score the text."""
    ids = torch.cat([ex.context_ids, ex.question_ids], -1).to(model.device)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    out = model.generate(ids, cache=cache, max_new_tokens=task.max_new_tokens, do_sample=False,
                         attention_mask=torch.ones_like(ids), pad_token_id=pad)
    text = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    return task.score(ex, text), text


@torch.no_grad()
def forced_logits(model, ex: Example, cache) -> torch.Tensor:
    """Next-token logits (q, V) over the teacher-forced continuation, on top of `cache`."""
    return model(ex.question_ids.to(model.device), cache=cache, use_cache=True).logits[0].float()


def prompt_length(model, t: Task, length: int) -> int:
    """The prompt length for `length`: RULER sizes a prompt so that it and what is read after it
    (`Task.tokens_after`: the answer generated, or the lm continuation) fit the model's window; a length at the
    window (32,768 on Qwen2.5-Coder) would put the answer at positions the model was never trained on. Shorter
    lengths are taken as given."""
    return min(length, ModelShape.of(model).max_len - t.tokens_after)


def run(model, tokenizer, task: str | Task | Sequence[str | Task], methods: Sequence[MethodSpec],
        budgets: Sequence[float], lengths: Sequence[int], n: int, seed: int = 0, progress: bool = True,
        refusals: bool = False) -> list[dict]:
    """One row per task x length x method x budget, aggregated over `n` examples.

    `methods`: names or built methods, (name, knobs) pairs or (name, knobs, budgets) triples; "full" gets one row
    at budget 1.0.
    A length is the prompt's (context and question), cut where the answer would run past the model's window
    (`prompt_length`); rows keep the length asked.
    Retrieval rows score accuracy in %, lm rows the KL(full || compressed) in nats (plus top1 %, ppl_ratio).
    `refusals`: a configuration that raises KVSumError (a budget below what it can hold) is dropped from the
    task and length and its row says why (`refused`: the error's first line) instead of ending the run (a sweep
    over budgets keeps its one prefill per example).
    """
    tasks = [get_task(task)] if isinstance(task, str | Task) else [get_task(t) for t in task]
    if n < 1 or not lengths:
        raise KVSumError("run needs n >= 1 and at least one length")
    configs = _configs(methods, budgets)
    rows: list[dict] = []
    with progress_bar("eval", len(tasks) * len(lengths) * n, enabled=progress, eta=True) as bar:
        for t in tasks:
            for length in lengths:
                bar.update(f"{t.name} @ {length} tokens")
                per = [[] for _ in configs]  # per config: one record per example
                refused: dict[int, str] | None = {} if refusals else None
                for ex in t.examples(tokenizer, prompt_length(model, t, length), n, seed):
                    _one_example(model, tokenizer, t, ex, configs, per, refused)
                    bar.advance()
                rows += [dict(_head(t, length, cfg), refused=refused[i]) if refused and i in refused else
                         _row(t, length, cfg, recs) for i, (cfg, recs) in enumerate(zip(configs, per))]
    return rows


def prefill_example(model, tokenizer, t: Task, ex: Example, configs) -> tuple:
    """Prefill one example once, with every extra its configurations ask for, and score the full cache on it:
    (prefill, prefill seconds, reference: the full cache's forced logits and targets, or its score)."""
    t0 = time.perf_counter()
    opts = prefill_needs(_build(name, knobs) for name, knobs, _ in configs)
    pre = prefill(model, ex.context_ids.to(model.device), tokenizer=tokenizer, **opts)
    prefill_s = time.perf_counter() - t0
    ref_cache = compress_prefill(pre, make_method("full"), 1.0)
    if t.kind == "lm":
        ref = (forced_logits(model, ex, ref_cache), ex.question_ids[0, 1:])
    else:
        ref = answer(model, tokenizer, t, ex, ref_cache)[0]
    return pre, prefill_s, ref


def chosen(cache) -> dict:
    """{"chosen": spec} for a cache compressed by a method configured by budget (summary with no knobs: what it
    became on this example), else {}."""
    made = getattr(cache, "decision", None)
    return {"chosen": made.spec} if made is not None else {}


def record(model, tokenizer, t: Task, ex: Example, pre, prefill_s: float, ref, name: str, knobs: dict,
           budget: float) -> dict:
    """One configuration on one prefilled example: bytes held, times, and its score beside the reference."""
    t0 = time.perf_counter()
    cache = compress_prefill(pre, _build(name, knobs), budget)
    compress_s = time.perf_counter() - t0
    rec = dict(bytes=cache.nbytes(), full_bytes=cache.reference_nbytes, depth=ex.depth, prefill_s=prefill_s,
               compress_s=compress_s, global_bytes=cache.budget_nbytes(),
               global_full_bytes=cache.budget_reference_nbytes)  # global_*: the layers the budget governs
    rec.update(chosen(cache))
    if t.kind == "lm":
        ref_logits, targets = ref
        rec.update(fidelity(ref_logits, forced_logits(model, ex, cache), targets))
    else:
        rec["score"], rec["output"] = answer(model, tokenizer, t, ex, cache)
        rec["full_score"] = ref
    rec["seconds"] = time.perf_counter() - t0
    return rec


def _one_example(model, tokenizer, t: Task, ex: Example, configs, per, refused: dict[int, str] | None) -> None:
    """Every configuration on one example; with `refused` (config index -> why), a refusal is recorded there."""
    pre, prefill_s, ref = prefill_example(model, tokenizer, t, ex, configs)
    for i, ((name, knobs, budget), recs) in enumerate(zip(configs, per)):
        if refused is not None and i in refused:
            continue
        try:
            recs.append(record(model, tokenizer, t, ex, pre, prefill_s, ref, name, knobs, budget))
        except KVSumError as err:
            if refused is None:
                raise
            refused[i] = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__


def _mean(recs: list[dict], key: str) -> float:
    return sum(r[key] for r in recs) / len(recs)


def _head(t: Task, length: int, cfg) -> dict:
    """What names a row: task, length, method, knobs, budget."""
    name, knobs = _label(*cfg[:2])
    return dict(task=t.name, length=length, method=name, knobs=knobs, budget=cfg[2])


def _row(t: Task, length: int, cfg, recs: list[dict]) -> dict:
    row = dict(_head(t, length, cfg), n=len(recs))
    if t.kind == "lm":
        fid = summarize_fidelity(recs)
        row.update(score=fid["kl"], full_score=0.0, **fid)
    else:
        row.update(score=100 * _mean(recs, "score"), full_score=100 * _mean(recs, "full_score"))
    held, full = _mean(recs, "bytes"), _mean(recs, "full_bytes")
    row.update(bytes=held, full_bytes=full, ratio=held / full, seconds=_mean(recs, "seconds"),
               global_ratio=_mean(recs, "global_bytes") / _mean(recs, "global_full_bytes"),
               compress_s=_mean(recs, "compress_s"), prefill_s=_mean(recs, "prefill_s"))
    chosen = sorted({r["chosen"] for r in recs if "chosen" in r})
    if chosen:
        row["chosen"] = chosen
    row["examples"] = [{k: r[k] for k in ("depth", "score", "full_score", "output", "kl", "top1", "chosen") if k in r}
                       for r in recs]
    return row
