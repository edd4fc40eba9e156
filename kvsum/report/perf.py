"""The report's timings, each method measured beside the full cache in the same unit so ratios share one run.

- throughput: short prompts, `new` greedy tokens; time of prefill (+ compression) + decoding, for the full
  cache (transformers' DynamicCache) and each method always on; tokens per second and the ratio to full.
- scaling: per context length, plain prefill time and one full-cache decode step, then per method the
  compression time (on a kvsum prefill that captures what the methods need) and its decode step. Overhead =
  (kvsum prefill + compress) / plain prefill; decode ratio = method step / full step (median of 5 steps).
Results are cached per (kind, length, method) like the evaluation, so runs resume.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from ..compress import compress_prefill
from ..errors import KVSumError
from ..eval.tasks import LMFidelity, example_seed
from ..methods import make_method, prefill_needs
from ..prefill import prefill
from .specs import Store


def _cached(store: Store, fields: dict, errors: dict | None, label: str) -> dict | None:
    """The cached result, or None; a cached error goes to `errors` and counts as done (returns {})."""
    res = store.get(fields)
    if res is not None and "error" in res:
        if errors is not None:
            errors[label] = res["error"]
    return res


def _failed(store: Store, fields: dict, errors: dict | None, label: str, e: Exception) -> None:
    """Note the error; cache it when it is a KVSumError (the method refuses these settings, every time)."""
    msg = f"{type(e).__name__}: {e}"
    if errors is not None:
        errors[label] = msg
    if isinstance(e, KVSumError):
        store.put(fields, dict(error=msg))


def _ids(tokenizer, length: int, model) -> torch.Tensor:
    return LMFidelity(continuation=1).example(tokenizer, length, example_seed(7, 0)).context_ids.to(model.device)


@torch.no_grad()
def _decode(model, first: torch.Tensor, cache, steps: int) -> list[float]:
    """Per-step seconds of `steps` greedy decode steps on `cache`, starting from token(s) `first`."""
    x, times = first, []
    for _ in range(steps):
        t0 = time.perf_counter()
        out = model(x, cache=cache, use_cache=True)
        times.append(time.perf_counter() - t0)
        cache = out.cache
        x = out.logits[:, -1:].argmax(-1)
    return times


@torch.no_grad()
def _request_full(model, ids, new: int) -> float:
    t0 = time.perf_counter()
    out = model(ids, use_cache=True)
    _decode(model, out.logits[:, -1:].argmax(-1), out.cache, new - 1)
    return time.perf_counter() - t0


@torch.no_grad()
def _request(model, tokenizer, ids, new: int, name: str, knobs: dict, budget: float) -> tuple[float, float]:
    """Seconds for one request with the method always on: kvsum prefill, compress, `new` tokens; and the ratio."""
    method = make_method(name, **knobs)
    t0 = time.perf_counter()
    pre = prefill(model, ids[:, :-1], tokenizer=tokenizer, **prefill_needs([method]))
    cache = compress_prefill(pre, method, budget, consume=True)
    _decode(model, ids[:, -1:], cache, new)
    return time.perf_counter() - t0, cache.nbytes() / cache.reference_nbytes


def throughput(model, tokenizer, model_name: str, specs, budget: float, lengths: list[int], new: int, threads: int,
               store: Store, deadline: float | None = None, on_unit: Callable[[str], None] | None = None,
               errors: dict | None = None):
    """Rows {length, method, tok_s, full_tok_s, ratio_to_full, bytes_ratio}; and whether all are done.

    A method that raises is noted in `errors` ("throughput <length> <method>" -> message) and left out."""
    rows, complete = [], True
    for length in lengths:
        ids = None
        for name, knobs in specs:
            fields = dict(kind="throughput", model=model_name, length=length, new=new, method=name, knobs=knobs,
                          budget=budget, threads=threads)
            res = _cached(store, fields, errors, f"throughput {length} {name}")
            if res is None and not (deadline is not None and time.time() > deadline):
                ids = _ids(tokenizer, length, model) if ids is None else ids
                _request_full(model, ids[:, :16], 2)  # warm-up
                full = min(_request_full(model, ids, new) for _ in range(2))
                try:
                    secs, ratio = min(_request(model, tokenizer, ids, new, name, knobs, budget) for _ in range(2))
                except Exception as e:
                    _failed(store, fields, errors, f"throughput {length} {name}", e)
                    if on_unit:
                        on_unit(f"throughput {length} {name}")
                    continue
                res = dict(length=length, method=name, full_s=full, s=secs, tok_s=new / secs, full_tok_s=new / full,
                           ratio_to_full=full / secs, bytes_ratio=ratio, new=new, budget=budget)
                store.put(fields, res)
            complete = _settle(res, rows, on_unit, f"throughput {length} {name}") and complete
    return rows, complete


def _settle(res: dict | None, rows: list[dict], on_unit, label: str) -> bool:
    """File one unit's result (a measurement, a cached refusal, or None when the deadline left it undone);
    False when it is still to do."""
    if res is not None and "error" not in res:
        rows.append(res)
    if on_unit:
        on_unit(label)
    return res is not None


def scaling(model, tokenizer, model_name: str, specs, budget: float, lengths: list[int], threads: int,
            store: Store, deadline: float | None = None, on_unit: Callable[[str], None] | None = None,
            errors: dict | None = None):
    """Rows {length, method, prefill_s, kvsum_prefill_s, compress_s, overhead, step_ms, full_step_ms, decode_ratio}."""
    rows, complete = [], True
    for length in lengths:
        base = None
        for name, knobs in specs:
            fields = dict(kind="scaling", model=model_name, length=length, method=name, knobs=knobs, budget=budget,
                          threads=threads)
            res = _cached(store, fields, errors, f"scaling {length} {name}")
            if res is None and not (deadline is not None and time.time() > deadline):
                if base is None:
                    base = _baseline(model, tokenizer, length, specs)
                method = make_method(name, **knobs)
                t0 = time.perf_counter()
                try:
                    cache = compress_prefill(base["pre"], method, budget)
                    compress_s = time.perf_counter() - t0
                    step = statistics.median(_decode(model, base["ids"][:, -1:], cache, 6)[1:])
                except Exception as e:
                    _failed(store, fields, errors, f"scaling {length} {name}", e)
                    if on_unit:
                        on_unit(f"scaling {length} {name}")
                    continue
                res = dict(length=length, method=name, prefill_s=base["prefill_s"],
                           kvsum_prefill_s=base["kvsum_prefill_s"], compress_s=compress_s,
                           overhead=(base["kvsum_prefill_s"] + compress_s) / base["prefill_s"],
                           step_ms=1000 * step, full_step_ms=1000 * base["full_step"],
                           decode_ratio=step / base["full_step"], bytes_ratio=cache.nbytes() / cache.reference_nbytes)
                store.put(fields, res)
            complete = _settle(res, rows, on_unit, f"scaling {length} {name}") and complete
    return rows, complete


@torch.no_grad()
def _baseline(model, tokenizer, length: int, specs) -> dict:
    ids = _ids(tokenizer, length, model)
    t0 = time.perf_counter()
    out = model(ids[:, :-1], use_cache=True)
    prefill_s = time.perf_counter() - t0
    full_step = statistics.median(_decode(model, ids[:, -1:], out.cache, 6)[1:])
    del out
    opts = prefill_needs(make_method(name, **knobs) for name, knobs in specs)
    t0 = time.perf_counter()
    pre = prefill(model, ids[:, :-1], tokenizer=tokenizer, **opts)
    return dict(ids=ids, pre=pre, prefill_s=prefill_s, kvsum_prefill_s=time.perf_counter() - t0, full_step=full_step)


def from_files(folder: Path, budget: float) -> tuple[list[dict], list[dict], list[str]] | None:
    """Throughput and scaling rows from benchmarks/perf.py's results (perf_short/overhead/decode.json), if all exist.

    Converted to this module's row format; the ratios there were measured in one run each, as here.
    """
    paths = [folder / f"perf_{p}.json" for p in ("short", "overhead", "decode")]
    if not all(p.is_file() for p in paths):
        return None
    short, over, dec = (json.loads(p.read_text())["rows"] for p in paths)
    full_tok = {r["length"]: r["tokens_per_s"] for r in short if r.get("config") == "full"}
    tp = [dict(length=r["length"], method=r["config"], tok_s=r["tokens_per_s"], full_tok_s=full_tok.get(r["length"]),
               ratio_to_full=r["over_full"], bytes_ratio=None, new=None, budget=None)
          for r in short if r.get("config") != "full" and r.get("tokens_per_s") and r["length"] in full_tok]
    full_step = {r["length"]: r["step_ms"] for r in dec if r.get("method") == "full"}
    steps = {(r["length"], r["method"]): r for r in dec if r.get("method") != "full" and "step_ms" in r
             and abs(r.get("budget", budget) - budget) < 1e-9}
    ovs = {(r["length"], r["method"]): r for r in over if "overhead" in r}
    sc = []
    for key in sorted(set(steps) | set(ovs)):
        o, d = ovs.get(key, {}), steps.get(key, {})
        sc.append(dict(length=key[0], method=key[1], prefill_s=o.get("prefill_s"),
                       kvsum_prefill_s=o.get("kvsum_prefill_s"), compress_s=o.get("compress_s"),
                       overhead=o.get("overhead"), step_ms=d.get("step_ms"), full_step_ms=full_step.get(key[0]),
                       decode_ratio=d.get("over_full"), bytes_ratio=d.get("ratio")))
    return tp, sc, [str(p) for p in paths]
