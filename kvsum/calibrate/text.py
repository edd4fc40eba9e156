"""Calibration token ids: a deterministic slice of the Python standard library's own source files
(kvsum.stdlib_text), or text or ids given."""

from __future__ import annotations

import hashlib
import platform

import torch
from torch import Tensor

from ..errors import KVSumError
from ..stdlib_text import MODULE_CHARS, calibration_text, stdlib_modules  # noqa: F401  (re-exported)


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
