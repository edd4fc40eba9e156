"""The experiments registry: every committed result file belongs to one named experiment, every experiment has
its file, and each carries the command, date and versions that produced it."""

import json

from benchmarks.__main__ import HEADLINE
from benchmarks.diagnose import build
from benchmarks.experiments import EXPERIMENTS, RESULTS
from benchmarks.specs import parse_row


def _owned() -> dict:
    owned = {RESULTS / f"{HEADLINE}.{ext}": HEADLINE for ext in ("json", "md")}  # built from the others
    for e in EXPERIMENTS.values():
        p = e.path()
        if e.out == "dir":
            owned.update({f: e.name for f in p.parent.rglob("*") if f.is_file()})
        else:
            owned.update({p.with_suffix(ext): e.name for ext in (".json", ".md", ".txt")})
    return owned


def test_every_result_file_belongs_to_an_experiment_and_every_experiment_has_its_file():
    owned = _owned()
    files = [f for f in RESULTS.rglob("*") if f.is_file() and "__pycache__" not in f.parts]
    assert [str(f) for f in files if f not in owned] == []
    assert [e.name for e in EXPERIMENTS.values() if not e.pending and not e.path().exists()] == []


def test_a_pending_experiment_has_no_result_yet():
    """`pending` marks an experiment not run yet (e.g. one that needs a GPU); once its file is committed, the flag
    goes."""
    assert [e.name for e in EXPERIMENTS.values() if e.pending and e.path().exists()] == []


def test_every_json_result_records_its_command_date_and_versions():
    for e in EXPERIMENTS.values():
        if e.path().suffix != ".json" or e.pending:
            continue
        meta = json.loads(e.path().read_text()).get("meta")
        assert isinstance(meta, dict), e.name
        assert meta.get("date") and (meta.get("command") or meta.get("run")), e.name
        assert meta.get("torch") and meta.get("transformers"), e.name


def test_every_method_spec_builds():
    for e in EXPERIMENTS.values():
        for spec in e.methods:
            name, knobs, _ = parse_row(spec)
            knobs.pop("artifact", None)
            if name in ("echokv", "lowrank"):  # a calibrated artifact
                continue
            build(name, **knobs)  # a diagnosis variant (benchmarks/diagnose.py) or kvsum's method


def test_a_merged_file_lists_every_run_once_this_one_last():
    from benchmarks.common import commands_with, recorded_commands

    assert recorded_commands({}) == [] and recorded_commands({"command": "a"}) == ["a"]  # a file of one run
    assert recorded_commands({"command": "b", "commands": ["a", "b"]}) == ["a", "b"]
    assert commands_with(["a", "b", "c"], "b") == ["a", "c", "b"] and commands_with([], "a") == ["a"]


def test_a_recorded_command_runs_a_benchmark_module_by_its_module_name():
    # run as `python -m benchmarks.frontier`, argv[0] is the file's path, which `python` cannot run
    from pathlib import Path

    import benchmarks.frontier
    from benchmarks.common import invocation, recorded_commands

    assert invocation(benchmarks.frontier.__file__) == ["python", "-m", "benchmarks.frontier"]
    main = Path(benchmarks.frontier.__file__).with_name("__main__.py")
    assert invocation(str(main)) == ["python", "-m", "benchmarks"]
    assert invocation("scripts/x.py") == ["python", "scripts/x.py"]
    for e in EXPERIMENTS.values():  # and no committed result names one by its path
        if e.path().suffix == ".json" and not e.pending:
            record = json.loads(e.path().read_text())
            for cmd in [*recorded_commands(record), *recorded_commands(record.get("meta") or {})]:
                assert "benchmarks/" not in cmd.split()[1], (e.name, cmd)
