"""The frontier benchmark's core on the tiny random model: rows per configuration and budget, a refusal recorded
(not raised), and the markdown with one line per configuration."""

import json

import torch

from benchmarks import frontier
from tests.helpers import CharTokenizer, tiny_llama

SPECS = ["summary", "snapkv", "turboquant"]
BUDGETS = [0.03, 0.25]


def test_frontier_rows_refusal_and_table(tmp_path):
    torch.set_num_threads(1)
    rows = frontier.measure(tiny_llama(), CharTokenizer(), SPECS, BUDGETS, [2000], n=1, n_lm=1)
    full = [r for r in rows if r["config"] == "full"]
    assert sorted(r["task"] for r in full) == ["lm", "multikey", "passkey"]
    refused = [r for r in rows if "refused" in r]
    assert {(r["config"], r["budget"]) for r in refused} == {("turboquant", 0.03)}
    assert len(refused) == 3 and all(r["refused"] and "\n" not in r["refused"] for r in refused)
    for spec in SPECS:
        for b in BUDGETS:
            cell = [r for r in rows if r["config"] == spec and r["budget"] == b]
            assert sorted(r["task"] for r in cell) == ["lm", "multikey", "passkey"], (spec, b)
            if "refused" not in cell[0]:
                assert all(r["n"] == 1 and 0 < r["ratio"] <= b + 1e-9 for r in cell)
                assert next(r for r in cell if r["task"] == "lm")["kl"] >= 0

    info = {"model": "tiny", "threads": 1}
    js, md = frontier.write(rows, info, str(tmp_path / "frontier"), SPECS, BUDGETS)
    data = json.loads(js.read_text())
    assert data["meta"] == info and data["command"] and len(data["rows"]) == len(rows)
    text = md.read_text()
    table = [line for line in text.splitlines() if line.startswith("| `")]
    assert [line.split("`")[1] for line in table] == ["full", *SPECS]
    assert table[3].split(" | ")[1] == "refuses" and "refuses" not in "".join(table[:3])
    assert "n = 1/1/1" in table[2] and "KL" in table[2] and "×" in table[2]
    assert all(r.get("chosen") for r in rows if r["config"] == "summary")  # the flagship, configured by budget
    assert "`summary` became: 0.03: `" in text
    assert "## 2000 tokens" in text and "model: tiny" in text


def test_a_chosen_configuration_is_named_under_the_table():
    row = dict(task="passkey", length=300, config="summary", budget=0.1, score=100.0, full_score=100.0, ratio=0.1,
               n=1, chosen=["snapkv"])
    lines = frontier.table([row], 300, ["summary"], [0.1])
    assert lines[-1] == "`summary` became: 0.1: `snapkv`."


def test_the_command_line():
    args = frontier.parser().parse_args(["--length", "2048", "4096", "--n", "2"])
    assert args.lengths == [2048, 4096] and args.n == 2 and args.n_lm == 8 and args.threads == 1
    assert args.methods == list(frontier.METHODS) and args.budgets == [0.03, 0.05, 0.1, 0.125, 0.25, 0.5]
    assert str(args.out).endswith("benchmarks/results/frontier/frontier")


def test_merge_keeps_the_cells_this_run_did_not_measure(tmp_path):
    def row(config, budget, score, length=300, task="passkey"):
        return dict(task=task, length=length, config=config, budget=budget, score=score, full_score=90.0,
                    ratio=budget, n=1, **({"kl": score} if task == "lm" else {}))

    old = [row("full", 1.0, 90.0), row("summary", 0.1, 10.0), row("snapkv", 0.1, 0.0), row("snapkv", 0.5, 5.0),
           row("summary", 0.1, 20.0, length=600), row("summary", 0.5, 30.0),
           row("full", 1.0, 0.0, task="lm"), row("summary", 0.1, 0.5, task="lm")]
    frontier.write(old, {"model": "tiny"}, str(tmp_path / "f"), ["summary", "snapkv"], [0.1, 0.5])
    new = [row("full", 1.0, 90.0), row("summary", 0.1, 70.0)]
    rows, specs, budgets, earlier = frontier.merge(new, str(tmp_path / "f"), ["summary"], [0.1])
    assert specs == ["summary", "snapkv"] and budgets == [0.1, 0.5] and len(earlier) == 1
    got = {(r["config"], r["budget"], r["length"], r["task"]): r["score"] for r in rows}
    assert got == {("full", 1.0, 300, "passkey"): 90.0, ("summary", 0.1, 300, "passkey"): 70.0,
                   ("snapkv", 0.1, 300, "passkey"): 0.0, ("snapkv", 0.5, 300, "passkey"): 5.0,
                   ("summary", 0.1, 600, "passkey"): 20.0,  # other lengths are kept as they were
                   ("summary", 0.5, 300, "passkey"): 30.0,  # and other budgets of a rerun configuration
                   ("full", 1.0, 300, "lm"): 0.0, ("summary", 0.1, 300, "lm"): 0.5}  # and tasks this run skipped
    assert len(rows) == len(got)  # the full cache's rerun cell replaces its old one
    assert frontier.merge(new, str(tmp_path / "none"), ["summary"], [0.1]) == (new, ["summary"], [0.1], [])
    assert frontier.parser().parse_args(["--merge"]).merge
