"""The flagship on the bundled model: `summary` and `hae` against every eviction method on equal bytes.

Passkey and multi-key retrieval at 2k and 4k tokens and language-model fidelity on a 1.5k prefix,
query-agnostic. Budgets 0.5, 0.25, 0.125, 0.0625 for summary and hae; the eviction methods at 0.5,
0.25 and 0.125; the summary ablations (see ABLATIONS) at 0.25 and 0.125. Sized for a 2-core CPU
(about 40 minutes with the defaults); raise --n for tighter numbers. Writes benchmarks/results/summary.{json,md}.
"""

from __future__ import annotations

from common import arguments, finish, start

from kvsum.eval import run

EVICTION = ["streaming_llm", "random", "snapkv", "h2o", "tova", "knorm", "expected_attention", "restkv"]
ABLATIONS = [  # each switches one stage of the default summary (hybrid anchors, fitted summaries) on or off
    dict(entropy_allocation=True), dict(refit=False), dict(lowrank_share=0.2, anchor_share=0.6),
    dict(anchor_share=1.0), dict(score="surprisal"), dict(score="sharp_mass"),
]
MAIN_BUDGETS, EVICT_BUDGETS, ABLATION_BUDGETS = [0.5, 0.25, 0.125, 0.0625], [0.5, 0.25, 0.125], [0.25, 0.125]


def methods() -> list:
    """(name, knobs, budgets) for every configuration; one prefill per example serves them all."""
    return ([("full", {}, [1.0]), ("summary", {}, MAIN_BUDGETS), ("hae", {}, MAIN_BUDGETS)]
            + [(m, {}, EVICT_BUDGETS) for m in EVICTION] + [("summary", a, ABLATION_BUDGETS) for a in ABLATIONS])


def main(argv: list[str] | None = None) -> None:
    ap = arguments(__doc__, "summary", threads=2)
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096])
    ap.add_argument("--n", type=int, nargs="+", default=[6, 3], help="examples per task, one per length")
    ap.add_argument("--n-lm", type=int, default=3)
    args = ap.parse_args(argv)
    model, tok, t0 = start(args)
    rows = []
    for length, n in zip(args.lengths, args.n):
        rows += run(model, tok, ["passkey", "multikey"], methods(), [], [length], n)
    rows += run(model, tok, "lm", methods(), [], [1536], args.n_lm)
    finish(rows, args, t0)


if __name__ == "__main__":
    main()
