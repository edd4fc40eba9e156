"""Quantization family on the bundled model, in parts that each fit a short locked run (--part).

  retrieval: passkey and multikey at 2k tokens, TurboQuant 3.5 / 2.5 bits (defaults: keys +0.5 bit, 4 exact
             sinks, keys +-1 bit by layer entropy; without the shift, and without all three, as ablations;
             with key_basis="pca", with pca plus outliers=0.01, with center=True, with rotation="hadamard",
             with unbiased="values", with unbiased="both" at 2.5 bits, with pca keys and unbiased values at 2.5
             bits, with pca keys coded before RoPE, unbiased values and no skew (keys and values at the same
             width: "pre_rope"), and with qjl=True) and KIVI 4 / 2 bits
             beside full
             (--groups picks rows, by default the main table's: the defaults and the two ablations; the others, each
             written to its own --out, by name; "rotation" is the two TurboQuant defaults alone, for larger --n;
             "sides" is a diagnosis: the 2.5-bit defaults with the values, then the keys, kept exact, to tell how
             much of the loss each side's codes cause; "compose_shift" runs compositions at their own budgets,
             each with and without TurboQuant's key shift, which a composition leaves off unless asked for)
             (--tasks picks one; the quantizers' bit widths are fixed, so their budget is 1 and the bytes
             they hold are reported as the ratio);
  lm:        language-model KL(full || compressed) of the same quantizers, and at budget 0.0625
             summary+turboquant vs summary vs turboquant (TurboQuant alone cannot go below 1 bit plus
             its fp16 norms, ~0.083 at head dim 64: its 1-bit row is the closest it gets);
  decode:    decode-step time over the quantized cache vs the full cache, both TurboQuant attention paths
             at 4 / 3.5 / 2.5 / 2 bits (and pca keys at 3.5 / 2.5) and KIVI 4 / 2 bits, as ratios measured
             in one run, interleaved;
  margins:   a diagnosis of the retrieval misses: each example's teacher-forced answer margin (the right token's
             logit less the best other's, at the answer's worst token) under the 2.5-bit defaults, each side's
             codes alone, the unbiased reads and 3.5 bits, beside the full cache's on the same examples, and the
             examples each config flips, split by how near the full cache itself was to flipping them.
Decoded tokens are quantized by the methods' streams (kvsum.compress attaches them) in every part (margins feeds
question and answer in one pass, so they stay exact).
Writes benchmarks/results/quant_<part>.{json,md}.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from common import RESULTS, arguments, finish, paired_decode, paired_medians, start
from rich.progress import track

import kvsum
from kvsum.eval import run, text
from kvsum.eval.metrics import answer_margin
from kvsum.eval.report import knobs_text, meta
from kvsum.eval.runner import forced_logits
from kvsum.eval.tasks import get_task
from kvsum.methods.base import make_method, register
from kvsum.methods.quant.turboquant import PATHS, TurboQuant
from kvsum.state import tensor_bytes


def tq(**knobs) -> list:
    """TurboQuant rows at 3.5 and 2.5 bits with `knobs` (budget 1: the bit width sets the bytes)."""
    return [("turboquant", {"bits": b, **knobs}, [1.0]) for b in (3.5, 2.5)]


QUANT = [*tq(), ("kivi", {"bits": 4}, [1.0]), ("kivi", {"bits": 2}, [1.0])]
NOSHIFT = tq(key_shift=0)  # ablation: same key bits per layer
PLAIN = tq(skew=0, sinks=0, key_shift=0)  # ablation: the layout alone (no key/value skew, exact sinks or key shift)
# keys as query-weighted transform codes in the bytes random-rotation keys and their norms take
PCA = tq(key_basis="pca")
# pca keys, plus the 1% of each head's tokens its codes serve worst kept exact, in the same bytes
OUTLIERS = tq(key_basis="pca", outliers=0.01)
CENTER = tq(center=True)  # the defaults with each head's keys coded less their prompt mean (its logit exact)
HADAMARD = tq(rotation="hadamard")  # each layer's rotation held as d seeded signs around a Hadamard matrix
UNBIASED = tq(unbiased="values")  # values read with |v| / <y, y_hat>: no shrink for attention averages to keep
UNBIASED_BOTH = [("turboquant", {"bits": 2.5, "unbiased": "both"}, [1.0])]  # keys too: logits unshrunk, noisier
# pca keys (passkey's best at 2.5 bits) with unbiased values (multikey's best that keeps KL down)
PCA_UNBIASED = [("turboquant", {"bits": 2.5, "key_basis": "pca", "unbiased": "values"}, [1.0])]
# pca keys coded before RoPE, where a head's keys keep the correlations RoPE smears out; with keys that cheap,
# values get the same width (skew=0: 2.5-bit values = 3-bit codes on half the channels, 2-bit on the rest)
PRE_ROPE = tq(key_basis="pca", pre_rope=True, unbiased="values", skew=0)
QJL = tq(qjl=True)  # one of the keys' bits spent on the 1-bit QJL sketch of their residual (unbiased logits)
# KIVI as published beside KIVI with its first 4 tokens (the attention sinks) exact, as TurboQuant keeps them
KIVI_SINKS = [("kivi", {"bits": b, **knobs}, [1.0]) for b in (4, 2) for knobs in ({}, {"sinks": 4})]


class OneSide:
    """A TurboQuant state attended with one side replaced by the exact tensor (held beside the codes and
    counted): `coded` names the side whose codes are read."""

    def __init__(self, state, exact, coded: str):
        self.state, self.exact, self.coded = state, exact, coded

    def lengths(self):
        return self.state.lengths()

    def nbytes(self):
        return self.state.nbytes() + tensor_bytes(self.exact)

    def scores(self, q, scale):
        return self.state.scores(q, scale) if self.coded == "keys" else q @ self.exact[None].transpose(-1, -2) * scale

    def mix(self, p):
        return self.state.mix(p) if self.coded == "values" else p @ self.exact[None]


@register
@dataclass
class TurboQuantOneSide(TurboQuant):
    """Diagnosis only: TurboQuant with one side's codes read and the other side exact (decoded tokens stay in
    full precision)."""

    name = "turboquant_one_side"
    coded: str = "keys"

    def __post_init__(self):
        super().__post_init__()
        if self.coded not in ("keys", "values"):
            raise kvsum.KVSumError(f"coded must be 'keys' or 'values', got {self.coded!r}")

    def build(self, keys, values, bits, layer_idx, shift=0, queries=None, frame=None):
        state = super().build(keys, values, bits, layer_idx, shift, queries, frame)
        return OneSide(state, values if self.coded == "keys" else keys, self.coded)

    def stream(self, layer_idx, state):
        return None


TINY = 0.0625
# compositions with and without TurboQuant's key shift (off in a composition unless asked for), on equal bytes
COMPOSED = (("snapkv+turboquant", {}, 0.25), ("summary+turboquant", {"score": "sentence"}, 0.125),
            ("summary+turboquant", {}, TINY))
COMPOSE_SHIFT = [(name, {**knobs, **shift}, [budget]) for name, knobs, budget in COMPOSED
                 for shift in ({}, {"key_shift": 1})]
SIDES = [("turboquant", {"bits": 2.5}, [1.0])] + [
    ("turboquant_one_side", {"bits": 2.5, "coded": side}, [1.0]) for side in ("keys", "values")]
GROUPS = {"quant": QUANT, "rotation": QUANT[:2], "noshift": NOSHIFT, "plain": PLAIN, "pca": PCA, "outliers": OUTLIERS,
          "center": CENTER, "hadamard": HADAMARD, "qjl": QJL, "unbiased": UNBIASED,
          "unbiased_both": UNBIASED_BOTH, "pca_unbiased": PCA_UNBIASED, "pre_rope": PRE_ROPE, "sides": SIDES,
          "kivi": KIVI_SINKS, "compose_shift": COMPOSE_SHIFT}
MAIN = ("quant", "noshift", "plain")  # quant_retrieval.md and quant_lm.md; every other group is run by name
# --part margins: the 2.5-bit defaults, each side alone, the unbiased reads, and 3.5 bits
MARGINS = [*SIDES, *UNBIASED[1:], *UNBIASED_BOTH, QUANT[0]]
# --part decode: both attention paths at 4 / 3.5 / 2.5 / 2 bits, pca keys, kivi
DECODE = [*[("turboquant", {"bits": b, "path": p}, [1.0]) for b in (4, 3.5, 2.5, 2) for p in PATHS],
          *PCA, ("kivi", {"bits": 4}, [1.0]), ("kivi", {"bits": 2}, [1.0])]
COMPOSE = [("summary", {}, [TINY]), ("summary+turboquant", {}, [TINY]), ("turboquant", {"bits": 1}, [0.1])]


@torch.no_grad()
def decode(model, tok, args) -> None:
    """Every config decodes the same tokens; step t of every config runs back to back (order rotated), so
    the load of a shared machine hits them alike; the ratio is the median over steps of step time / full's."""
    ex = next(get_task("lm").examples(tok, args.length, 1, seed=11))
    ctx, tokens = ex.context_ids, ex.question_ids[:, :args.steps]
    pre = kvsum.prefill(model, ctx)
    configs = [("full", {}), *[(name, knobs) for name, knobs, _ in (args.rows or DECODE)]]
    times, ratio = [[] for _ in configs], {}
    for _ in range(args.repeats):
        caches = [kvsum.compress_prefill(pre, make_method(name, **knobs), 1.0) for name, knobs in configs]
        ratio = {i: c.nbytes() / c.reference_nbytes for i, c in enumerate(caches)}
        times = [a + b for a, b in zip(times, paired_decode(model, caches, tokens))]
    med, paired = paired_medians(times)
    keep = times[0]
    rows = [dict(method=name, knobs=knobs, length=args.length, ratio=ratio[i], decode_step_s=med[i],
                 decode_over_full=paired[i], steps=len(keep)) for i, (name, knobs) in enumerate(configs)]
    _write(args, rows, f"Decode step over the quantized cache, {args.length}-token context", [
        f"{rows[0]['steps']} one-token steps per method ({args.repeats} rounds), the methods' step t run back "
        "to back; decode / full is the median over steps of the paired ratio. Decoded tokens are quantized "
        "as they arrive; bytes ratio right after compression, over the full 16-bit cache (full: fp32 model).",
        "", "| method | knobs | bytes ratio | median decode step ms | decode / full |", "|---|---|---|---|---|",
        *[f"| {r['method']} | {r['knobs']} | {r['ratio']:.3f} | {r['decode_step_s'] * 1000:.1f} | "
          f"{r['decode_over_full']:.2f} |" for r in rows]])


