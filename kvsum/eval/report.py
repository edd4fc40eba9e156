"""Write evaluation rows as `stem.json` (rows + a meta header) and `stem.md` (one table per task)."""

from __future__ import annotations

import json
import platform
import sys
from datetime import datetime, timezone
from pathlib import Path

from ..spec import format_value


def meta(model: str | None = None, command: str | None = None, **extra) -> dict:
    import torch
    import transformers

    from .. import __version__

    out = dict(model=model, date=datetime.now(timezone.utc).isoformat(timespec="seconds"),
               kvsum=__version__, transformers=transformers.__version__, torch=torch.__version__,
               python=platform.python_version(), machine=platform.machine())
    if command is not None:
        out["command"] = command
    return {**out, **extra}


def _chosen(row: dict) -> str:
    """What a method configured by budget became (summary with no knobs), e.g. "by budget: summary+turboquant"."""
    return "by budget: " + " / ".join(row["chosen"]) if row.get("chosen") else ""


def knobs_text(knobs: dict) -> str:
    """Knobs as a row shows them; a method-valued knob in its spec form, `cover=turboquant(bits=3.5)`."""
    return ", ".join(f"{k}={format_value(v)}" for k, v in knobs.items())


def _mib(b: float) -> str:
    return f"{b / 2**20:.2f} MiB"


def _table(header: list[str], lines: list[list[str]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(cells) + " |" for cells in lines]
    return "\n".join(out)


def markdown(rows: list[dict], info: dict | None = None) -> str:
    """Markdown report: one table per task, the full cache's score on the same examples beside each score."""
    parts = ["# kvsum evaluation", ""]
    if info:
        parts += [", ".join(f"{k}: {v}" for k, v in info.items() if v is not None), ""]
    parts += ["Bytes held: mean `cache.nbytes()` right after compression; full bytes: the full cache at 16 bits "
              "(the budget unit). The full method keeps the model's own dtype, so its ratio can exceed 1.", ""]
    for task in dict.fromkeys(r["task"] for r in rows):
        sub = [r for r in rows if r["task"] == task]
        lm = "kl" in sub[0]
        parts.append(f"## {task}" + (" (KL(full || compressed) in nats over the teacher-forced continuation)" if lm
                                     else " (accuracy %, the full cache on the same examples beside it)"))
        parts.append("")
        score = ["KL", "top-1 %", "ppl ratio"] if lm else ["score %", "full %"]
        header = ["length", "method", "knobs", "budget", "n", *score, "bytes held", "full bytes", "ratio", "s/example"]
        lines = []
        for r in sub:
            vals = ([f"{r['kl']:.4f}", f"{r['top1']:.1f}", f"{r['ppl_ratio']:.4f}"] if lm
                    else [f"{r['score']:.0f}", f"{r['full_score']:.0f}"])
            knobs = knobs_text(r["knobs"]) or _chosen(r)
            lines.append([str(r["length"]), r["method"], knobs, f"{r['budget']:g}", str(r["n"]), *vals,
                          _mib(r["bytes"]), _mib(r["full_bytes"]), f"{r['ratio']:.3f}", f"{r['seconds']:.2f}"])
        parts += [_table(header, lines), ""]
    return "\n".join(parts)


def write(rows: list[dict], stem: str | Path, model: str | None = None, command: str | None = None,
          **extra) -> tuple[Path, Path]:
    """Write `stem.json` ({"meta": ..., "rows": ...}) and `stem.md`; returns both paths."""
    stem = Path(stem)
    stem.parent.mkdir(parents=True, exist_ok=True)
    info = meta(model, command, **extra)
    js, md = stem.with_name(stem.name + ".json"), stem.with_name(stem.name + ".md")
    js.write_text(json.dumps({"meta": info, "rows": rows}, indent=1, default=str) + "\n")
    md.write_text(markdown(rows, info))
    return js, md


if __name__ == "__main__":  # re-render a markdown report from its JSON: python -m kvsum.eval.report stem.json
    data = json.loads(Path(sys.argv[1]).read_text())
    print(markdown(data["rows"], data["meta"]))
