"""Calibration text: a deterministic slice of the Python standard library's own source files.

The first MODULE_CHARS characters of each public top-level module, in name order: many modules, varied code
and docstrings. It is disjoint from the evaluation haystack, which uses the documentation prose of
`pydoc_data.topics` (tests check that no paragraph is shared).
"""

from __future__ import annotations

import glob
import hashlib
import os
import platform
import sysconfig
from pathlib import Path

import torch
from torch import Tensor

from ..errors import KVSumError

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


def calibration_ids(tokenizer, text: str | None, ids: Tensor | None, tokens: int) -> tuple[Tensor, str]:
    """The first `tokens` calibration token ids (given `ids`, else `text` or the stdlib slice, tokenized) and a
    line saying where they came from."""
    if ids is not None:
        ids = ids.reshape(-1)
        source = f"token ids given ({ids.numel()})"
    else:
        if tokenizer is None:
            raise KVSumError("calibrate needs a tokenizer to encode calibration text (or ids=...)")
        if text is None:
            text = calibration_text(chars=tokens * 6)
            source = f"python {platform.python_version()} stdlib source"
        else:
            source = f"text sha256 {hashlib.sha256(text.encode()).hexdigest()[:16]}"
        ids = torch.tensor(tokenizer(text, add_special_tokens=False).input_ids)
    if ids.numel() < tokens:
        raise KVSumError(f"calibration needs tokens={tokens} tokens but the text has {ids.numel()}; "
                         "give more text or fewer tokens")
    return ids[:tokens], source
