"""Text from the Python standard library's own source files: a deterministic corpus every Python ships.

The first MODULE_CHARS characters of each public top-level module, in name order: many modules, varied code
and docstrings. It is disjoint from the evaluation haystack, which uses the documentation prose of
`pydoc_data.topics` (tests check that no paragraph is shared). Read by calibration (kvsum.calibrate) and by
the retrieval-head probe (kvsum.retrieval); a leaf module, so both can import it.
"""

from __future__ import annotations

import glob
import os
import sysconfig
from pathlib import Path

MODULE_CHARS = 3000  # characters taken from each stdlib module


def stdlib_modules() -> list[Path]:
    """Public top-level modules of the standard library, in name order."""
    root = sysconfig.get_paths()["stdlib"]
    return [Path(f) for f in sorted(glob.glob(os.path.join(root, "*.py"))) if not Path(f).name.startswith("_")]


def calibration_text(chars: int = 60_000, start: int = 0) -> str:
    """About `chars` characters of stdlib source: the first MODULE_CHARS of each module from index `start`."""
    parts, total = [], 0
    for path in stdlib_modules()[start:]:
        text = path.read_text(encoding="utf-8", errors="replace")[:MODULE_CHARS]
        parts.append(text)
        total += len(text)
        if total >= chars:
            break
    return "\n\n".join(parts)
