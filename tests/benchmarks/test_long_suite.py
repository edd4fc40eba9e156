"""The long-context benchmark's bookkeeping (no model): configurations from spec strings, rows aggregated from
per-example records (refusals left out), and the tables naming n in every cell."""

import argparse

from benchmarks.experiments import EXPERIMENTS
from benchmarks.long_suite import aggregate, configs, indices, render, summary_table
from kvsum.methods import make_method


def _rec(task, length, index, config, budget, score, full=100.0, **extra):
    return dict(task=task, length=length, index=index, seed=index, config=config, method=config.split(":")[0],
                knobs={}, budget=budget, score=score, full_score=full, ratio=budget, bytes=budget * 100,
                full_bytes=100, prefill_s=10.0, compress_s=1.0, compress_over_prefill=0.1, decode_over_full=1.5,
                prefill_peak=3 * 2**30, compress_peak=2 * 2**30, compress_extra=2**20, peak_over_base=1.05, **extra)


def test_every_configuration_of_the_experiment_builds_with_its_own_budgets():
    for argv in EXPERIMENTS["long_suite"].runs:
        specs = list(argv[argv.index("--methods") + 1:])
        cfgs = configs(specs, [0.25, 0.1])
        assert cfgs[0] == ("full", "full", {}, 1.0)
        assert ("snapkv", "snapkv", {}, 0.1) in cfgs
        for _, name, knobs, budget in cfgs:
            make_method(name, **knobs)
            assert 0 < budget <= 1


def test_rows_average_over_examples_and_leave_refusals_out():
    recs = [_rec("niah_single", 4096, i, "full", 1.0, 100.0) for i in range(2)]
    recs += [_rec("niah_single", 4096, 0, "snapkv", 0.25, 100.0), _rec("niah_single", 4096, 1, "snapkv", 0.25, 0.0)]
    recs.append(dict(task="niah_single", length=4096, index=0, seed=0, config="summary", method="summary",
                     budget=0.1, refused="summary: ... the smallest budget that fits: 0.112"))
    rows = aggregate(recs)
    assert [(r["config"], r["n"], r["score"]) for r in rows] == [("full", 2, 100.0), ("snapkv", 2, 50.0)]
    assert rows[1]["indices"] == [0, 1] and rows[1]["full_score"] == 100.0


def test_tables_name_the_count_in_every_cell():
    recs = [_rec(t, L, 0, c, b, 100.0) for t in ("niah_single", "niah_single_code") for L in (4096, 32768)
            for c, b in (("full", 1.0), ("snapkv", 0.25))]
    rows = aggregate(recs)
    table = summary_table(rows)
    assert table[0].startswith("| configuration | budget | bytes held | 4k | 32k |")
    assert "| `snapkv` | 0.25 | 0.250 | 100 (100), n = 2 | 100 (100), n = 2 |" in table
    md = render(rows, {"model": "qwen2.5-coder-0.5b", "commands": ["python -m benchmarks.long_suite"]})
    assert "| 32768 | niah_single_code | `snapkv` | 0.25 | 1 | 100 (100) |" in md


def test_a_run_without_niah_single_has_one_table_per_task_and_no_empty_one():
    recs = [_rec(t, 16384, 0, c, b, s, full=40.0) for t in ("vt", "fwe")
            for c, b, s in (("full", 1.0, 40.0), ("snapkv", 0.25, 0.0))]
    md = render(aggregate(recs), {"model": "qwen2.5-coder-0.5b", "commands": ["python -m benchmarks.long_suite"]})
    assert "NIAH single" not in md and "### vt" in md and "### fwe" in md
    assert md.count("| configuration | budget | bytes held | 16k |") == 2
    assert "| `snapkv` | 0.25 | 0.250 | 0 (40), n = 1 |" in md


def test_first_skips_the_earlier_examples_at_every_length():
    args = argparse.Namespace(first=2, n=[3, 5], lengths=[4096, 16384, 32768])
    assert [list(indices(args, L)) for L in args.lengths] == [[2], [2, 3, 4], [2, 3, 4]]
    assert list(indices(argparse.Namespace(first=0, n=[2], lengths=[4096]), 4096)) == [0, 1]
