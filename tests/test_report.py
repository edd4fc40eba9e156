import json
import re

import pytest

from kvsum import cli
from kvsum.report import Settings, build, rules
from kvsum.report.render import render
from kvsum.report.specs import Store, method_specs

from .conftest import tiny_llama
from .test_eval import CharTokenizer


def _settings(**kw):
    base = dict(model="tiny", methods=["full", "streaming_llm", "snapkv"], budgets=[0.5, 0.25],
                tasks=["lm", "passkey"], length=400, n=1, short_lengths=[96], new_tokens=3, scaling_lengths=[128, 256],
                threads=1, timings="measure")
    return Settings(**{**base, **kw})


def test_build_writes_html_md_json_and_resumes(tmp_path):
    s = _settings()
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
    s = _settings(methods=["streaming_llm"], budgets=[0.5], tasks=["lm"], timings="none")
    out = build(s, tmp_path / "out", Store(tmp_path / "c"), deadline=0.0, progress=False, model=tiny_llama(),
                tokenizer=CharTokenizer())
    assert not out["complete"] and out["rows"] == 0
    assert "incomplete" in out["md"].read_text()


def _row(task, method, budget, ratio, score=None, full=None, kl=None):
    r = dict(task=task, method=method, budget=budget, ratio=ratio)
    if kl is not None:
        r["kl"] = kl
    else:
        r.update(score=score, full_score=full)
    return r


def test_rules_pick_the_smallest_holding_config_and_cite_numbers():
    rows = [_row("passkey", "snapkv", 0.25, 0.25, 100, 100), _row("lm", "snapkv", 0.25, 0.25, kl=0.05),
            _row("passkey", "snapkv", 0.125, 0.125, 33, 100), _row("lm", "snapkv", 0.125, 0.125, kl=0.03),
            _row("passkey", "kivi", 0.25, 0.2, 100, 100), _row("lm", "kivi", 0.25, 0.2, kl=0.5),
            _row("passkey", "summary", 0.125, 0.124, 100, 100), _row("lm", "summary", 0.125, 0.124, kl=0.08)]
    tp = [dict(length=128, method="kivi", ratio_to_full=0.5, tok_s=5.0, full_tok_s=10.0, bytes_ratio=0.2)]
    sc = [dict(length=4096, method="kivi", decode_ratio=3.0, step_ms=300.0, full_step_ms=100.0)]
    recs = {r["case"]: r for r in rules.recommend(rows, [], tp, sc, None)}
    long = recs["long context, memory-bound"]
    assert long["advice"] == "summary (summarization) at budget 0.125"  # snapkv@0.125 drops 67 points; kivi KL 0.5
    assert "0.124" in long["evidence"] and "KL 0.0800" in long["evidence"]
    assert recs["quality first at budget 0.25"]["advice"] == "snapkv (eviction)"
    assert recs["short context (128 tokens), memory headroom"]["advice"] == "full cache"
    assert "0.50x" in recs["short context (128 tokens), memory headroom"]["evidence"]
    assert recs["latency-bound decoding"]["advice"] == "avoid kivi" and "3.00x" in recs["latency-bound decoding"][
        "evidence"]


def test_render_escapes_and_counts_plots(tmp_path):
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    ax.plot([0, 1])
    h, m = render([("p", "a <b> & `c` **d**"), ("plot", "one", fig), ("table", ["x"], [["<y>"]])], tmp_path, "T")
    page = h.read_text()
    assert "a &lt;b&gt; &amp; <code>c</code> <b>d</b>" in page and "<td>&lt;y&gt;</td>" in page
    assert 'data-plots="1"' in page and (tmp_path / "plots" / "one.png").is_file()
    assert "![one](plots/one.png)" in m.read_text()


def test_specs_need_the_artifact(monkeypatch, tmp_path):
    monkeypatch.setenv("KVSUM_CACHE", str(tmp_path))
    specs, notes = method_specs(["snapkv", "echokv"], "smollm2")
    assert specs == [("snapkv", {})] and "kvsum calibrate" in notes[0]
    with pytest.raises(Exception, match="unknown method"):
        method_specs(["nope"], "smollm2")


def test_cli_rejects_bad_task(capsys):
    assert cli.main(["report", "--task", "nope"]) == 2
    assert "nope" in capsys.readouterr().err


def test_refused_settings_are_reported_and_cached(tmp_path):
    s = _settings(methods=["turboquant"], budgets=[0.01], tasks=["lm"], timings="none")
    first = Store(tmp_path / "c")
    out = build(s, tmp_path / "out", first, progress=False, model=tiny_llama(), tokenizer=CharTokenizer())
    assert out["complete"] and "turboquant@0.01" in out["errors"] and "KVSumError" in out["errors"]["turboquant@0.01"]
    assert "turboquant@0.01" in out["md"].read_text()
    again = Store(tmp_path / "c")
    out2 = build(s, tmp_path / "out", again, progress=False, model=tiny_llama(), tokenizer=CharTokenizer())
    assert again.misses == 0 and out2["errors"] == out["errors"]


def test_compositions_are_named_explicitly():
    specs, _ = method_specs(["all", "snapkv+turboquant"], "smollm2", skip=("echokv", "lowrank"))
    names = [n for n, _ in specs]
    assert names[-1] == "snapkv+turboquant" and "snapkv" in names and names.count("snapkv") == 1
    comp = rules.complexity([("snapkv+turboquant", {})], [], [])
    assert comp[0]["family"] == "composition" and "snapkv.window" in comp[0]["knobs"]
    assert "reference queries" in comp[0]["prefill_extras"]


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
    s = _settings(methods=["streaming_llm"], budgets=[0.5], tasks=["lm"], timings="files", perf_dir=str(tmp_path))
    out = build(s, tmp_path / "out", Store(tmp_path / "c"), progress=False, model=tiny_llama(),
                tokenizer=CharTokenizer())
    md = out["md"].read_text()
    assert "perf_short.json" in md and "| 64 | kivi | 10.0 | 20.0 | 0.50 | - |" in md
    assert "| 1024 | kivi | 2.00 | 0.20 | 1.20 | 80.0 | 40.0 | 2.00 |" in md
    assert 'data-plots="4"' in out["html"].read_text()  # Pareto, throughput, overhead, decode
