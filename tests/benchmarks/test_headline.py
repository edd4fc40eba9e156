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


def test_long_column_prefers_the_first_source_and_matches_what_summary_chose(tmp_path):
    cover = "summary:cover=turboquant(bits=3.5,center=True),score=surprisal"
    old = [_row("full", 1.0, 16384, "niah_single", 100.0), _row(cover, 0.25, 16384, "niah_single", 100.0),
           _row("snapkv", 0.25, 16384, "niah_single", 50.0)]
    new = [_row("full", 1.0, 16384, "niah_single", 80.0, n=5), {**_row("summary", 0.25, 16384, "niah_single", 60.0,
                                                                       n=5), "chosen": [cover]}]
    (tmp_path / "long").mkdir()
    for name, rows in (("long_suite", old), ("long_suite_bf16", new)):
        (tmp_path / "long" / f"{name}.json").write_text(json.dumps({"meta": {}, "rows": rows}))
    table = [dict(family="full cache", method="full", knobs={}, budget=1.0),
             dict(family="summary", method="summary", knobs={"cover": "turboquant(bits=3.5,center=True)",
                                                             "score": "surprisal"}, budget=0.25),
             dict(family="eviction", method="snapkv", knobs={}, budget=0.25)]
    long_cells(tmp_path, table)
    assert _long(table[0]) == "16k: 80, n = 5" and table[0]["long"]["source"] == "long/long_suite_bf16.json"
    assert _long(table[1]) == "16k: 60 (100), n = 5"  # the flagship's choice at 0.25 is this configuration
    assert _long(table[2]) == "16k: 50 (100), n = 2" and table[2]["long"]["source"] == "long/long_suite.json"


def test_long_column_takes_each_length_from_the_first_source_that_ran_it_there(tmp_path):
    sources = {"long_flagship_16k": [_row("full", 1.0, 16384, "niah_single", 90.0, n=10),
                                     _row("snapkv", 0.1, 16384, "niah_single", 80.0, n=10)],
               "long_flagship_32k": [_row("full", 1.0, 32768, "niah_single", 50.0, n=6),
                                     _row("snapkv", 0.1, 32768, "niah_single", 40.0, n=6),
                                     _row("snapkv", 0.1, 16384, "niah_single", 0.0, n=6)]}  # 16k: the first's
    (tmp_path / "long").mkdir()
    for name, rows in sources.items():
        (tmp_path / "long" / f"{name}.json").write_text(json.dumps({"meta": {}, "rows": rows}))
    table = [dict(family="eviction", method="snapkv", knobs={}, budget=0.1)]
    long_cells(tmp_path, table)
    assert _long(table[0]) == "16k: 80 (100), n = 10; 32k: 40 (100), n = 6"
    assert table[0]["long"]["source"] == "long/long_flagship_16k.json, long/long_flagship_32k.json"


def test_summary_by_budget_rows_are_the_flagship_and_bare_old_rows_its_own_defaults(tmp_path):
    """A `summary` row that records what it became (`chosen`) is the flagship; a bare one without (committed before
    summary was configured by budget) is summary's own defaults; refusals never enter the table."""
    from benchmarks.headline import _md, frontier, rows_of

    def row(task, method, knobs, score, chosen=None, **extra):
        r = dict(task=task, length=2048, method=method, knobs=knobs, budget=0.1, n=20, score=score, full_score=100.0,
                 kl=0.05, ratio=0.1, **extra)
        return {**r, "chosen": chosen} if chosen else r

    became = ["summary+turboquant:center=True"]
    rows = [row(t, "summary", {}, 90.0, became) for t in ("passkey", "multikey", "lm")]
    rows += [row(t, "summary", {}, 10.0) for t in ("passkey", "multikey", "lm")]
    rows += [row(t, "turboquant", {}, 0.0, refused="does not fit") for t in ("passkey", "multikey")]
    (tmp_path / "r.json").write_text(json.dumps({"meta": {"model": "smollm2", "date": "2026-12-04T00:00:00+00:00"},
                                                 "rows": rows}))
    got = rows_of(tmp_path)
    assert {json.dumps(r["knobs"]) for r in got} == {"{}", '{"by_budget": false}'} and len(got) == 6
    table = frontier(got)
    best = next(r for r in table if r["family"] == "summary")
    assert best["knobs"] == {} and best["chosen"] == became  # the flagship wins its budget
    assert "`summary` (by budget: `summary+turboquant:center=True`)" in _md(table)


def test_centered_rows_measured_before_centering_changed_are_left_out(tmp_path):
    from benchmarks.headline import CENTERED_SINCE, rows_of

    def row(method, knobs, chosen=None):
        return dict(task="passkey", length=2048, method=method, knobs=knobs, budget=0.25, n=20, score=90.0,
                    full_score=100.0, ratio=0.25, **({"chosen": chosen} if chosen else {}))

    rows = [row("summary", {"cover_bits": 3.5, "cover_center": True}), row("summary", {}, ["turboquant:center=True"]),
            row("turboquant", {"center": True}), row("turboquant", {})]
    for date, kept in (("2026-12-01T10:00:00+00:00", 1), (CENTERED_SINCE + ":01+00:00", 4)):
        (tmp_path / "r.json").write_text(json.dumps({"meta": {"model": "smollm2", "date": date}, "rows": rows}))
        assert len(rows_of(tmp_path)) == kept


def test_dev_split_runs_never_enter_the_table(tmp_path):
    """Dev seeds (from 1000) choose formats and knobs; the headline reports the test split only."""
    from benchmarks.headline import rows_of

    row = dict(task="passkey", length=2048, method="turboquant", knobs={}, budget=0.25, n=20, score=90.0,
               full_score=100.0, ratio=0.25)
    for meta, kept in (({}, 1), ({"split": "dev"}, 0), ({"seed": 1000}, 0),
                       ({"command": "python -m benchmarks.frontier --seed 1000"}, 0),
                       ({"command": "python -m benchmarks.frontier --seed 7"}, 1)):
        (tmp_path / "r.json").write_text(json.dumps({"meta": {"model": "smollm2", "date": "2026-12-05", **meta},
                                                     "rows": [row]}))
        assert len(rows_of(tmp_path)) == kept
