"""The eviction family on the bundled model, in parts sized for a shared 2-core CPU (one locked run each).

    python benchmarks/evict.py eval --tasks passkey multikey --length 2048 --n 8   # every method, 0.5/0.25/0.125
    python benchmarks/evict.py eval --tasks lm --length 2048 --n 6
    python benchmarks/evict.py perhead --n 4          # adaptive vs uniform: bytes at equal lm KL, vs masking
    python benchmarks/evict.py decode                 # decode-step time at 4k and 8k over the full cache's
    python benchmarks/evict.py stream                 # decoding-time eviction, teacher-forced: KL vs full
    python benchmarks/evict.py generate               # 1k context + 4096 generated tokens in bounded memory

Each part writes benchmarks/results/evict_<part>[_<suffix>].{json,md} with its command line.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

import torch
from common import RESULTS, arguments, finish, start

import kvsum
from kvsum.eval import run
from kvsum.eval.metrics import fidelity
from kvsum.eval.report import meta
from kvsum.eval.tasks import get_task
from kvsum.methods.base import make_method

EVICTION = ["snapkv", "h2o", "restkv", "tova", "knorm", "expected_attention", "streaming_llm"]
BUDGETS = [0.5, 0.25, 0.125]
SWEEP = [0.0625, 0.09, 0.125, 0.18, 0.25, 0.35, 0.5]


def _write(rows: list[dict], args, t0: float, title: str, table: list[str], **extra) -> None:
    """JSON rows (+ extra keys) and a markdown page (title, command, table) for the parts that are not runner rows."""
    stem = Path(args.out)
    stem.parent.mkdir(parents=True, exist_ok=True)
    info = meta(args.model, " ".join(["python", *sys.argv]), threads=args.threads,
                wall_s=round(time.perf_counter() - t0, 1))
    data = json.dumps({"meta": info, "rows": rows, **extra}, indent=1, default=str)
    stem.with_name(stem.name + ".json").write_text(data + "\n")
    md = [f"# {title}", "", ", ".join(f"{k}: {v}" for k, v in info.items()), "", *table, ""]
    stem.with_name(stem.name + ".md").write_text("\n".join(md))
    print("\n".join(md))


def part_eval(args) -> None:
    model, tok, t0 = start(args)
    methods = [("full", {}, [1.0])] + [(m, {}, BUDGETS) for m in args.methods]
    rows = run(model, tok, args.tasks, methods, [], [args.length], args.n)
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
    rows = run(model, tok, "lm", methods, [], [args.length], args.n)
    ex = next(get_task("lm").examples(tok, args.length, 1, seed=0))
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
    title = (f"Per-head budgets: adaptive vs uniform allocation, lm KL at {args.length} tokens, n={args.n}")
    notes = ["", "Bytes are ratios to the full cache at 16 bits. 'adaptive bytes for that KL': the bytes at which the",
             "adaptive curve reaches the uniform KL (interpolated linearly in log bytes over the sweep "
             f"{SWEEP}). 'dense padded layout': the adaptive entries in a (H, longest head, d) tensor per",
             "layer (one example); 'masking': an implementation that masks dropped entries keeps the whole cache.",
             "", "Sweep rows (lm task):", ""]
    sweep = ["| method | allocation | budget | ratio | KL | top-1 % |", "|---|---|---|---|---|---|"]
    sweep += [f"| {r['method']} | {r['knobs']['allocation']} | {r['budget']:g} | {r['ratio']:.3f} | {r['kl']:.4f} | "
              f"{r['top1']:.1f} |" for r in rows]
    _write(out, args, t0, title, table + notes + sweep, sweep=rows)


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
            name, _, alloc = spec.partition(":")
            knobs = {"allocation": alloc} if alloc else {}
            t = time.perf_counter()
            caches.append(kvsum.compress_prefill(pre, make_method(name, **knobs), args.budget))
            info.append((name, alloc or "uniform", time.perf_counter() - t, caches[-1].ratio()))
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
    _write(rows, args, t0, f"Decode-step time, budget {args.budget}, median of {args.steps} steps taken round-robin "
           f"over the caches, {args.threads} threads (ratios from one run)", table +
           ["", "The full cache holds the model's float32; the compressed caches float16 entries (ratio: bytes over "
            "the full cache at 16 bits)."])


@torch.no_grad()
def _teacher_forced(model, ctx, text, cache, chunk: int) -> torch.Tensor:
    """Logits (n, V) for `text` fed `chunk` tokens at a time on top of `cache` (which holds ctx)."""
    out = [model(text[:, a:a + chunk], cache=cache).logits[0].float() for a in range(0, text.shape[1], chunk)]
    return torch.cat(out)


def part_stream(args) -> None:
    """Decoding-time eviction against the full cache, teacher-forced on real text: a short context, then a
    long continuation fed in small chunks while every method holds each head at max_tokens entries."""
    model, tok, t0 = start(args)
    ex = next(get_task("lm").examples(tok, args.context + args.tokens, 1, seed=5))
    ids = ex.context_ids
    ctx, text = ids[:, :args.context], ids[:, args.context:]
    ref_cache = kvsum.compress(model, ctx, method="full")
    ref = _teacher_forced(model, ctx, text, ref_cache, args.tokens)  # one pass: the full cache
    full_bytes = ref_cache.nbytes()
    rows = []
    for spec in args.methods:
        name, _, alloc = spec.partition(":")
        knobs = {"allocation": alloc} if alloc else {}
        ev = kvsum.DecodingEviction(model, name, max_tokens=args.max_tokens, every=args.every, **knobs)
        cache = kvsum.compress(model, ctx, method="full").attach(ev)
        t = time.perf_counter()
        logits = _teacher_forced(model, ctx, text, cache, args.chunk)
        secs = time.perf_counter() - t
        half = args.tokens // 2
        fid = fidelity(ref, logits, text[0, 1:])
        late = fidelity(ref[half:], logits[half:], text[0, half + 1:])
        rows.append(dict(method=name, allocation=alloc or "uniform", max_tokens=args.max_tokens, every=args.every,
                         kl=fid["kl"], top1=100 * fid["top1"], ppl_ratio=math.exp(fid["nll"] - fid["nll_full"]),
                         kl_second_half=late["kl"], bytes=cache.nbytes(), full_bytes=full_bytes,
                         max_entries=max(max(layer.lengths()) for layer in cache.layers),
                         compressions=ev.compressions(), query_bytes=ev.query_nbytes(), seconds=secs))
        print(rows[-1], flush=True)
    table = ["| method | allocation | KL | KL, 2nd half | top-1 % | ppl ratio | bytes held (MiB) | full cache (MiB) | "
             "max entries/head | s |", "|---|---|---|---|---|---|---|---|---|---|"]
    table += [f"| {r['method']} | {r['allocation']} | {r['kl']:.4f} | {r['kl_second_half']:.4f} | {r['top1']:.1f} | "
              f"{r['ppl_ratio']:.4f} | {r['bytes'] / 2**20:.2f} | {r['full_bytes'] / 2**20:.2f} | {r['max_entries']} | "
              f"{r['seconds']:.1f} |" for r in rows]
    _write(rows, args, t0, f"Decoding-time eviction, teacher-forced: {args.context}-token context + {args.tokens} "
           f"tokens in chunks of {args.chunk}, max_tokens={args.max_tokens}, every={args.every}", table +
           ["", "KL(full || evicting) over the continuation's next-token distributions; the full cache holds the "
            "model's float32, the evicting caches float16 entries plus a float32 tail of at most `every` tokens."])


def part_generate(args) -> None:
    """A long greedy generation with decoding-time eviction: cache bytes and step time as it goes."""
    model, tok, t0 = start(args)
    ex = next(get_task("lm").examples(tok, args.context, 1, seed=7))
    ctx = ex.context_ids
    name, _, alloc = args.method.partition(":")
    knobs = {"allocation": alloc} if alloc else {}
    ev = kvsum.DecodingEviction(model, name, max_tokens=args.max_tokens, every=args.every, **knobs)
    cache = kvsum.compress(model, ctx, method="full")
    start_bytes = cache.nbytes()
    cache.attach(ev)
    per_token_fp32 = start_bytes / ctx.shape[1]  # the full cache in the model's dtype grows by this per token
    trace, peak, peak_all, token = [], 0, 0, ex.question_ids[:, :1]
    generated = []
    t = time.perf_counter()
    with torch.no_grad():
        for step in range(args.tokens):
            out = model(token, cache=cache)
            token = out.logits[:, -1:].argmax(-1)
            generated.append(int(token))
            held = cache.nbytes()
            peak_all = max(peak_all, held)
            if ev.compressions():
                peak = max(peak, held)  # after the first compression
            if step % args.record == 0 or step == args.tokens - 1:
                seen = cache.get_seq_length()
                trace.append(dict(step=step, tokens_seen=seen, bytes=held, full_bytes=round(per_token_fp32 * seen),
                                  full16_bytes=round(per_token_fp32 * seen / 2),
                                  max_entries=max(max(layer.lengths()) for layer in cache.layers),
                                  elapsed_s=time.perf_counter() - t))
    secs = time.perf_counter() - t
    seen = cache.get_seq_length()
    row = dict(method=name, allocation=alloc or "uniform", context=ctx.shape[1], tokens=args.tokens,
               max_tokens=args.max_tokens, every=args.every, peak_bytes=peak, peak_bytes_all=peak_all,
               end_bytes=cache.nbytes(),
               full_end_bytes=round(per_token_fp32 * seen), full16_end_bytes=round(per_token_fp32 * seen / 2),
               start_full_bytes=start_bytes, compressions=ev.compressions(), query_bytes=ev.query_nbytes(),
               seconds=secs, tokens_per_s=args.tokens / secs, text_tail=tok.decode(generated[-60:]), trace=trace)
    mib = 2 ** 20
    table = [f"Context {ctx.shape[1]} tokens (full cache {start_bytes / mib:.1f} MiB in the model's float32), then "
             f"{args.tokens} greedy tokens with `DecodingEviction({name!r}{', allocation=' + alloc if alloc else ''}, "
             f"max_tokens={args.max_tokens}, every={args.every})`: {secs:.0f} s, {args.tokens / secs:.1f} tokens/s, "
             f"{ev.compressions()} layer compressions.", "",
             f"Peak `cache.nbytes()` after the first compression: {peak / mib:.2f} MiB (over the whole run, the "
             f"starting full cache included: {peak_all / mib:.2f} MiB); at the end "
             f"{row['end_bytes'] / mib:.2f} MiB, against {row['full_end_bytes'] / mib:.1f} MiB for the full cache "
             f"(float32) or {row['full16_end_bytes'] / mib:.1f} MiB at 16 bits for the {seen} tokens seen. "
             f"Observed queries kept by the streams: {row['query_bytes'] / mib:.2f} MiB (outside nbytes).", "",
             "| step | tokens seen | cache MiB | full cache MiB (fp32) | full at 16 bits MiB | max entries/head | s |",
             "|---|---|---|---|---|---|---|"]
    table += [f"| {r['step']} | {r['tokens_seen']} | {r['bytes'] / mib:.2f} | {r['full_bytes'] / mib:.1f} | "
              f"{r['full16_bytes'] / mib:.1f} | {r['max_entries']} | {r['elapsed_s']:.0f} |"
              for r in trace[:: max(1, len(trace) // 16)] + trace[-1:]]
    table += ["", "Last generated tokens: " + json.dumps(row["text_tail"])]
    _write([row], args, t0, "A long generation in bounded memory (decoding-time eviction)", table)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    part = argv[0] if argv and not argv[0].startswith("-") else None
    parts = dict(eval=part_eval, perhead=part_perhead, decode=part_decode, stream=part_stream, generate=part_generate)
    if part not in parts:
        raise SystemExit(f"usage: evict.py {{{'|'.join(parts)}}} [options]")
    ap = arguments(__doc__, f"evict_{part}", threads=2)
    ap.add_argument("--suffix", default="", help="appended to the output name (one file per invocation)")
    if part == "eval":
        ap.add_argument("--tasks", nargs="+", default=["passkey", "multikey"])
        ap.add_argument("--length", type=int, default=2048)
        ap.add_argument("--n", type=int, default=6)
        ap.add_argument("--methods", nargs="+", default=EVICTION)
    elif part == "perhead":
        ap.add_argument("--length", type=int, default=2048)
        ap.add_argument("--n", type=int, default=4)
        ap.add_argument("--methods", nargs="+", default=["snapkv", "tova", "expected_attention"])
    elif part == "decode":
        ap.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192])
        ap.add_argument("--budget", type=float, default=0.25)
        ap.add_argument("--steps", type=int, default=16)
        ap.add_argument("--methods", nargs="+", default=["streaming_llm", "snapkv", "h2o", "restkv", "snapkv:adaptive"])
    elif part == "stream":
        ap.add_argument("--context", type=int, default=512)
        ap.add_argument("--tokens", type=int, default=2048)
        ap.add_argument("--chunk", type=int, default=16)
        ap.add_argument("--max-tokens", type=int, default=512)
        ap.add_argument("--every", type=int, default=64)
        ap.add_argument("--methods", nargs="+", default=["streaming_llm", "snapkv", "h2o", "tova", "restkv",
                                                         "snapkv:adaptive"])
    else:
        ap.add_argument("--context", type=int, default=1024)
        ap.add_argument("--tokens", type=int, default=4096)
        ap.add_argument("--max-tokens", type=int, default=1024)
        ap.add_argument("--every", type=int, default=64)
        ap.add_argument("--record", type=int, default=64)
        ap.add_argument("--method", default="snapkv")
    args = ap.parse_args(argv[1:])
    if args.suffix:
        args.out = str(RESULTS / f"evict_{part}_{args.suffix}")
    parts[part](args)


if __name__ == "__main__":
    main()
