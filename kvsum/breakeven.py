"""Break-even calibration: from what context length does compressing pay, in time, on this machine?

For one request of T context tokens and N generated tokens, the full cache costs a plain prefill plus N
decode steps over T full entries; a method costs its prefill (with the query capture and extras it asks
for), the compression, and N decode steps over its compressed cache. `measure` times all of these per
length of a small grid, with the decode steps of all caches interleaved round by round (so a noisy
neighbour slows every cache alike) and their medians taken, and returns a table of total-time ratios
(method / full) per length. The break-even length of a method is where its ratio falls to 1 and stays
there up to the end of the grid, interpolated in log length; None ("never") if it is above 1 at the
longest length measured. `kvsum.Policy` reads the table (`load`).
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import torch
from transformers import DynamicCache

from .compress import compress_prefill
from .errors import KVSumError
from .extras import progress as progress_bar
from .methods import make_method, prefill_needs
from .prefill import prefill

DEFAULT_LENGTHS = (256, 512, 1024, 2048, 4096)
DEFAULT_METHODS = ("turboquant", "kivi", "summary", "summary+turboquant", "streaming_llm", "snapkv")
SHIPPED = Path(__file__).parent / "data" / "breakeven.json"


def crossing(lengths: list[int], curve: list[float], level: float = 1.0) -> int | None:
    """The smallest length from which `curve` stays <= `level` to the end of the grid (linear in log length
    between the last grid point above and the next one); None if it ends above `level`. None entries (a
    method that refused the length) count as above."""
    curve = [math.inf if x is None else x for x in curve]
    if not curve or curve[-1] > level:
        return None
    i = len(curve) - 1
    while i > 0 and curve[i - 1] <= level:
        i -= 1
    if i == 0:
        return int(lengths[0])
    a, b = curve[i - 1], curve[i]  # a > level >= b
    if math.isinf(a) or math.isinf(b):
        return int(lengths[i])
    w = (a - level) / (a - b)
    return int(round(math.exp(math.log(lengths[i - 1]) + w * (math.log(lengths[i]) - math.log(lengths[i - 1])))))


def load(path: str | Path | None = None) -> dict:
    """A break-even table written by `measure`/`kvsum bench breakeven` (default: the one shipped with kvsum)."""
    p = Path(path) if path is not None else SHIPPED
    try:
        table = json.loads(p.read_text())
    except (OSError, ValueError) as e:
        raise KVSumError(f"cannot read the break-even table {str(p)!r} ({e}); "
                         "write one with `kvsum bench breakeven`") from None
    if not {"lengths", "methods", "new_tokens"} <= set(table):
        raise KVSumError(f"{str(p)!r} is not a break-even table (needs lengths, methods, new_tokens)")
    return table


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2]


def _timed(fn):
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t


@torch.no_grad()
def step_times(model, caches: dict, token: torch.Tensor, rounds: int) -> dict[str, float]:
    """Median seconds of a one-token forward over each cache; one step per cache per round, the token
    cropped off again so every round sees the same cache."""
    times: dict[str, list[float]] = {k: [] for k in caches}
    for _ in range(rounds):
        for name, cache in caches.items():
            t = time.perf_counter()
            model(token, cache=cache)
            times[name].append(time.perf_counter() - t)
            cache.crop(-1)
    return {k: _median(v) for k, v in times.items()}


@torch.no_grad()
def measure(model, tokenizer, methods=DEFAULT_METHODS, lengths=DEFAULT_LENGTHS, *, ids: torch.Tensor,
            new_tokens: int = 64, budget: float = 0.25, rounds: int = 9, progress: bool = False) -> dict:
    """The break-even table (see the module docstring) for `methods` at `budget` over `lengths`; the contexts
    are prefixes of `ids` (1, >= max(lengths)), e.g. real prose from kvsum.eval.text.prose_ids."""
    made = {name: make_method(name) for name in methods}  # unknown names fail before any timing
    needs = {name: tuple(sorted(prefill_needs([m]))) for name, m in made.items()}  # the prefill each one asks for
    if new_tokens < 1:
        raise KVSumError(f"new_tokens must be >= 1, got {new_tokens}")
    lengths = sorted(int(n) for n in lengths)
    if ids.shape[-1] < lengths[-1]:
        raise KVSumError(f"lengths up to {lengths[-1]} need that many tokens, got {ids.shape[-1]}")
    token = ids[:, :1]
    decoder = model.get_decoder()
    prefill(model, ids[:, :128])  # warm-up (also switches the model to kvsum's attention)
    rows = {name: dict(prefill_s=[], compress_s=[], step_s=[], ratio=[]) for name in methods}
    full = dict(prefill_s=[], step_s=[])
    with progress_bar("break-even", len(lengths) * (len(methods) + 2), enabled=progress) as bar:
        for T in lengths:
            ctx = ids[:, :T]
            repeat = 2 if T <= 1024 else 1
            plain = min(_timed(lambda c=ctx: decoder(c, cache=DynamicCache(), use_cache=True))[1]
                        for _ in range(repeat))
            pres, pre_s = {}, {}
            for opts in needs.values():
                if opts not in pres:
                    pres[opts], pre_s[opts] = _timed(lambda c=ctx, o=opts: prefill(model, c, tokenizer=tokenizer,
                                                                                   **dict.fromkeys(o, True)))
            bar.advance(f"prefill {T}")
            base = pres[()] if () in pres else prefill(model, ctx)
            caches = {"full": compress_prefill(base, make_method("full"), 1.0)}
            comp = {}
            for name, m in made.items():
                opts = needs[name]
                rows[name]["prefill_s"].append(pre_s[opts])
                try:
                    caches[name], comp[name] = _timed(lambda p=pres[opts], m=m: compress_prefill(p, m, budget))
                except KVSumError as e:  # e.g. kivi's full-precision window alone exceeds the budget
                    comp[name] = None
                    rows[name].setdefault("refused", {})[str(T)] = str(e)
                rows[name]["compress_s"].append(comp[name])
                bar.advance(f"compress {name} {T}")
            steps = step_times(model, caches, token, rounds)
            bar.advance(f"decode steps {T}")
            full["prefill_s"].append(plain)
            full["step_s"].append(steps["full"])
            total_full = plain + new_tokens * steps["full"]
            for name in made:
                r = rows[name]
                if comp[name] is None:  # refused at this length: never chosen there
                    r["step_s"].append(None)
                    r["ratio"].append(None)
                    continue
                r["step_s"].append(steps[name])
                r["ratio"].append((r["prefill_s"][-1] + r["compress_s"][-1] + new_tokens * steps[name]) / total_full)
            del caches, pres, base
    for r in rows.values():
        r["breakeven"] = crossing(lengths, r["ratio"])
    return dict(lengths=lengths, new_tokens=new_tokens, budget=budget, rounds=rounds,
                threads=torch.get_num_threads(), full=full, methods=rows)


def markdown(table: dict) -> str:
    """The table as markdown: total-time ratio per method and length, and the break-even length."""
    Ls, N = table["lengths"], table["new_tokens"]
    lines = [f"# Break-even: compression + {N} decode steps vs the full cache (budget {table['budget']}, "
             f"{table.get('threads', '?')} threads)", "",
             "Total-time ratio (method / full: prefill + compression + N decode steps); below 1 compression pays.",
             "", "| method | " + " | ".join(str(L) for L in Ls) + " | break-even |",
             "|---|" + "---|" * (len(Ls) + 1)]
    for name, r in table["methods"].items():
        be = r["breakeven"]
        cells = " | ".join("refused" if x is None else f"{x:.3f}" for x in r["ratio"])
        lines.append(f"| {name} | {cells} | {be if be else 'never'} |")
    f = table["full"]
    lines += ["", "| full cache | " + " | ".join(str(L) for L in Ls) + " |", "|---|" + "---|" * len(Ls),
              "| prefill s | " + " | ".join(f"{x:.2f}" for x in f["prefill_s"]) + " |",
              "| decode step ms | " + " | ".join(f"{x * 1000:.1f}" for x in f["step_s"]) + " |"]
    return "\n".join(lines) + "\n"
