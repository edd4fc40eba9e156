"""Foundation baselines on the bundled model: full, streaming_llm and random at 50%, 25% and 12.5%.

Passkey and multi-key retrieval at 2k tokens (add 1k with --lengths 1024 2048) and language-model
fidelity on a 1.5k-token prefix, query-agnostic (the context is compressed before the question).
Writes benchmarks/results/evict/foundation.{json,md}.

Threads default to 1: on a 2-core machine shared with other jobs, two OpenMP threads made a short forward
pass and a 2k prefill much slower.
"""

from __future__ import annotations

from kvsum.eval import run

from .common import arguments, finish, method_rows, start

METHODS = ["full", "streaming_llm", "random"]
BUDGETS = [0.5, 0.25, 0.125]


def main(argv: list[str] | None = None) -> None:
    ap = arguments(__doc__, "evict/foundation", threads=1)
    ap.add_argument("--methods", nargs="+", default=METHODS, help="specs (own budgets after @; else 0.5 0.25 0.125)")
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048], help="retrieval context lengths")
    ap.add_argument("--lm-length", type=int, default=1536, help="prefix length for lm fidelity")
    ap.add_argument("--n", type=int, default=20, help="examples per retrieval task and length")
    ap.add_argument("--n-lm", type=int, default=8, help="examples for lm fidelity")
    args = ap.parse_args(argv)
    methods = method_rows(args.methods, BUDGETS)
    model, tokenizer, t0 = start(args)
    rows = run(model, tokenizer, ["passkey", "multikey"], methods, BUDGETS, args.lengths, args.n)
    rows += run(model, tokenizer, "lm", methods, BUDGETS, [args.lm_length], args.n_lm)
    finish(rows, args, t0)


if __name__ == "__main__":
    main()
