"""Long prompts in bounded memory: peak resident memory and compression time on Qwen2.5-Coder-0.5B, 2k-32k tokens.

Every length runs in a fresh process (glibc told to mmap large buffers, so that freed memory leaves RSS): it loads
the model, runs kvsum.prefill (prompts over kvsum.prefill.WHOLE tokens in chunks of CHUNK) and compresses the
prefill with each method at one budget, reading the process's peak resident memory (VmHWM, reset before each
step). The bound a step is held to is 1.2 x (resident after loading the model + the full cache's bytes + one
chunk's activations), the activations counted from the shapes a chunk's forward holds at once in one layer (see
`chunk_activations`). Compression time is compress_prefill's alone (the median of --repeat runs), beside the
plain prefill's, and its growth with length is fitted on log-log axes (the exponent; linear is 1).

Rows merge by (length, method) into --out.json, so lengths run in separate invocations (32k takes long) land in
one table. Committed runs: benchmarks/experiments/other.py (long_memory).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from .experiments import RESULTS
from .memory import reset_peak, rss

BOUND = 1.2
DEFAULT_METHODS = ("full", "snapkv", "turboquant", "summary")


def chunk_activations(model, step: int, T: int) -> int:
    """Bytes one chunk of `step` queries over `T` keys holds at once in one layer, fp32: the residual stream and
    its norm, q/k/v, keys and values repeated to every query head (transformers' sdpa with a mask), the additive
    mask, the MLP's gate/up/product and the attention output."""
    cfg = model.config
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    hq, h, D, inter = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.hidden_size, cfg.intermediate_size
    per_token = 4 * D + (hq + 2 * h) * d + hq * d + 3 * inter
    return 4 * (step * per_token + 2 * hq * T * d + step * T)


def one_length(args) -> dict:
    """This process's measurements at one length (printed as one JSON line by the child)."""
    import torch

    import kvsum
    from kvsum.eval.text import prose_ids
    from kvsum.methods import make_method, prefill_needs
    from kvsum.prefill import CHUNK, WHOLE

    torch.set_num_threads(args.threads)
    model, tok = kvsum.load_model(args.model)
    L = args.one
    ids = prose_ids(tok, L)
    assert ids.shape[1] == L
    kvsum.prefill(model, ids[:, :128])  # warm-up
    step = L if L <= WHOLE else CHUNK
    loaded, _ = rss()
    rows = []
    plain = [m for m in args.methods if not prefill_needs([make_method(m)])]
    for names in (plain, [m for m in args.methods if m not in plain]):  # the plain prefill, then one with extras
        if not names:
            continue
        opts = prefill_needs([make_method(m) for m in names])
        reset_peak()
        before, _ = rss()
        t0 = time.perf_counter()
        pre = kvsum.prefill(model, ids, tokenizer=tok, **opts)
        prefill_s = time.perf_counter() - t0
        _, prefill_peak = rss()
        full = pre.cache.nbytes()
        base = loaded + full + chunk_activations(model, step, L)  # the peak is held to BOUND x this
        for name in names:
            reset_peak()
            times = []
            for _ in range(args.repeat):  # the median of a few: a shared machine's load comes and goes
                cache = None
                t0 = time.perf_counter()
                cache = kvsum.compress_prefill(pre, make_method(name), args.budget)
                times.append(time.perf_counter() - t0)
            compress_s = statistics.median(times)
            _, peak = rss()
            rows.append(dict(length=L, method=name, budget=args.budget, chunk=step, prefill=",".join(opts) or "plain",
                             prefill_s=prefill_s, tokens_per_s=L / prefill_s, compress_s=compress_s,
                             compress_runs=times,
                             compress_over_prefill=compress_s / prefill_s, loaded_rss=loaded, rss_before=before,
                             full_cache_bytes=full, chunk_activation_bytes=chunk_activations(model, step, L),
                             base=base, prefill_peak=prefill_peak, compress_peak=peak,
                             peak_over_base=max(prefill_peak, peak) / base,
                             ratio=cache.nbytes() / cache.reference_nbytes))
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
            del cache
        del pre
    return dict(rows=rows)


def fit_exponent(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of log(time) against log(length)."""
    pts = [(math.log(x), math.log(y)) for x, y in points if y > 0]
    if len(pts) < 2:
        return None
    mx, my = sum(x for x, _ in pts) / len(pts), sum(y for _, y in pts) / len(pts)
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    return sum((x - mx) * (y - my) for x, y in pts) / sxx if sxx else None


def render(rows: list[dict], meta: dict) -> list[str]:
    mib = 2 ** 20
    methods = list(dict.fromkeys(r["method"] for r in rows))
    lengths = sorted({r["length"] for r in rows})
    out = [f"# long prompts in bounded memory ({meta['model']}, {meta['threads']} threads, budget "
           f"{rows[0]['budget'] if rows else ''})", "",
           "Each length in a fresh process. Peak: the process's VmHWM during the prefill and during compress_prefill "
           "(the larger counts); sum: resident after loading the model + the full cache + one chunk's activations "
           f"(from the shapes: benchmarks/long_memory.py chunk_activations); the bound is {BOUND} x the sum. "
           "Prompts over "
           "kvsum.prefill.WHOLE tokens run in chunks (the chunk column). Compression: compress_prefill alone; "
           "prefill: kvsum.prefill with what the method needs (summary: the surprisal too). Compress s: the median of "
           "the runs listed in the JSON (compress_runs).", "",
           "| length | method | chunk | prefill s | prefill tok/s | compress s | compress / prefill | loaded MiB | "
           "full cache MiB | chunk act. MiB | peak MiB | sum MiB | peak / sum | bytes ratio |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for L in lengths:
        for r in (r for r in rows if r["length"] == L):
            peak = max(r["prefill_peak"], r["compress_peak"])
            out.append(f"| {L} | {r['method']} | {r['chunk']} | {r['prefill_s']:.1f} | {r['tokens_per_s']:.0f} | "
                       f"{r['compress_s']:.3f}{'' if 'compress_runs' in r else ' (1 run)'} | "
                       f"{r['compress_over_prefill']:.4f} | {r['loaded_rss'] / mib:.0f} | "
                       f"{r['full_cache_bytes'] / mib:.0f} | {r['chunk_activation_bytes'] / mib:.0f} | "
                       f"{peak / mib:.0f} | {r['base'] / mib:.0f} | {r['peak_over_base']:.3f} | "
                       f"{r['ratio']:.3f} |")
    out += ["", "Exponent of time against length (least squares on log-log, over the lengths listed):", "",
            "| method | lengths | compress_prefill exponent | prefill exponent | within 1.2x bound at every length |",
            "|---|---|---|---|---|"]
    for m in methods:
        rs = sorted((r for r in rows if r["method"] == m), key=lambda r: r["length"])
        c, p = (fit_exponent([(r["length"], r[k]) for r in rs]) for k in ("compress_s", "prefill_s"))
        within = all(r["peak_over_base"] <= BOUND for r in rs)
        out.append(f"| {m} | {', '.join(str(r['length']) for r in rs)} | "
                   f"{'' if c is None else f'{c:.2f}'} | {'' if p is None else f'{p:.2f}'} | {within} |")
    out += ["", "Commands (rows merged by length and method): " + "; ".join(f"`{c}`" for c in meta["commands"])]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    ap.add_argument("--methods", nargs="+", default=list(DEFAULT_METHODS))
    ap.add_argument("--budget", type=float, default=0.25)
    ap.add_argument("--repeat", type=int, default=3, help="compressions per method (their median time counts)")
    ap.add_argument("--out", default=str(RESULTS / "long" / "long_memory"))
    ap.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)  # child: one length
    args = ap.parse_args(argv)
    if args.one is not None:
        print(json.dumps(one_length(args)))
        return 0
    from .common import command, commands_with, recorded_commands, run_info

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    js = out.with_name(out.name + ".json")
    prev = json.loads(js.read_text()) if js.exists() else {"meta": {}, "rows": []}
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": str(args.threads)}
    rows = []
    for L in args.lengths:
        child = [sys.executable, "-m", "benchmarks.long_memory", "--one", str(L), "--model", args.model,
                 "--threads", str(args.threads), "--budget", str(args.budget), "--repeat", str(args.repeat),
                 "--methods", *args.methods]
        t0 = time.perf_counter()
        done = subprocess.run(child, env=env, stdout=subprocess.PIPE, text=True, cwd=Path(__file__).parent.parent)
        if done.returncode:
            print(f"length {L}: the child failed ({done.returncode})", file=sys.stderr)
            return done.returncode
        rows += json.loads(done.stdout.strip().splitlines()[-1])["rows"]
        print(f"length {L}: {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    keys = {(r["length"], r["method"]) for r in rows}
    rows = sorted([r for r in prev["rows"] if (r["length"], r["method"]) not in keys] + rows,
                  key=lambda r: (r["length"], r["method"]))
    meta = run_info(args.model, args.threads)
    meta["commands"] = commands_with(recorded_commands(prev["meta"]), command())
    js.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    md = render(rows, meta)
    out.with_name(out.name + ".md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
