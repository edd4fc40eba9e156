"""Performance of kvsum on this machine: where compression pays, what it costs, how it scales.

Parts (each one locked run of a few minutes; ratios always come from one run):
  short     tokens/s over 64..512-token prompts + 64 generated tokens: the full cache (plain transformers
            generate), kvsum.generate with the default Policy, and each method always on.
  overhead  (prefill + compression) / plain prefill per method and length; the scaling fit (exponent of
            compression time against context length, log-log least squares) over all lengths measured,
            merged across runs (8k is its own run).
  decode    decode-step time against context length (budget 0.25) and against the budget (at --budget-lengths),
            per method, over the full cache's; all caches of one length stepped round-robin, medians.
  memory    cache.nbytes() and the process's peak resident memory during compression, per method, at one
            length (VmHWM, reset before each compression; large buffers are mmapped so freed memory leaves RSS).

Results: benchmarks/results/perf/perf_<part>.{json,md} (--out); decode and memory are benchmarks/perf_decode.py;
the committed runs are named in benchmarks/experiments/other.py.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

import kvsum
from kvsum.breakeven import prose_ids
from kvsum.errors import KVSumError
from kvsum.methods import make_method

from .experiments import RESULTS
from .perf_decode import part_decode, part_memory
from .perf_merge import needs, timed, write_merged

METHODS = ["turboquant", "kivi", "summary", "summary+turboquant", "streaming_llm", "snapkv"]


# ---------------------------------------------------------------- short-context throughput
@torch.no_grad()
def part_short(model, tok, args) -> None:
    question = "\n\nIn short,"
    q = tok(question, return_tensors="pt", add_special_tokens=False).input_ids
    gen = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False,
               pad_token_id=tok.eos_token_id)
    policy = kvsum.Policy()
    rows = []
    for L in args.lengths:
        ctx = prose_ids(tok, L)
        ids = torch.cat([ctx, q], -1)
        model.generate(ids, max_new_tokens=2, pad_token_id=tok.eos_token_id)  # warm-up at this length
        full, pol = [], []
        run_full = functools.partial(model.generate, ids, **gen)
        run_pol = functools.partial(kvsum.generate, model, tok, ctx, question, policy=policy,
                                    max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens)
        for i in range(args.repeat):  # interleaved, order alternating: a noisy neighbour hits both alike
            for fn, out in ((run_full, full), (run_pol, pol))[:: 1 if i % 2 == 0 else -1]:
                out.append(timed(fn)[1])
        t_full, t_pol = min(full), min(pol)  # best of N: noise only ever adds time
        choice = policy.choose(L, model).method
        rows.append(dict(length=L, config="full", tokens_per_s=args.new_tokens / t_full, over_full=1.0))
        rows.append(dict(length=L, config=f"policy ({choice})", tokens_per_s=args.new_tokens / t_pol,
                         over_full=t_full / t_pol))
        for name in args.methods:
            try:
                def run(name=name, ctx=ctx, ids=ids):
                    cache = kvsum.compress(model, ctx, method=name, budget=args.budget)
                    return model.generate(ids, past_key_values=cache, **gen)
                _, t = timed(run)
                rows.append(dict(length=L, config=name, tokens_per_s=args.new_tokens / t, over_full=t_full / t))
            except KVSumError as e:
                rows.append(dict(length=L, config=name, tokens_per_s=None, over_full=None, refused=str(e)))
        print(rows[-len(args.methods) - 2:], flush=True)

    def lines(rows):
        Ls = sorted({r["length"] for r in rows})
        configs = list(dict.fromkeys(r["config"].split(" (")[0] for r in rows))
        by = {(r["length"], r["config"].split(" (")[0]): r for r in rows}
        out = [f"Tokens per second (prefill + compression + {args.new_tokens} generated tokens, one request), and "
               f"speed over the full cache (>1 faster); budget {args.budget} for the methods; full and policy "
               f"interleaved in alternating order, best of {args.repeat}.", "",
               "| config | " + " | ".join(f"{L} tok/s | x full" for L in Ls) + " |",
               "|---|" + "---|---|" * len(Ls)]
        for c in configs:
            cells = []
            for L in Ls:
                r = by.get((L, c))
                cells.append("refused | " if r is None or r["tokens_per_s"] is None else
                             f"{r['tokens_per_s']:.2f} | {r['over_full']:.3f}")
            out.append(f"| {c} | " + " | ".join(cells) + " |")
        picks = {r["length"]: r["config"] for r in rows if r["config"].startswith("policy")}
        out += ["", "Policy picks: " + ", ".join(f"{L}: {picks[L]}" for L in Ls if L in picks)]
        return out

    write_merged("short", rows, lines, args, merge_key=lambda r: r["length"])


# ---------------------------------------------------------------- overhead and scaling
@torch.no_grad()
def part_overhead(model, tok, args, render: dict | None = None) -> None:
    rows = []
    if render is None:
        from transformers import DynamicCache

        decoder = model.get_decoder()
        ids = prose_ids(tok, max(args.lengths))
        kvsum.prefill(model, ids[:, :128])
        for L in args.lengths:
            ctx = ids[:, :L]
            _, plain = timed(lambda ctx=ctx: decoder(ctx, past_key_values=DynamicCache(), use_cache=True))
            pres = {}
            for name in args.methods:
                opts = needs(name)
                key = tuple(sorted(opts))
                if key not in pres:
                    pres[key] = timed(lambda ctx=ctx, opts=opts: kvsum.prefill(model, ctx, tokenizer=tok, **opts))
                pre, t_pre = pres[key]
                try:
                    _, t_c = timed(lambda pre=pre, name=name: kvsum.compress_prefill(pre, make_method(name),
                                                                                      args.budget))
                except KVSumError as e:
                    rows.append(dict(length=L, method=name, refused=str(e)))
                    continue
                rows.append(dict(length=L, method=name, budget=args.budget, prefill_s=plain, kvsum_prefill_s=t_pre,
                                 compress_s=t_c, overhead=(t_pre + t_c) / plain))
                print(rows[-1], flush=True)
            del pres

    def lines(rows):
        ok = [r for r in rows if "overhead" in r]
        Ls = sorted({r["length"] for r in rows})
        methods = list(dict.fromkeys(r["method"] for r in rows))
        by = {(r["length"], r["method"]): r for r in rows}
        out = ["(kvsum prefill with the method's extras + compression) / plain prefill, budget "
               f"{args.budget}; compression seconds in brackets. Lengths measured in separate runs are merged "
               "(ratios within a length come from one run).", "",
               "| method | " + " | ".join(str(L) for L in Ls) + " | exponent of compress time |",
               "|---|" + "---|" * (len(Ls) + 1)]
        for m in methods:
            cells = []
            for L in Ls:
                r = by.get((L, m))
                cells.append("" if r is None else "refused" if "refused" in r else
                             f"{r['overhead']:.3f} ({r['compress_s']:.2f} s)")
            pts = [(r["length"], r["compress_s"]) for r in ok if r["method"] == m]
            fit = f"{np.polyfit(np.log([p[0] for p in pts]), np.log([p[1] for p in pts]), 1)[0]:.2f}" \
                if len(pts) >= 3 else "-"
            out.append(f"| {m} | " + " | ".join(cells) + f" | {fit} |")
        plain = {r["length"]: r["prefill_s"] for r in ok}
        pts = sorted(plain.items())
        if len(pts) >= 3:
            e = np.polyfit(np.log([p[0] for p in pts]), np.log([p[1] for p in pts]), 1)[0]
            out += ["", "Plain prefill seconds: " + ", ".join(f"{L}: {s:.2f}" for L, s in pts) +
                    f" (exponent {e:.2f})"]
        out += ["", "Exponent: slope of log(compression seconds) on log(context length), least squares over the "
                "lengths measured (1 = linear)."]
        return out

    write_merged("overhead", rows, lines, args, merge_key=lambda r: (r["length"], r["method"]), record=render is None)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("part", choices=["short", "overhead", "decode", "memory"])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None, help="output stem (default benchmarks/results/perf/perf_<part>)")
    ap.add_argument("--methods", nargs="+", default=METHODS)
    ap.add_argument("--lengths", type=int, nargs="+", default=None)
    ap.add_argument("--budget", type=float, default=0.25)
    ap.add_argument("--budgets", type=float, nargs="+", default=[0.5, 0.25, 0.125, 0.0625])
    ap.add_argument("--budget-lengths", type=int, nargs="+", default=[4096, 8192])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--render", action="store_true", help="only rewrite the markdown from the JSON (overhead, decode)")
    args = ap.parse_args(argv)
    args.out = args.out or str(RESULTS / "perf" / f"perf_{args.part}")
    default_lengths = dict(short=[64, 128, 256, 512], overhead=[1024, 2048, 4096], decode=[1024, 2048, 4096],
                           memory=[8192])
    args.lengths = args.lengths or default_lengths[args.part]
    if args.render:  # rewrite the markdown of merged results from their JSON (no measurement)
        js = Path(args.out + ".json")
        data = json.loads(js.read_text())
        renderers = dict(overhead=part_overhead, decode=part_decode)
        renderers[args.part](None, None, args, render=data)
        return
    if args.part == "memory" and "MALLOC_MMAP_THRESHOLD_" not in os.environ:
        os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # glibc reads it at start: re-exec with it set
        os.execv(sys.executable, sys.orig_argv)
    torch.set_num_threads(args.threads)
    model, tok = kvsum.load_model(args.model)
    t0 = time.perf_counter()
    dict(short=part_short, overhead=part_overhead, decode=part_decode, memory=part_memory)[args.part](model, tok, args)
    print(f"{args.part}: {time.perf_counter() - t0:.0f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
