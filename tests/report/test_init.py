"""kvsum/report/__init__.py: building the report, resuming it, deadlines, refusals."""

import json
import re

from kvsum.report import build
from kvsum.report.specs import Store
from tests.helpers import CharTokenizer, report_settings, tiny_llama


def test_build_writes_html_md_json_and_resumes(tmp_path):
    s = report_settings()
    store = Store(tmp_path / "cache")
    out = build(s, tmp_path / "out", store, progress=False, model=tiny_llama(), tokenizer=CharTokenizer())
    assert out["complete"] and not out["errors"]
    units = 2 * (1 + 2 * 2) + 2 * (1 + 2)  # tasks x (full + methods x budgets) + methods x timing lengths
    assert store.misses == units
    page = out["html"].read_text()
    plots = int(re.search(r'data-plots="(\d+)"', page).group(1))
    assert plots == page.count("<img data-plot=") == 2 + 3  # 2 Pareto plots + throughput, overhead, decode
    assert "data:image/png;base64," in page and not re.search(r'(src|href)="(https?:)?//', page)  # self-contained
    md = out["md"].read_text()
    for name in re.findall(r"\(plots/(\w+)\.png\)", md):
        assert (tmp_path / "out" / "plots" / f"{name}.png").stat().st_size > 1000
    assert "## Recommendations" in md and "| long context, memory-bound |" in md
    assert "| bytes / 16-bit full cache |" in md and "| full | 1 | 2.000 (float32 entries) |" in md
    data = json.loads((tmp_path / "out" / "report.json").read_text())
    assert {(r["task"], r["method"], r["budget"]) for r in data["rows"]} == {
        (t, m, b) for t in ("lm", "passkey") for m, b in
        [("full", 1.0), ("streaming_llm", 0.5), ("streaming_llm", 0.25), ("snapkv", 0.5), ("snapkv", 0.25)]}
    again = Store(tmp_path / "cache")
    out2 = build(s, tmp_path / "out2", again, progress=False, model=tiny_llama(), tokenizer=CharTokenizer())
    assert again.misses == 0 and again.hits == units and out2["complete"]
    rows2 = json.loads((tmp_path / "out2" / "report.json").read_text())["rows"]
    assert rows2 == data["rows"]


def test_deadline_makes_an_incomplete_report(tmp_path):
    s = report_settings(methods=["streaming_llm"], budgets=[0.5], tasks=["lm"], timings="none")
    out = build(s, tmp_path / "out", Store(tmp_path / "c"), deadline=0.0, progress=False, model=tiny_llama(),
                tokenizer=CharTokenizer())
    assert not out["complete"] and out["rows"] == 0
    assert "incomplete" in out["md"].read_text()


def test_refused_settings_are_reported_and_cached(tmp_path):
    s = report_settings(methods=["turboquant"], budgets=[0.01], tasks=["lm"], timings="none")
    first = Store(tmp_path / "c")
    out = build(s, tmp_path / "out", first, progress=False, model=tiny_llama(), tokenizer=CharTokenizer())
    assert out["complete"] and "turboquant@0.01" in out["errors"] and "KVSumError" in out["errors"]["turboquant@0.01"]
    assert "turboquant@0.01" in out["md"].read_text()
    again = Store(tmp_path / "c")
    out2 = build(s, tmp_path / "out", again, progress=False, model=tiny_llama(), tokenizer=CharTokenizer())
    assert again.misses == 0 and out2["errors"] == out["errors"]
