"""Performance of kvsum, decode and memory parts (perf.py runs them: `python -m benchmarks.perf decode|memory`).

  decode    decode-step time against context length (budget 0.25) and against the budget (at --budget-lengths),
            per method, over the full cache's; all caches of one length stepped round-robin, medians.
  memory    cache.nbytes() and the process's peak resident memory during compression, per method, at one
            length (VmHWM, reset before each compression; large buffers are mmapped so freed memory leaves RSS).
"""

from __future__ import annotations

import torch

import kvsum
from kvsum.breakeven import prose_ids, step_times
from kvsum.errors import KVSumError
from kvsum.methods import make_method

from .memory import reset_peak, rss
from .perf_merge import needs, write_merged


# ---------------------------------------------------------------- decode step vs length and budget
@torch.no_grad()
def part_decode(model, tok, args, render: dict | None = None) -> None:
    rows = []
    if render is None:
        ids = prose_ids(tok, max(args.lengths))
        token = ids[:, :1]
        opts = {}
        for name in args.methods:
            opts.update(needs(name))
        for L in args.lengths:
            pre = kvsum.prefill(model, ids[:, :L], tokenizer=tok, **opts)
            budgets = args.budgets if L in args.budget_lengths else [args.budget]
            caches = {("full", 1.0): kvsum.compress_prefill(pre, make_method("full"), 1.0)}
            nbytes = {}
            for name in args.methods:
                for b in budgets:
                    try:
                        c = kvsum.compress_prefill(pre, make_method(name), b)
                    except KVSumError:
                        continue
                    caches[(name, b)] = c
                    nbytes[(name, b)] = c.nbytes() / c.reference_nbytes
            del pre
            steps = step_times(model, caches, token, args.rounds)
            full = steps[("full", 1.0)]
            for (name, b), s in steps.items():
                rows.append(dict(length=L, method=name, budget=b, step_ms=s * 1000, over_full=s / full,
                                 ratio=nbytes.get((name, b), 1.0)))
            print([r for r in rows if r["length"] == L], flush=True)
            del caches

    def lines(rows):
        Ls = sorted({r["length"] for r in rows})
        out = [f"Median decode-step time (one token, {args.rounds} rounds, all caches of a length stepped "
               "round-robin) over the full cache's at the same length.", "", f"## Against context length "
               f"(budget {args.budget})", "", "| method | " + " | ".join(str(L) for L in Ls) + " |",
               "|---|" + "---|" * len(Ls)]
        by = {(r["length"], r["method"], r["budget"]): r for r in rows}
        fl = " | ".join(f"{by[(L, 'full', 1.0)]['step_ms']:.1f} ms" for L in Ls)
        out.append(f"| full | {fl} |")
        for m in args.methods:
            cells = [f"{by[(L, m, args.budget)]['over_full']:.3f}" if (L, m, args.budget) in by else "refused"
                     for L in Ls]
            out.append(f"| {m} | " + " | ".join(cells) + " |")
        for L in Ls:
            budgets = sorted({r["budget"] for r in rows if r["length"] == L and r["method"] != "full"}, reverse=True)
            if len(budgets) < 2:
                continue
            out += ["", f"## Against the budget at {L} tokens (step / full step; bytes ratio in brackets)", "",
                    "| method | " + " | ".join(str(b) for b in budgets) + " |",
                    "|---|" + "---|" * len(budgets)]
            for m in args.methods:
                cells = [f"{by[(L, m, b)]['over_full']:.3f} ({by[(L, m, b)]['ratio']:.3f})" if (L, m, b) in by
                         else "refused" for b in budgets]
                out.append(f"| {m} | " + " | ".join(cells) + " |")
        return out

    write_merged("decode", rows, lines, args, merge_key=lambda r: (r["length"], r["method"], r["budget"]),
           record=render is None)


# ---------------------------------------------------------------- memory


@torch.no_grad()
def part_memory(model, tok, args) -> None:
    L = args.lengths[0]
    ids = prose_ids(tok, L)
    opts = {}
    for name in args.methods:
        opts.update(needs(name))
    reset_peak()
    before, _ = rss()
    pre = kvsum.prefill(model, ids, tokenizer=tok, **opts)
    after, peak = rss()
    full_bytes = pre.cache.nbytes()
    rows = [dict(method="(prefill)", length=L, cache_bytes=full_bytes, held_before=before, peak_extra=peak - before,
                 over_full=(peak - before) / full_bytes)]
    for name in args.methods:
        reset_peak()
        base, _ = rss()
        try:
            cache = kvsum.compress_prefill(pre, make_method(name), args.budget)
        except KVSumError as e:
            rows.append(dict(method=name, length=L, refused=str(e)))
            continue
        _, peak = rss()
        extra = peak - base  # over what was held before compressing (the model + the full cache)
        rows.append(dict(method=name, length=L, budget=args.budget, cache_bytes=cache.nbytes(),
                         ratio=cache.nbytes() / cache.reference_nbytes, peak_extra=extra,
                         over_full=extra / full_bytes))
        print(rows[-1], flush=True)
        del cache

    def lines(rows):
        p = rows[0]
        out = [f"At {L} tokens, budget {args.budget}. The full cache the prefill holds (model dtype): "
               f"{p['cache_bytes'] / 2**20:.1f} MiB; the prefill itself peaked {p['peak_extra'] / 2**20:.1f} MiB "
               "above what was resident before it (cache, activations, attention masks).", "",
               "Peak extra: the process's peak resident memory during compress_prefill minus what was resident "
               "just before (model + full cache); over full: that peak over the full cache's bytes "
               "(the compressed cache itself is part of the peak).", "",
               "| method | cache.nbytes() MiB | bytes ratio | peak extra MiB | peak extra / full cache |",
               "|---|---|---|---|---|"]
        for r in rows[1:]:
            if "refused" in r:
                out.append(f"| {r['method']} | refused | | | |")
                continue
            out.append(f"| {r['method']} | {r['cache_bytes'] / 2**20:.2f} | {r['ratio']:.3f} | "
                       f"{r['peak_extra'] / 2**20:.1f} | {r['over_full']:.3f} |")
        return out

    write_merged("memory", rows, lines, args)
