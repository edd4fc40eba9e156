"""The property tests' hypothesis statistics (in tests/methods/test_base.py, tests/test_compress.py), as a text log.

    python -m benchmarks run properties    # writes benchmarks/results/robust/properties.txt
"""

from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import sys
from pathlib import Path

from .experiments import RESULTS

COMMAND = ["python", "-m", "pytest", "-q", "tests/methods/test_base.py", "tests/test_compress.py", "-k",
           "within_budget or hold_budget", "--hypothesis-show-statistics"]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(RESULTS / "robust" / "properties"), help="output stem (.txt)")
    out = Path(ap.parse_args(argv).out)
    p = subprocess.run([sys.executable, *COMMAND[1:]], capture_output=True, text=True,
                       env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=Path(__file__).resolve().parent.parent)
    day = datetime.date.today().isoformat()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_name(out.name + ".txt").write_text(f"# OMP_NUM_THREADS=1 {' '.join(COMMAND)} ({day})\n" + p.stdout)
    print(p.stdout)
    sys.exit(p.returncode)


if __name__ == "__main__":
    main()