def _write(args, rows: list[dict], title: str, body: list[str]) -> None:
    """`args.out`.json (meta and rows) and .md (title with date and threads, the command, `body`); prints the md."""
    out = Path(args.out)
    info = meta(args.model, " ".join(["python", *sys.argv]), threads=args.threads)
    out.with_suffix(".json").write_text(json.dumps({"meta": info, "rows": rows}, indent=1) + "\n")
    lines = [f"# {title} ({info['date']}, {args.threads} threads)", "", f"command: {info['command']}", "", *body]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


BINS = (("< 1", -math.inf, 1.0), ("1 to 2", 1.0, 2.0), (">= 2", 2.0, math.inf))  # the full cache's margin, logits


@torch.no_grad()
def margins(model, tok, args) -> None:
    """Teacher-forced answer margins (kvsum.eval.metrics.answer_margin) of each config beside the full cache's,
    on the same examples: how far the codes move each answer, and which examples they flip (by how near the
    full cache itself was to flipping them). Question and answer are one forward pass, so they stay exact."""
    configs = [("full", {}), *[(name, knobs) for name, knobs, _ in (args.rows or MARGINS)]]
    rows = []
    for task in args.tasks:
        per = [[] for _ in configs]
        t = get_task(task)
        for ex in track(t.examples(tok, args.length, args.n, args.seed), total=args.n, description=task):
            answer = torch.tensor(text.encode(tok, " " + ex.answer))
            q = ex.question_ids.shape[1]
            forced = replace(ex, question_ids=torch.cat([ex.question_ids, answer[None]], -1))
            pre = kvsum.prefill(model, ex.context_ids)
            for m, (name, knobs) in zip(per, configs):
                cache = kvsum.compress_prefill(pre, make_method(name, **knobs), 1.0)
                m.append(answer_margin(forced_logits(model, forced, cache)[q - 1:-1], answer))
        full = torch.tensor(per[0])
        for (name, knobs), m in zip(configs, per):
            m = torch.tensor(m)
            inside = [(lo <= full) & (full < hi) for _, lo, hi in BINS]  # the full cache's margin in each bin
            bins = [(int(s.sum()), int((s & (m < 0)).sum())) for s in inside]
            rows.append(dict(task=task, method=name, knobs=knobs, length=args.length, n=len(m),
                             negative=int((m < 0).sum()), flipped=int(((m < 0) & (full >= 0)).sum()),
                             rescued=int(((m >= 0) & (full < 0)).sum()), median=float(m.quantile(0.5)),
                             median_drop=float((full - m).quantile(0.5)), bins=bins, margins=m.tolist()))
    heads = " | ".join(f"negative, full margin {label}" for label, _, _ in BINS)
    _write(args, rows, f"Teacher-forced answer margins, {args.length}-token context", [
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
    ap = arguments(__doc__, "quant", threads=1)
    ap.add_argument("--part", choices=["retrieval", "lm", "decode", "margins"], required=True)
    ap.add_argument("--tasks", nargs="+", default=["passkey", "multikey"])
    ap.add_argument("--length", type=int, default=2048, help="retrieval context / decode context length")
    ap.add_argument("--lm-length", type=int, default=1536, help="prefix length for lm fidelity")
    ap.add_argument("--n", type=int, default=20, help="examples per task")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--compose-bits", type=float, nargs="*", default=None,
                    help="lm: summary+turboquant at these bit widths (default: its default width)")
    ap.add_argument("--no-quant", action="store_true", help="lm: only the budget-0.0625 comparison")
    ap.add_argument("--groups", nargs="+", choices=list(GROUPS), default=None,
                    help="which quantizer rows run beside full (retrieval / lm default: the main table's "
                         f"{', '.join(MAIN)}; decode / margins default: their own rows, which given groups replace, "
                         "the 2.5-bit defaults kept as a reference; each other group writes its own table)")
    ap.add_argument("--steps", type=int, default=40, help="decode: tokens decoded per round")
    ap.add_argument("--repeats", type=int, default=3, help="decode: interleaved rounds")
    args = ap.parse_args(argv)
    if args.out == str(RESULTS / "quant"):
        args.out = str(RESULTS / f"quant_{args.part}")
    model, tok, t0 = start(args)
    quant = [row for g in args.groups or MAIN for row in GROUPS[g]]
    args.rows = args.groups and [QUANT[1], *[r for r in quant if r != QUANT[1]]]  # decode / margins
    if args.part in ("decode", "margins"):
        return (decode if args.part == "decode" else margins)(model, tok, args)
    if args.part == "retrieval":
        rows = run(model, tok, args.tasks, ["full", *quant], [1.0], [args.length], args.n, args.seed)
    else:
        compose = COMPOSE if args.compose_bits is None else COMPOSE[:1] + [
            ("summary+turboquant", {"bits": b}, [TINY]) for b in args.compose_bits] + COMPOSE[2:]
        rows = run(model, tok, "lm", ["full", *([] if args.no_quant else quant), *compose], [1.0],
                   [args.lm_length], args.n, args.seed)
    finish(rows, args, t0)


if __name__ == "__main__":
    main()
