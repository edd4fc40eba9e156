"""The eviction family on the bundled model, in parts sized for a shared 2-core CPU (one locked run each).

    python -m benchmarks.evict eval --tasks passkey multikey --lengths 2048 --n 8   # every method, 0.5/0.25/0.125
    python -m benchmarks.evict perhead --n 4     # adaptive vs uniform: bytes at equal lm KL, vs masking
    python -m benchmarks.evict decode            # decode-step time at 4k and 8k over the full cache's

Decoding-time eviction (stream, generate) is benchmarks/evict_stream.py. Method specs: `name:knob=value,...`
(`snapkv:allocation=adaptive`). The committed runs are named in benchmarks/experiments/evict.py.
"""

from __future__ import annotations

import math
import sys
import time

import torch

import kvsum
from kvsum.eval import run
from kvsum.eval.tasks import get_task
from kvsum.methods import make_method

from .common import arguments, finish, method_rows, parse_method, start, write_page

EVICTION = ["snapkv", "h2o", "restkv", "tova", "knorm", "expected_attention", "streaming_llm"]
BUDGETS = [0.5, 0.25, 0.125]
SWEEP = [0.0625, 0.09, 0.125, 0.18, 0.25, 0.35, 0.5]


def part_eval(args) -> None:
    model, tok, t0 = start(args)
    methods = [("full", {}, [1.0])] + method_rows(args.methods, BUDGETS)
    rows = run(model, tok, args.tasks, methods, [], args.lengths, args.n)
    finish(rows, args, t0)


def _dense_bytes(cache) -> tuple[int, int]:
    """(padded, entries): bytes of a dense (H, max head length, d) layout of the same entries, and the
    entries held; the former is what an implementation without ragged storage must allocate."""
    padded = entries = 0
    for layer in cache.layers:
        lengths = layer.state.lengths()
        d, size = layer.state.keys.shape[-1], layer.state.keys.element_size()
        padded += 2 * len(lengths) * max(lengths) * d * size
        entries += sum(lengths)
    return padded, entries


def _interp_bytes(curve: list[tuple[float, float]], kl: float) -> float | None:
    """Bytes ratio at which a (ratio, KL) curve, KL falling with bytes, reaches `kl` (linear in log ratio)."""
    pts = sorted(curve)
    for (r0, k0), (r1, k1) in zip(pts, pts[1:]):
        if (k0 - kl) * (k1 - kl) <= 0 and k0 != k1:
            f = (k0 - kl) / (k0 - k1)
            return math.exp(math.log(r0) + f * (math.log(r1) - math.log(r0)))
    return None


def part_perhead(args) -> None:
    """Adaptive (per-head) vs uniform allocation: lm KL over a budget sweep, then the bytes each needs for
    the same KL, and what masking (full cache) or a dense padded layout would hold for the adaptive entries."""
    model, tok, t0 = start(args)
    methods = [(m, {"allocation": a}, SWEEP) for m in args.methods for a in ("uniform", "adaptive")]
    length = args.lengths[0]
    rows = run(model, tok, "lm", methods, [], [length], args.n)
    ex = next(get_task("lm").examples(tok, length, 1, seed=0))
    pre = kvsum.prefill(model, ex.context_ids)
    layout = {}
    for m in args.methods:
        for b in SWEEP:
            cache = kvsum.compress_prefill(pre, make_method(m, allocation="adaptive"), b)
            padded, entries = _dense_bytes(cache)
            layout[(m, b)] = dict(padded=padded / cache.reference_nbytes, held=cache.nbytes() / cache.reference_nbytes,
                                  entries=entries)
    out, table = [], ["| method | uniform budget | uniform KL | adaptive bytes for that KL | bytes saved | "
                      "adaptive KL at same bytes | dense padded layout | masking (full cache) |",
                      "|---|---|---|---|---|---|---|---|"]
    for m in args.methods:
        uni = [(r["ratio"], r["kl"]) for r in rows if r["method"] == m and r["knobs"]["allocation"] == "uniform"]
        ada = [(r["ratio"], r["kl"]) for r in rows if r["method"] == m and r["knobs"]["allocation"] == "adaptive"]
        for (ru, ku), b in zip(sorted(uni), sorted(SWEEP)):
            need = _interp_bytes(ada, ku)
            ka = next(k for (r, k), bb in zip(sorted(ada), sorted(SWEEP)) if bb == b)
            lay = layout[(m, b)]
            out.append(dict(method=m, budget=b, uniform_ratio=ru, uniform_kl=ku, adaptive_ratio_same_kl=need,
                            adaptive_kl_same_budget=ka, adaptive_held_ratio=lay["held"],
                            adaptive_padded_ratio=lay["padded"], masked_ratio=1.0))
            saved = f"{100 * (1 - need / ru):.0f}%" if need else "-"
            table.append(f"| {m} | {b:g} | {ku:.4f} | {need:.3f} | {saved} | {ka:.4f} | {lay['padded']:.3f} | 1.000 |"
                         if need else f"| {m} | {b:g} | {ku:.4f} | outside sweep | - | {ka:.4f} | "
                         f"{lay['padded']:.3f} | 1.000 |")
    title = (f"Per-head budgets: adaptive vs uniform allocation, lm KL at {length} tokens, n={args.n}")
    notes = ["", "Bytes are ratios to the full cache at 16 bits. 'adaptive bytes for that KL': the bytes at which the",
             "adaptive curve reaches the uniform KL (interpolated linearly in log bytes over the sweep "
             f"{SWEEP}). 'dense padded layout': the adaptive entries in a (H, longest head, d) tensor per",
             "layer (one example); 'masking': an implementation that masks dropped entries keeps the whole cache.",
             "", "Sweep rows (lm task):", ""]
    sweep = ["| method | allocation | budget | ratio | KL | top-1 % |", "|---|---|---|---|---|---|"]
    sweep += [f"| {r['method']} | {r['knobs']['allocation']} | {r['budget']:g} | {r['ratio']:.3f} | {r['kl']:.4f} | "
              f"{r['top1']:.1f} |" for r in rows]
    write_page(out, args, t0, title, table + notes + sweep, sweep=rows)


