"""Quantization family on the bundled model, in parts that each fit a short locked run (--part).

  retrieval: passkey and multikey (--tasks) at 2k tokens, the --methods rows beside full (the quantizers' bit
             widths are fixed, so their budget is 1 and the bytes they hold are reported as the ratio; a spec may
             carry its own budgets after "@", as compositions do);
  lm:        language-model KL(full || compressed) of the --methods rows on a 1.5k prefix;
  decode:    decode-step time over each quantized cache vs the full cache, as ratios measured in one run,
             interleaved;
  margins:   a diagnosis of the retrieval misses: each example's teacher-forced answer margin (the right token's
             logit less the best other's, at the answer's worst token) under each config, beside the full cache's
             on the same examples, and the examples each config flips, split by how near the full cache itself was
             to flipping them.
The rows of each committed table are named in benchmarks/experiments/quant.py (`python -m benchmarks list`).
Decoded tokens are quantized by the methods' streams (kvsum.compress attaches them) in every part (margins feeds
question and answer in one pass, so they stay exact). Diagnosis variants (turboquant_one_side) come from
benchmarks/diagnose.py.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import torch
from rich.progress import track

import kvsum
from kvsum.eval import run, text
from kvsum.eval.metrics import answer_margin
from kvsum.eval.report import knobs_text
from kvsum.eval.runner import forced_logits
from kvsum.eval.tasks import get_task

from .common import arguments, finish, info_line, method_rows, paired_decode, paired_medians, run_info, start
from .diagnose import DIAGNOSES, build


@torch.no_grad()
def decode(model, tok, args) -> None:
    """Every config decodes the same tokens; step t of every config runs back to back (order rotated), so
    the load of a shared machine hits them alike; the ratio is the median over steps of step time / full's."""
    length = args.lengths[0]
    ex = next(get_task("lm").examples(tok, length, 1, seed=11))
    ctx, tokens = ex.context_ids, ex.question_ids[:, :args.steps]
    pre = kvsum.prefill(model, ctx)
    configs = [(name, knobs) for name, knobs, _ in args.rows]
    times, ratio = [[] for _ in configs], {}
    for _ in range(args.repeats):
        caches = [kvsum.compress_prefill(pre, build(name, **knobs), 1.0) for name, knobs in configs]
        ratio = {i: c.nbytes() / c.reference_nbytes for i, c in enumerate(caches)}
        times = [a + b for a, b in zip(times, paired_decode(model, caches, tokens))]
    med, paired = paired_medians(times)
    keep = times[0]
    rows = [dict(method=name, knobs=knobs, length=length, ratio=ratio[i], decode_step_s=med[i],
                 decode_over_full=paired[i], steps=len(keep)) for i, (name, knobs) in enumerate(configs)]
    _write(args, rows, f"Decode step over the quantized cache, {length}-token context", [
        f"{rows[0]['steps']} one-token steps per method ({args.repeats} rounds), the methods' step t run back "
        "to back; decode / full is the median over steps of the paired ratio. Decoded tokens are quantized "
        "as they arrive; bytes ratio right after compression, over the full 16-bit cache (full: fp32 model).",
        "", "| method | knobs | bytes ratio | median decode step ms | decode / full |", "|---|---|---|---|---|",
        *[f"| {r['method']} | {r['knobs']} | {r['ratio']:.3f} | {r['decode_step_s'] * 1000:.1f} | "
          f"{r['decode_over_full']:.2f} |" for r in rows]])


