"""Every result file carries its experiment, command, date, versions and commit: `stamp` adds what a runner's own
meta lacks after a run (the kvsum CLI's writers, check_report), `recover` did so once for the files committed
before the registry, from git (marked as recovered). Numbers are never touched: JSON is re-dumped as loaded, the
markdown gets one line after its title."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from .common import REPO, git_commit
from .experiments import Experiment

MARK = "experiment: "


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=30).stdout.strip()


def _indent(text: str) -> int | None:
    second = text.split("\n", 2)[1] if text.count("\n") > 1 else ""
    return len(second) - len(second.lstrip(" ")) or None


def add_meta(path: Path, fields: dict) -> dict:
    """Merge `fields` into the JSON file's "meta" (a list becomes {"meta", "rows"}), keeping what is there."""
    text = path.read_text()
    data = json.loads(text)
    if not isinstance(data, dict):
        data = {"rows": data}
    meta = data.get("meta") if isinstance(data.get("meta"), dict) else {}
    merged = {**fields, **{k: v for k, v in meta.items() if v is not None}}
    merged.update({k: v for k, v in fields.items() if k in ("experiment", "run")})
    data = {"meta": merged, **{k: v for k, v in data.items() if k != "meta"}}
    path.write_text(json.dumps(data, indent=_indent(text)) + ("\n" if text.endswith("\n") else ""))
    return merged


def add_line(path: Path, meta: dict) -> None:
    """One line under the markdown's title: experiment, command to rerun, date, commit (replaced if there)."""
    keys = ("experiment", "run", "date", "commit", "kvsum", "torch", "transformers", "threads")
    line = MARK + ", ".join(f"{k}: {meta[k]}" for k in keys if meta.get(k) is not None and k != "experiment")
    line = f"{MARK}{meta['experiment']}, " + line[len(MARK):]
    lines = path.read_text().split("\n")
    lines = [x for x in lines if not x.startswith(MARK)]
    at = 1 if lines and lines[0].startswith("#") else 0
    lines[at:at] = ["", line] if at else [line, ""]
    path.write_text("\n".join(lines))


def stamp(exp: Experiment, root: Path, recovered: dict | None = None) -> None:
    """Add the experiment's meta to its result files under `root` (a fresh run: the checkout's commit)."""
    main = exp.path(root)
    if not main.exists():
        return
    fields = dict(experiment=exp.name, run=exp.command(), commit=git_commit())
    if recovered:
        fields.update(recovered)
    md = main.with_suffix(".md")
    if main.suffix == ".json":
        meta = add_meta(main, fields)
        if md.exists():
            add_line(md, meta)


def recovered_fields(path: Path, exp: Experiment, versions: dict, git_path: str | None = None) -> dict:
    """What git tells of a committed file: the commit that last wrote it (following renames), its date, and the
    registry's command; versions and threads from `versions` where the file has none (marked). `git_path`: the
    path git knows the file by, where it moved since its last commit."""
    log = _git("log", "-1", "--follow", "--format=%H %cI", "--", git_path or str(path.relative_to(REPO))).split()
    commit, date = (log + [None, None])[:2]
    data = json.loads(path.read_text())
    meta = data.get("meta", {}) if isinstance(data, dict) else {}
    missing = [k for k in ("date", "command", "kvsum", "torch", "transformers", "threads") if not meta.get(k)]
    out = dict(commit=commit and commit[:12], recovered={"from": "git log of the file, after the run",
                                                         "fields": ["commit", *missing]})
    out["date"] = date
    own = data.get("command") if isinstance(data, dict) else None  # kvsum CLI files keep it at the top
    runs = data.get("runs") if isinstance(data, dict) else None  # files merged from several runs list them
    if runs:
        out["commands"] = [r["command"] for r in runs]
    out["command"] = own or (meta.get("commands") or [None])[0] or (None if runs else exp.command())
    if exp.threads is not None:
        out["threads"] = exp.threads
    out.update({k: v for k, v in versions.items()})
    return out
