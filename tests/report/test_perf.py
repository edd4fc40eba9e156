"""kvsum/report/perf.py: timings read from perf result files."""

import json

from kvsum.report import build
from kvsum.report.specs import Store
from tests.helpers import CharTokenizer, report_settings, tiny_llama


def test_timings_from_perf_files(tmp_path):
    from kvsum.report.perf import from_files

    assert from_files(tmp_path, 0.25) is None
    rows = dict(short=[dict(length=64, config="full", tokens_per_s=20.0, over_full=1.0),
                       dict(length=64, config="kivi", tokens_per_s=10.0, over_full=0.5),
                       dict(length=64, config="snapkv", tokens_per_s=None, over_full=None, refused="short")],
                overhead=[dict(length=1024, method="kivi", budget=0.25, prefill_s=2.0, kvsum_prefill_s=2.2,
                               compress_s=0.2, overhead=1.2)],
                decode=[dict(length=1024, method="full", budget=1.0, step_ms=40.0, over_full=1.0, ratio=1.0),
                        dict(length=1024, method="kivi", budget=0.25, step_ms=80.0, over_full=2.0, ratio=0.24),
                        dict(length=1024, method="kivi", budget=0.5, step_ms=90.0, over_full=2.25, ratio=0.4)])
    for part, r in rows.items():
        (tmp_path / f"perf_{part}.json").write_text(json.dumps({"meta": {}, "rows": r}))
    tp, sc, paths = from_files(tmp_path, 0.25)
    assert tp == [dict(length=64, method="kivi", tok_s=10.0, full_tok_s=20.0, ratio_to_full=0.5, bytes_ratio=None,
                       new=None, budget=None)]
    assert sc == [dict(length=1024, method="kivi", prefill_s=2.0, kvsum_prefill_s=2.2, compress_s=0.2, overhead=1.2,
                       step_ms=80.0, full_step_ms=40.0, decode_ratio=2.0, bytes_ratio=0.24)]
    assert len(paths) == 3
    s = report_settings(methods=["streaming_llm"], budgets=[0.5], tasks=["lm"], timings="files", perf_dir=str(tmp_path))
    out = build(s, tmp_path / "out", Store(tmp_path / "c"), progress=False, model=tiny_llama(),
                tokenizer=CharTokenizer())
    md = out["md"].read_text()
    assert "perf_short.json" in md and "| 64 | kivi | 10.0 | 20.0 | 0.50 | - |" in md
    assert "| 1024 | kivi | 2.00 | 0.20 | 1.20 | 80.0 | 40.0 | 2.00 |" in md
    assert 'data-plots="4"' in out["html"].read_text()  # Pareto, throughput, overhead, decode