def _write(args, rows: list[dict], title: str, body: list[str]) -> None:
    """`args.out`.json (meta and rows) and .md (title with date and threads, the run's meta, `body`); prints the md."""
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    info = run_info(args.model, args.threads)
    out.with_name(out.name + ".json").write_text(json.dumps({"meta": info, "rows": rows}, indent=1) + "\n")
    lines = [f"# {title} ({info['date']}, {args.threads} threads)", "", info_line(info), "", *body]
    out.with_name(out.name + ".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


BINS = (("< 1", -math.inf, 1.0), ("1 to 2", 1.0, 2.0), (">= 2", 2.0, math.inf))  # the full cache's margin, logits


@torch.no_grad()
def margins(model, tok, args) -> None:
    """Teacher-forced answer margins (kvsum.eval.metrics.answer_margin) of each config beside the full cache's,
    on the same examples: how far the codes move each answer, and which examples they flip (by how near the
    full cache itself was to flipping them). Question and answer are one forward pass, so they stay exact."""
    configs = [(name, knobs) for name, knobs, _ in args.rows]
    length, rows = args.lengths[0], []
    for task in args.tasks:
        per = [[] for _ in configs]
        t = get_task(task)
        for ex in track(t.examples(tok, length, args.n, args.seed), total=args.n, description=task):
            answer = torch.tensor(text.encode(tok, " " + ex.answer))
            q = ex.question_ids.shape[1]
            forced = replace(ex, question_ids=torch.cat([ex.question_ids, answer[None]], -1))
            pre = kvsum.prefill(model, ex.context_ids)
            for m, (name, knobs) in zip(per, configs):
                cache = kvsum.compress_prefill(pre, build(name, **knobs), 1.0)
                m.append(answer_margin(forced_logits(model, forced, cache)[q - 1:-1], answer))
        full = torch.tensor(per[0])
        for (name, knobs), m in zip(configs, per):
            m = torch.tensor(m)
            inside = [(lo <= full) & (full < hi) for _, lo, hi in BINS]  # the full cache's margin in each bin
            bins = [(int(s.sum()), int((s & (m < 0)).sum())) for s in inside]
            rows.append(dict(task=task, method=name, knobs=knobs, length=length, n=len(m),
                             negative=int((m < 0).sum()), flipped=int(((m < 0) & (full >= 0)).sum()),
                             rescued=int(((m >= 0) & (full < 0)).sum()), median=float(m.quantile(0.5)),
                             median_drop=float((full - m).quantile(0.5)), bins=bins, margins=m.tolist()))
    heads = " | ".join(f"negative, full margin {label}" for label, _, _ in BINS)
    _write(args, rows, f"Teacher-forced answer margins, {length}-token context", [
        "Margin: the smallest, over the answer's tokens, of the right token's logit less the best other's "
        "(negative: greedy decoding misses). flipped: negative where the full cache's is not; rescued: the reverse; "
        "drop: the full cache's margin less this one, median over examples. The last columns split the examples "
        "by the full cache's own margin: negative / examples in that range.", "",
        f"| task | method | knobs | n | negative | flipped | rescued | median margin | median drop | {heads} |",
        "|---|---|---|---|---|---|---|---|---|" + "---|" * len(BINS),
        *[f"| {r['task']} | {r['method']} | {knobs_text(r['knobs'])} | {r['n']} | {r['negative']} | {r['flipped']} | "
          f"{r['rescued']} | {r['median']:.2f} | {r['median_drop']:.2f} | "
          + " | ".join(f"{neg} / {k}" for k, neg in r["bins"]) + " |" for r in rows]])


def main(argv: list[str] | None = None) -> None:
    ap = arguments(__doc__, "quant/quant", threads=1)
    ap.add_argument("--part", choices=["retrieval", "lm", "decode", "margins"], required=True)
    ap.add_argument("--methods", nargs="+", required=True,
                    help="method specs name:knob=value,...[@budget,...] (budget 1 unless given); full first")
    ap.add_argument("--tasks", nargs="+", default=["passkey", "multikey"], help="retrieval / margins tasks")
    ap.add_argument("--lengths", type=int, nargs="+", default=None,
                    help="context lengths (default: 1536 for lm, 2048 otherwise; decode and margins use the first)")
    ap.add_argument("--n", type=int, default=20, help="examples per task")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=40, help="decode: tokens decoded per round")
    ap.add_argument("--repeats", type=int, default=3, help="decode: interleaved rounds")
    args = ap.parse_args(argv)
    args.lengths = args.lengths or [1536 if args.part == "lm" else 2048]
    args.rows = method_rows(args.methods, [1.0])
    if args.rows[0][0] != "full":  # every part measures against the full cache, the first row
        args.rows.insert(0, ("full", {}, [1.0]))
    if args.out.endswith("/quant"):
        args.out = f"{args.out}_{args.part}"
    model, tok, t0 = start(args)
    if args.part in ("decode", "margins"):
        return (decode if args.part == "decode" else margins)(model, tok, args)
    rows = [(build(name, **knobs), {}, budgets) if name in DIAGNOSES else (name, knobs, budgets)
            for name, knobs, budgets in args.rows]  # a diagnosis variant is given built: it is not registered
    rows = run(model, tok, ["lm"] if args.part == "lm" else args.tasks, rows, [1.0], args.lengths, args.n, args.seed)
    finish(rows, args, t0)


if __name__ == "__main__":
    main()
