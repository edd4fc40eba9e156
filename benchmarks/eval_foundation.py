"""Foundation baselines on the bundled model: full, streaming_llm and random at 50%, 25% and 12.5%.

Passkey and multi-key retrieval at 2k tokens (add 1k with --lengths 1024 2048) and language-model
fidelity on a 1.5k-token prefix, query-agnostic (the context is compressed before the question).
Writes benchmarks/results/foundation.{json,md}.

Threads default to 1: on a 2-core machine shared with other jobs, two OpenMP threads made a 6-token
forward pass ~30x slower (5.4 s vs 0.17 s) and a 2k prefill ~2x slower.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

import kvsum
from kvsum.eval import run, write

METHODS = ["full", "streaming_llm", "random"]
BUDGETS = [0.5, 0.25, 0.125]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048], help="retrieval context lengths")
    ap.add_argument("--lm-length", type=int, default=1536, help="prefix length for lm fidelity")
    ap.add_argument("--n", type=int, default=20, help="examples per retrieval task and length")
    ap.add_argument("--n-lm", type=int, default=8, help="examples for lm fidelity")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "foundation"))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    model, tokenizer = kvsum.load_model(args.model)
    t0 = time.perf_counter()
    rows = run(model, tokenizer, ["passkey", "multikey"], METHODS, BUDGETS, args.lengths, args.n)
    rows += run(model, tokenizer, "lm", METHODS, BUDGETS, [args.lm_length], args.n_lm)
    js, md = write(rows, args.out, model=args.model, command=" ".join(["python", *sys.argv]),
                   threads=args.threads, wall_s=round(time.perf_counter() - t0, 1))
    print(md.read_text())
    print(f"wrote {js} and {md}")


if __name__ == "__main__":
    main()
