"""The flagship on the bundled model: `summary` and `hae` against every eviction method on equal bytes.

Passkey and multi-key retrieval at 2k and 4k tokens and language-model fidelity on a 1.5k prefix,
query-agnostic. Budgets 0.5, 0.25, 0.125, 0.0625 for summary and hae; the eviction methods at 0.5,
0.25 and 0.125; the summary ablations (entropy allocation on, no refit, no low-rank tier, anchors
only) at 0.25 and 0.125. Writes benchmarks/results/summary.{json,md}.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

import kvsum
from kvsum.eval import run, write

EVICTION = ["streaming_llm", "random", "snapkv", "h2o", "tova", "knorm", "expected_attention", "restkv"]
ABLATIONS = [dict(entropy_allocation=True), dict(refit=False), dict(lowrank_share=0.0, anchor_share=0.9),
             dict(anchor_share=1.0, lowrank_share=0.0)]


def configs(budgets_main, budgets_evict, budgets_ablation):
    """(method, knobs, budgets) triples; run() takes one budget list, so configs are grouped by budgets."""
    return [(["full", "summary", "hae"], budgets_main),
            (EVICTION, budgets_evict),
            ([("summary", a) for a in ABLATIONS], budgets_ablation)]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096])
    ap.add_argument("--n", type=int, nargs="+", default=[8, 5], help="examples per task, one per length")
    ap.add_argument("--n-lm", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "summary"))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tok = kvsum.load_model(args.model)
    t0 = time.perf_counter()
    rows = []
    groups = configs([0.5, 0.25, 0.125, 0.0625], [0.5, 0.25, 0.125], [0.25, 0.125])
    methods = [m for ms, _ in groups for m in ms]
    budgets = sorted({b for _, bs in groups for b in bs}, reverse=True)
    wanted = {(m if isinstance(m, str) else (m[0], tuple(sorted(m[1].items())))): set(bs) for ms, bs in groups
              for m in ms}

    def keep(r):
        key = r["method"] if not r["knobs"] else (r["method"], tuple(sorted(r["knobs"].items())))
        return r["method"] == "full" or r["budget"] in wanted.get(key, ())

    # one prefill per example serves every configuration; rows outside a config's budgets are dropped
    for length, n in zip(args.lengths, args.n):
        rows += [r for r in run(model, tok, ["passkey", "multikey"], methods, budgets, [length], n) if keep(r)]
    rows += [r for r in run(model, tok, "lm", methods, budgets, [1536], args.n_lm) if keep(r)]
    js, md = write(rows, args.out, model=args.model, command=" ".join(["python", *sys.argv]),
                   threads=args.threads, wall_s=round(time.perf_counter() - t0, 1))
    print(md.read_text())
    print(f"wrote {js} and {md}")


if __name__ == "__main__":
    main()
