"""kvsum/eval/report.py: rows written as JSON and markdown."""

import json

from kvsum.eval import markdown, run, write
from tests.helpers import CharTokenizer, tiny_llama


def test_write_json_and_markdown(tmp_path):
    rows = run(tiny_llama(), CharTokenizer(), ["passkey", "lm"], ["full", "streaming_llm"], [0.5], [260], n=1,
               progress=False)
    js, md = write(rows, tmp_path / "sub" / "res", model="tiny", command="eval --x")
    data = json.loads(js.read_text())
    assert data["rows"] == json.loads(json.dumps(rows))
    for key in ("model", "date", "transformers", "torch", "command"):
        assert data["meta"][key]
    assert data["meta"]["model"] == "tiny" and data["meta"]["command"] == "eval --x"
    report = md.read_text()
    assert report == markdown(rows, data["meta"])
    tables = [line for line in report.splitlines() if line.startswith("|")]
    assert len(tables) == 2 * (2 + 2)  # per task: header, rule, full row, streaming_llm row
    assert sum(line.startswith("| length | method |") for line in tables) == 2
    assert "| full % |" in report and "| KL | top-1 % | ppl ratio |" in report
    assert all(line.count("|") == tables[0].count("|") for line in tables[:4])