@torch.no_grad()
def _interleaved_steps(model, caches: list, token, steps: int) -> list[float]:
    """Median seconds of a one-token forward on each cache, measured round-robin (one step on every cache per
    round), so that load from other processes falls on all of them alike and their ratios stay comparable."""
    times = [[] for _ in caches]
    for _ in range(steps):
        for i, cache in enumerate(caches):
            t = time.perf_counter()
            model(token, cache=cache)
            times[i].append(time.perf_counter() - t)
    return [sorted(ts)[len(ts) // 2] for ts in times]


def part_decode(args) -> None:
    """Decode-step time with each compressed cache over the full cache's, at several context lengths."""
    model, tok, t0 = start(args)
    rows = []
    kvsum.prefill(model, torch.arange(256)[None] + 100)  # warm-up
    for length in args.lengths:
        ex = next(get_task("lm").examples(tok, length, 1, seed=11))
        token = ex.question_ids[:, :1]
        pre = kvsum.prefill(model, ex.context_ids)
        caches, info = [kvsum.compress_prefill(pre, make_method("full"), 1.0)], []
        for spec in args.methods:
            name, knobs = parse_method(spec)
            t = time.perf_counter()
            caches.append(kvsum.compress_prefill(pre, make_method(name, **knobs), args.budget))
            info.append((name, knobs.get("allocation", "uniform"), time.perf_counter() - t, caches[-1].ratio()))
        del pre
        full, *steps = _interleaved_steps(model, caches, token, args.steps)
        for (name, alloc, compress_s, ratio), step in zip(info, steps):
            rows.append(dict(length=length, method=name, allocation=alloc, budget=args.budget, ratio=ratio,
                             compress_s=compress_s, decode_step_s=step, full_decode_step_s=full,
                             decode_over_full=step / full))
            print(rows[-1], flush=True)
        del caches
    table = ["| length | method | allocation | bytes ratio | compress s | decode step ms | full step ms | "
             "decode / full |", "|---|---|---|---|---|---|---|---|"]
    table += [f"| {r['length']} | {r['method']} | {r['allocation']} | {r['ratio']:.3f} | {r['compress_s']:.2f} | "
              f"{r['decode_step_s'] * 1000:.1f} | {r['full_decode_step_s'] * 1000:.1f} | {r['decode_over_full']:.3f} |"
              for r in rows]
    write_page(rows, args, t0, f"Decode-step time, budget {args.budget}, median of {args.steps} steps taken "
               f"round-robin over the caches, {args.threads} threads (ratios from one run)", table +
               ["", "The full cache holds the model's float32; the compressed caches float16 entries (ratio: bytes "
                "over the full cache at 16 bits)."])


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    part = argv[0] if argv and not argv[0].startswith("-") else None
    parts = dict(eval=part_eval, perhead=part_perhead, decode=part_decode)
    if part not in parts:
        raise SystemExit(f"usage: python -m benchmarks.evict {{{'|'.join(parts)}}} [options]")
    ap = arguments(__doc__, f"evict/evict_{part}", threads=2)
    if part == "eval":
        ap.add_argument("--tasks", nargs="+", default=["passkey", "multikey"])
        ap.add_argument("--lengths", type=int, nargs="+", default=[2048])
        ap.add_argument("--n", type=int, default=6)
        ap.add_argument("--methods", nargs="+", default=EVICTION, help="specs; own budgets after @")
    elif part == "perhead":
        ap.add_argument("--lengths", type=int, nargs=1, default=[2048])
        ap.add_argument("--n", type=int, default=4)
        ap.add_argument("--methods", nargs="+", default=["snapkv", "tova", "expected_attention"])
    else:
        ap.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192])
        ap.add_argument("--budget", type=float, default=0.25)
        ap.add_argument("--steps", type=int, default=16)
        ap.add_argument("--methods", nargs="+",
                        default=["streaming_llm", "snapkv", "h2o", "restkv", "snapkv:allocation=adaptive"])
    parts[part](ap.parse_args(argv[1:]))


if __name__ == "__main__":
    main()
