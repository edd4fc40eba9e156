"""Reconstruction (echokv, lowrank) beside summary and restkv on equal bytes, through the eval harness.

Passkey and multi-key at 2k tokens (6 examples each) and lm fidelity on a 1.5k prefix (3 examples), at
budgets 0.5 and 0.25. Uses the calibration artifact in the kvsum cache (calibrates it first if missing:
`kvsum calibrate --model smollm2` does the same). Writes benchmarks/results/reconstruct_eval.{json,md}.
"""

from __future__ import annotations

from common import arguments, finish, start

from kvsum.calibrate import calibrate
from kvsum.eval import run
from kvsum.models import cache_dir


def main(argv: list[str] | None = None) -> None:
    ap = arguments(__doc__, "reconstruct_eval", threads=2)
    ap.add_argument("--n", type=int, default=6)
    ap.add_argument("--n-lm", type=int, default=3)
    args = ap.parse_args(argv)
    model, tok, t0 = start(args)
    art = cache_dir() / f"{args.model}-reconstruct.kvsum"
    if not art.exists():
        calibrate(model, tok).save(art)
    a = {"artifact": str(art)}
    methods = [("full", {}), ("echokv", a), ("lowrank", a), ("lowrank", {**a, "share_layers": 2}), ("summary", {}),
               ("restkv", {})]
    rows = run(model, tok, ["passkey", "multikey"], methods, [0.5, 0.25], [2048], args.n)
    rows += run(model, tok, "lm", methods, [0.5, 0.25], [1536], args.n_lm)
    for r in rows:  # the artifact's path is machine-specific; name it by where kvsum keeps it
        if "artifact" in r["knobs"]:
            r["knobs"]["artifact"] = f"<kvsum cache>/{art.name}"
    finish(rows, args, t0)


if __name__ == "__main__":
    main()
