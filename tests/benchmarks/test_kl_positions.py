"""The lm-KL-by-position diagnosis on the tiny random model: one row per configuration and budget, spans that
average to the whole KL, the full cache at exactly zero."""

import torch

from benchmarks import kl_positions
from tests.helpers import CharTokenizer, tiny_llama


def test_kl_by_position_rows_and_table():
    torch.set_num_threads(1)
    rows = kl_positions.by_position(tiny_llama(), CharTokenizer(), ["full@1", "snapkv@0.1,0.25"], [0.5], 600, 2, 0)
    assert [(r["method"], r["budget"]) for r in rows] == [("full", 1.0), ("snapkv", 0.1), ("snapkv", 0.25)]
    full, low, high = rows
    assert full["kl"] == 0 and set(full["spans"].values()) == {0}
    assert list(low["spans"]) == ["0-8", "8-32", "32-64", "64-128"] and len(low["per_example"]) == 2
    assert low["kl"] > high["kl"] > 0  # fewer tokens kept, a larger KL
    widths = [b - a for a, b in kl_positions.SPANS]  # the spans cover the 128 continuation tokens
    assert abs(sum(w * v for w, v in zip(widths, low["spans"].values())) / 128 - low["kl"]) < 1e-3
    lines = kl_positions.table(rows)
    assert len(lines) == 2 + 3 and "`snapkv` | 0.1 |" in lines[3]
