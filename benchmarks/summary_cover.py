"""The summary method with a cover of every non-anchor token, against eviction and TurboQuant on equal bytes.

Eviction loses query-agnostic retrieval outright; the cover variants keep every token approximately:
`cover_share` as low-rank factors on the prompt's own bases, `cover=turboquant(...)` as TurboQuant codes (anchors stay
exact in both); `summary+turboquant` stores what summary keeps as TurboQuant codes. Passkey and multi-key
retrieval at --lengths and language-model fidelity on a 1.5k prefix (--lm-only: that alone), for the --methods
rows (specs with their own budgets after "@"; the committed groups, main, pca, sentence, quarter, cover and
unbiased, are named in benchmarks/experiments/summary.py).
"""

from __future__ import annotations

from kvsum.eval import run

from .common import arguments, finish, method_rows, start


def main(argv: list[str] | None = None) -> None:
    ap = arguments(__doc__, "summary/summary_cover", threads=2)
    ap.add_argument("--methods", nargs="+", required=True, help="method specs name:knob=value,...@budget,...")
    ap.add_argument("--n", type=int, default=10)
    ap.add_argument("--n-lm", type=int, default=3)
    ap.add_argument("--lm-only", action="store_true", help="only the lm rows")
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048], help="retrieval context lengths")
    args = ap.parse_args(argv)
    methods = method_rows(args.methods, [])
    model, tok, t0 = start(args)
    rows = [] if args.lm_only else run(model, tok, ["passkey", "multikey"], methods, [], args.lengths, args.n)
    rows += run(model, tok, "lm", methods, [], [1536], args.n_lm)
    finish(rows, args, t0)


if __name__ == "__main__":
    main()
