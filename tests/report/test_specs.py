"""kvsum/report/specs.py: which methods a report covers."""

import pytest

from kvsum.report import rules
from kvsum.report.specs import method_specs


def test_specs_need_the_artifact(monkeypatch, tmp_path):
    monkeypatch.setenv("KVSUM_CACHE", str(tmp_path))
    specs, notes = method_specs(["snapkv", "echokv"], "smollm2")
    assert specs == [("snapkv", {})] and "kvsum calibrate" in notes[0]
    with pytest.raises(Exception, match="unknown method"):
        method_specs(["nope"], "smollm2")


def test_compositions_are_named_explicitly():
    specs, _ = method_specs(["all", "snapkv+turboquant"], "smollm2", skip=("echokv", "lowrank"))
    names = [n for n, _ in specs]
    assert names[-1] == "snapkv+turboquant" and "snapkv" in names and names.count("snapkv") == 1
    comp = rules.complexity([("snapkv+turboquant", {})], [], [])
    assert comp[0]["family"] == "composition" and "snapkv.window" in comp[0]["knobs"]
    assert "reference queries" in comp[0]["prefill_extras"]
