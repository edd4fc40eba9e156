"""The headline's long-context column: the same configuration in the long-context benchmark, matched by spec and
by a budget in (budget / 2, budget], prose and code together, n and the full cache's score named."""

import json

from benchmarks.headline import _long, long_cells


def _row(config, budget, length, task, score, n=2):
    return dict(config=config, task=task, length=length, budget=budget, n=n, score=score, full_score=100.0,
                ratio=budget)


def test_long_column_matches_spec_and_budget_bucket(tmp_path):
    rows = [_row("full", 1.0, L, t, 100.0) for L in (16384, 32768) for t in ("niah_single", "niah_single_code")]
    rows += [_row("summary+turboquant:score=sentence,key_shift=1", 0.1, 16384, "niah_single", 50.0),
             _row("summary+turboquant:score=sentence,key_shift=1", 0.1, 16384, "niah_single_code", 100.0),
             _row("snapkv", 0.25, 16384, "niah_single", 0.0)]
    (tmp_path / "long").mkdir()
    (tmp_path / "long" / "long_suite.json").write_text(json.dumps({"meta": {}, "rows": rows}))
    table = [dict(family="full cache", method="full", knobs={}, budget=1.0),
             dict(family="composition", method="summary+turboquant", knobs={"score": "sentence", "key_shift": 1},
                  budget=0.125),
             dict(family="eviction", method="snapkv", knobs={}, budget=0.125),
             dict(family="eviction", method="streaming_llm", knobs={}, budget=0.25)]
    long_cells(tmp_path, table)
    assert _long(table[0]) == "16k: 100, n = 4; 32k: 100, n = 4"
    assert _long(table[1]) == "16k: 75 (100), n = 4 (at 0.1)"
    assert _long(table[2]) == "-" and _long(table[3]) == "-"  # 0.25 is not in (0.0625, 0.125]; no such row
