"""The flagship on the bundled model: `summary` and `hae` against every eviction method on equal bytes.

Passkey and multi-key retrieval at 2k and 4k tokens and language-model fidelity on a 1.5k prefix,
query-agnostic, for the --methods rows (specs with their own budgets after "@"; the committed rows and
ablations are named in benchmarks/experiments/summary.py). Sized for a 2-core CPU; raise --n for tighter
numbers. Writes benchmarks/results/summary/summary.{json,md}.
"""

from __future__ import annotations

from kvsum.eval import run

from .common import arguments, finish, method_rows, start


def main(argv: list[str] | None = None) -> None:
    ap = arguments(__doc__, "summary/summary", threads=2)
    ap.add_argument("--methods", nargs="+", required=True, help="method specs name:knob=value,...@budget,...")
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096])
    ap.add_argument("--n", type=int, nargs="+", default=[6, 3], help="examples per task, one per length")
    ap.add_argument("--n-lm", type=int, default=3)
    args = ap.parse_args(argv)
    methods = method_rows(args.methods, [])
    model, tok, t0 = start(args)
    rows = []
    for length, n in zip(args.lengths, args.n):
        rows += run(model, tok, ["passkey", "multikey"], methods, [], [length], n)
    rows += run(model, tok, "lm", methods, [], [1536], args.n_lm)
    finish(rows, args, t0)


if __name__ == "__main__":
    main()
