"""`python -m benchmarks list | run NAME [--n N] [--out DIR] [--dry-run]`: the experiments registry's entry point.

A plain `run NAME` writes the canonical files (benchmarks/results/<family>/<name>.json and .md); --n (fewer
examples) and --out (another results root) only shrink a run for a smoke check. `run headline` builds the
frontier table from the committed result files (no model runs).
"""

from __future__ import annotations

import argparse
import importlib
import shlex
import subprocess
import sys
from pathlib import Path

from .experiments import EXPERIMENTS, RESULTS, Experiment

HEADLINE = "headline"


def _command(exp: Experiment, argv: list[str]) -> list[str]:
    """The command line one invocation runs (kvsum CLI runners run in a subprocess)."""
    if exp.runner == "kvsum":
        return ["python", "-m", "kvsum.cli", *argv]
    return ["python", "-m", f"benchmarks.{exp.runner}", *argv]


def run(exp: Experiment, root: Path, n: int | None, dry: bool) -> int:
    runs = [_command(exp, argv) for argv in exp.invocations(root, n)]
    print("\n".join("$ " + shlex.join(line) for line in runs), flush=True)
    if dry:
        return 0
    from . import common, stamp  # they load torch and kvsum: a listing or a dry run needs neither

    for argv, line in zip(exp.invocations(root, n), runs):
        common.CONTEXT.update(experiment=exp.name, command=shlex.join(line))
        if exp.runner == "kvsum":
            code = subprocess.call([sys.executable, *line[1:]])
        else:
            try:
                code = importlib.import_module(f"benchmarks.{exp.runner}").main(argv) or 0
            except SystemExit as e:  # a runner that exits with its status (bad_input, check_report)
                code = e.code if isinstance(e.code, int) else 1
        if code:
            return code
    stamp.stamp(exp, root)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("list", help="every experiment: name, family, what it measures")
    r = sub.add_parser("run", help="run one experiment (or headline)")
    r.add_argument("name")
    r.add_argument("--n", type=int, default=None, help="smoke check: this many examples per task (--n, --n-lm)")
    r.add_argument("--out", default=None, help="smoke check: results root instead of benchmarks/results")
    r.add_argument("--dry-run", action="store_true", help="print the runner commands, run nothing")
    args = ap.parse_args(argv)
    if args.cmd == "list":
        width = max(map(len, EXPERIMENTS))
        print(f"{HEADLINE:<{width}}  {'-':<11}  the frontier table from the committed results (no model runs)")
        for e in EXPERIMENTS.values():
            print(f"{e.name:<{width}}  {e.family:<11}  {e.doc}")
        return 0
    root = Path(args.out) if args.out else RESULTS
    if args.name == HEADLINE:
        from .headline import build

        build(RESULTS, root)
        return 0
    if args.name not in EXPERIMENTS:
        ap.error(f"unknown experiment {args.name!r}; `python -m benchmarks list` names them")
    return run(EXPERIMENTS[args.name], root, args.n, args.dry_run)


if __name__ == "__main__":
    sys.exit(main())
