"""What the performance runners (perf.py, perf_decode.py) share: timing, a method's prefill extras, and the writer
that merges rows of several runs into one result file."""

from __future__ import annotations

import json
import time
from pathlib import Path

from kvsum.methods import make_method, prefill_needs

from .common import commands_with, recorded_commands, run_info


def timed(fn):
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t


def needs(name: str) -> dict:
    return prefill_needs([make_method(name)])


def write_merged(part: str, rows: list[dict], lines, args, merge_key=None, record: bool = True) -> None:
    """Rows merged into `args.out`.json by `merge_key` (rows of other runs kept), the commands of every run merged
    listed; the markdown re-rendered by `lines`. `record=False` (re-rendering) keeps the stored meta."""
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    js = out.with_name(out.name + ".json")
    prev = json.loads(js.read_text()) if merge_key and js.exists() else {"meta": {}, "rows": []}
    keys = {merge_key(r) for r in rows} if merge_key else set()
    rows = [r for r in prev["rows"] if merge_key(r) not in keys] + rows
    info = run_info(args.model, args.threads)
    commands = recorded_commands(prev["meta"])
    info["commands"] = commands_with(commands, info["command"]) if record else commands
    if not record:
        info = {**prev["meta"], "commands": commands}
    js.write_text(json.dumps({"meta": info, "rows": rows}, indent=1) + "\n")
    md = [f"# perf {part} ({info['date']}, {args.threads} threads, {args.model})", "", *lines(rows), "",
          "Commands (rows merged by length): " + "; ".join(f"`{c}`" for c in info["commands"])]
    out.with_name(out.name + ".md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
