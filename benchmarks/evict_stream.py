"""Decoding-time eviction on the bundled model, in parts sized for a shared 2-core CPU (one locked run each).

    python -m benchmarks.evict_stream stream     # teacher-forced: KL against the full cache
    python -m benchmarks.evict_stream generate   # 1k context + 4096 generated tokens in bounded memory

Method specs: `name:knob=value,...` (`snapkv:allocation=adaptive`); the committed runs are named in
benchmarks/experiments/evict.py.
"""

from __future__ import annotations

import json
import math
import sys
import time

import torch

import kvsum
from kvsum.eval.metrics import fidelity
from kvsum.eval.tasks import get_task

from .common import arguments, parse_method, start, write_page


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
        name, knobs = parse_method(spec)
        alloc = knobs.get("allocation")
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
    write_page(rows, args, t0, f"Decoding-time eviction, teacher-forced: {args.context}-token context + {args.tokens} "
           f"tokens in chunks of {args.chunk}, max_tokens={args.max_tokens}, every={args.every}", table +
           ["", "KL(full || evicting) over the continuation's next-token distributions; the full cache holds the "
            "model's float32, the evicting caches float16 entries plus a float32 tail of at most `every` tokens."])


def part_generate(args) -> None:
    """A long greedy generation with decoding-time eviction: cache bytes and step time as it goes."""
    model, tok, t0 = start(args)
    ex = next(get_task("lm").examples(tok, args.context, 1, seed=7))
    ctx = ex.context_ids
    name, knobs = parse_method(args.methods[0])
    alloc = knobs.get("allocation")
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
    write_page([row], args, t0, "A long generation in bounded memory (decoding-time eviction)", table)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    part = argv[0] if argv and not argv[0].startswith("-") else None
    parts = dict(stream=part_stream, generate=part_generate)
    if part not in parts:
        raise SystemExit(f"usage: python -m benchmarks.evict_stream {{{'|'.join(parts)}}} [options]")
    ap = arguments(__doc__, f"evict/evict_{part}", threads=2)
    ap.add_argument("--every", type=int, default=64)
    if part == "stream":
        ap.add_argument("--context", type=int, default=512)
        ap.add_argument("--tokens", type=int, default=2048)
        ap.add_argument("--chunk", type=int, default=16)
        ap.add_argument("--max-tokens", type=int, default=512)
        ap.add_argument("--methods", nargs="+", default=["streaming_llm", "snapkv", "h2o", "tova", "restkv",
                                                         "snapkv:allocation=adaptive"])
    else:
        ap.add_argument("--context", type=int, default=1024)
        ap.add_argument("--tokens", type=int, default=4096)
        ap.add_argument("--max-tokens", type=int, default=1024)
        ap.add_argument("--record", type=int, default=64)
        ap.add_argument("--methods", nargs=1, default=["snapkv"], help="the one evicting method")
    parts[part](ap.parse_args(argv[1:]))


if __name__ == "__main__":
    main()
