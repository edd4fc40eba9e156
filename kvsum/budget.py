"""Byte accounting: budgets are fractions of the full cache at 16 bits per element."""

from __future__ import annotations

from .errors import KVSumError


def full_nbytes(n_layers: int, n_kv_heads: int, head_dim: int, tokens: int, bits: int = 16) -> int:
    """Bytes of an uncompressed K+V cache for `tokens` tokens."""
    return 2 * n_layers * n_kv_heads * head_dim * tokens * bits // 8


def check_storage(dtype):
    import torch

    if dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise KVSumError(f"storage_dtype must be torch.float16, torch.bfloat16 or torch.float32, got {dtype}")
    return dtype


def check_budget(budget) -> float:
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not 0 < budget <= 1:
        raise KVSumError(f"budget must be a fraction in (0, 1] of the full 16-bit cache, got {budget!r}")
    return float(budget)
