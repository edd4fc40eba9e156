"""What compression costs on this machine, as ratios measured in one run.

For each method at one context length: compression time over plain prefill time (compress_prefill,
plus the extra prefill work the method asks for: the surprisal pass, the sentence ends, the re-read of
repeat=True; each method is warmed up once first, as a server computes its codebooks once; compression and
prefill each the best of two runs, so a neighbour's burst on this shared machine hits neither), and the decode-step time
with the compressed cache over the full cache, paired step by step (common.paired_decode). Writes
benchmarks/results/perf/cost.{json,md} (--out).

Beside that breakdown, what a user pays (`user_over_forward`): the wall time of `kvsum.compress(model, ids, ...)`
(its own prefill, query capture, surprisal pass and compression) minus that of a plain `model(ids)` forward of the
same prompt, over the plain forward; the two are run alternately --user-repeats times and the medians taken.
Measure it on a quiet machine or at one thread: with more threads than idle cores, the many small operations of a
compression wait on descheduled threads and its share grows several-fold.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

import kvsum
from kvsum.eval.tasks import get_task
from kvsum.methods import make_method, prefill_needs
from kvsum.prefill import sentence_ends, token_surprisal

from .common import info_line, paired_decode, paired_medians, parse_method, run_info
from .experiments import RESULTS


def _name(row: dict) -> str:
    """The method as written, and what it became where it chose its configuration by budget."""
    return row["method"] + (f" (became `{row['chosen']}`)" if row.get("chosen") else "")


def spec(text: str):
    """A method given as `name` or `name:knob=value,knob=value` (values as Python literals, else strings)."""
    name, knobs = parse_method(text)
    return make_method(name, **knobs)


def _timed(fn, repeat: int = 1):
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t)
    return out, best


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--budget", type=float, default=0.25)
    ap.add_argument("--methods", nargs="+", default=["summary", "hae", "streaming_llm", "snapkv", "restkv"],
                    help="names, or name:knob=value,... (e.g. summary:cover=turboquant(bits=3),score=surprisal)")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--user-repeats", type=int, default=2, help="alternate kvsum.compress / model(ids) runs")
    ap.add_argument("--out", default=str(RESULTS / "perf" / "cost"))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tok = kvsum.load_model(args.model)
    ex = next(get_task("lm").examples(tok, args.length, 1, seed=11))
    ctx, tokens = ex.context_ids, ex.question_ids[:, :args.steps]
    methods = {m: spec(m) for m in args.methods}
    extras = prefill_needs(methods.values())
    # long enough for every method to fit the budget
    warm = kvsum.prefill(model, ctx[:, :1024], tokenizer=tok, **extras)
    for m in methods.values():  # once per process: codebooks, tables (a server pays this at start-up)
        try:
            kvsum.compress_prefill(warm, m, args.budget)
        except kvsum.KVSumError:  # e.g. kivi's 128 full-precision tokens do not fit 1k tokens at 0.25
            pass
    _, plain = _timed(lambda: kvsum.prefill(model, ctx), repeat=2)
    pre = kvsum.prefill(model, ctx, tokenizer=tok, **extras)
    # the extra prefill work, timed by itself (a difference of two 10-s prefills is mostly noise): the
    # surprisal pass (its cost depends on shapes only), the sentence ends, and the re-read of repeat=True
    extra_s = {}
    if extras.get("surprisal"):
        hidden = torch.randn(1, ctx.shape[1], model.config.hidden_size)
        with torch.no_grad():
            extra_s["surprisal"] = _timed(lambda: token_surprisal(model, hidden, ctx), repeat=3)[1]
    if extras.get("sentences"):  # the tokenizer decodes each distinct token id once
        extra_s["sentences"] = _timed(lambda: sentence_ends(tok, ctx[0]), repeat=3)[1]
    if extras.get("retrieval"):  # the retrieval-head probe: once per model (run by the warm-up above), then read
        extra_s["retrieval"] = 0.0
    if extras.get("repeat"):
        extra_s["repeat"] = max(_timed(lambda: kvsum.prefill(model, ctx, repeat=True))[1] - plain, 0.0)
    rows, caches = [], [kvsum.compress_prefill(pre, make_method("full"), 1.0)]
    for name, m in methods.items():
        cache, t_compress = _timed(lambda m=m: kvsum.compress_prefill(pre, m, args.budget), repeat=2)
        # each piece of extra prefill work (surprisal, re-read) is charged to the methods that ask for it
        extra = sum(extra_s[k] for k in prefill_needs([m]))
        ratio = cache.nbytes() / cache.reference_nbytes  # right after compression, before decoding grows it
        caches.append(cache)
        made = getattr(cache, "decision", None)  # summary configured by budget: what it became
        rows.append(dict(method=name, chosen=made.spec if made else None, budget=args.budget, length=args.length,
                         ratio=ratio, compress_s=t_compress, capture_s=extra, prefill_s=plain,
                         compress_over_prefill=(t_compress + extra) / plain))
    forward = torch.no_grad()(lambda: model(ctx))  # as generate() runs it: no autograd graph
    forward()  # warm-up
    for r, text in zip(rows, methods):  # what a user pays, against a plain forward
        name, knobs = parse_method(text)
        user, plain_fw = [], []
        for _ in range(args.user_repeats):
            plain_fw.append(_timed(forward)[1])
            user.append(_timed(lambda n=name, k=knobs: kvsum.compress(model, ctx, method=n, budget=args.budget,
                                                                      tokenizer=tok, **k))[1])
        u, f = statistics.median(user), statistics.median(plain_fw)
        r.update(user_compress_s=u, forward_s=f, user_over_forward=(u - f) / f)
    step, over_full = paired_medians(paired_decode(model, caches, tokens))
    full_step = step[0]
    for r, s, o in zip(rows, step[1:], over_full[1:]):
        r.update(decode_step_s=s, full_decode_step_s=full_step, decode_over_full=o)
        print(r, flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    info = run_info(args.model, args.threads)
    out.with_name(out.name + ".json").write_text(json.dumps({"meta": info, "rows": rows}, indent=1) + "\n")
    lines = [f"# Cost at {args.length} tokens, budget {args.budget} ({info['date']}, {args.threads} threads)", "",
             f"Plain prefill (with query capture): {plain:.2f} s; extra prefill work the methods ask for: "
             f"{', '.join(f'{k} {v:.2f} s' for k, v in extra_s.items()) or 'none'}; "
             f"full-cache decode step: {full_step * 1000:.1f} ms (median of {tokens.shape[1] - 2} one-token steps; "
             "step t of every cache run back to back, decode / full the median of the paired ratios).", "",
             info_line(info), "",
             "| method | bytes ratio | compress s | capture s | (compress + capture) / prefill | kvsum.compress s | "
             "model(ids) s | user's cost: (compress - forward) / forward | decode step ms | decode / full |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {_name(r)} | {r['ratio']:.3f} | {r['compress_s']:.2f} | {r['capture_s']:.2f} | "
              f"{r['compress_over_prefill']:.3f} | {r['user_compress_s']:.2f} | {r['forward_s']:.2f} | "
              f"{r['user_over_forward']:.3f} | {r['decode_step_s'] * 1000:.1f} | {r['decode_over_full']:.3f} |"
              for r in rows]
    out.with_name(out.name + ".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
