"""Reconstruction (echokv, lowrank) beside summary and restkv on equal bytes, through the eval harness.

Passkey and multi-key at 2k tokens (--n examples each) and lm fidelity on a 1.5k prefix (--n-lm), for the
--methods rows (specs, own budgets after "@", else 0.5 and 0.25). echokv and lowrank get the calibration artifact
in the kvsum cache (calibrated first if missing: `kvsum calibrate --model smollm2` does the same). Writes
benchmarks/results/reconstruct/reconstruct_eval.{json,md}.
"""

from __future__ import annotations

from kvsum.calibrate import calibrate
from kvsum.eval import run
from kvsum.models import cache_dir

from .common import CALIBRATED, arguments, finish, method_rows, start


def main(argv: list[str] | None = None) -> None:
    ap = arguments(__doc__, "reconstruct/reconstruct_eval", threads=2)
    ap.add_argument("--methods", nargs="+", default=["full", "echokv", "lowrank", "lowrank:share_layers=2", "summary",
                                                     "restkv"])
    ap.add_argument("--n", type=int, default=6)
    ap.add_argument("--n-lm", type=int, default=3)
    args = ap.parse_args(argv)
    model, tok, t0 = start(args)
    art = cache_dir() / f"{args.model}-reconstruct.kvsum"
    if not art.exists():
        calibrate(model, tok).save(art)
    methods = [(name, {"artifact": str(art), **knobs} if name in CALIBRATED else knobs, budgets)
               for name, knobs, budgets in method_rows(args.methods, [0.5, 0.25])]
    rows = run(model, tok, ["passkey", "multikey"], methods, [0.5, 0.25], [2048], args.n)
    rows += run(model, tok, "lm", methods, [0.5, 0.25], [1536], args.n_lm)
    for r in rows:  # the artifact's path is machine-specific; name it by where kvsum keeps it
        if "artifact" in r["knobs"]:
            r["knobs"]["artifact"] = f"<kvsum cache>/{art.name}"
    finish(rows, args, t0)


if __name__ == "__main__":
    main()
