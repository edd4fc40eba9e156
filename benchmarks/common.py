"""What every benchmark runner shares: standard arguments, method specs, the run's meta and how results are written."""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

import kvsum
from kvsum.eval import write
from kvsum.eval.report import meta
from kvsum.stability import DTYPES

from .experiments import RESULTS
from .specs import method_rows, parse_method, parse_row

__all__ = ["RESULTS", "method_rows", "parse_method", "parse_row"]

REPO = Path(__file__).resolve().parent.parent
CONTEXT = {"experiment": None, "command": None}  # set by `python -m benchmarks run NAME` around each invocation


CALIBRATED = ("echokv", "lowrank")  # reconstruction methods: an artifact per model, from `kvsum calibrate`


def calibrated(model, tokenizer, method: str = "all") -> Path:
    """The model's calibration artifact serving `method`, where its methods look for it (kvsum.calibrate
    .find_artifact); calibrated and saved at the default path on first use, as `kvsum calibrate` does."""
    from kvsum.calibrate import calibrate, default_artifact_path, find_artifact
    from kvsum.shape import fingerprint

    fp = fingerprint(model)
    path = find_artifact(fp, method)
    if path is None:
        path = default_artifact_path(fp, method)
        calibrate(model, tokenizer, method=method).save(path)
    return path


def command() -> str:
    """The exact command line of this run: the runner and its arguments as `python -m benchmarks run` called it,
    else the process's own, a benchmark module as `python -m benchmarks.<name>` (run as a module, its argv[0] is
    the file's path, which `python` cannot run: the modules import their package relatively)."""
    return CONTEXT["command"] or shlex.join([*invocation(sys.argv[0]), *sys.argv[1:]])


def invocation(argv0: str) -> list[str]:
    """How to start the program `argv0` names: a module of this package by its module name."""
    path = Path(argv0).resolve()
    if path.suffix == ".py" and path.parent == Path(__file__).resolve().parent:
        return ["python", "-m", "benchmarks" if path.stem == "__main__" else f"benchmarks.{path.stem}"]
    return ["python", argv0]


def recorded_commands(record: dict) -> list[str]:
    """The commands a result file (or its meta) says its rows come from: its `commands`, else its one `command`."""
    return list(record.get("commands", [record["command"]] if "command" in record else []))


def commands_with(earlier: list[str], cmd: str) -> list[str]:
    """The commands of every run merged into one result file: `earlier`'s, then `cmd` (last, once)."""
    return [c for c in earlier if c != cmd] + [cmd]


def git_commit() -> str | None:
    """The checkout's commit, with "+dirty" when tracked files differ from it (None outside git)."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("+dirty" if dirty else "")


def run_info(model: str | None, threads: int | None, **extra) -> dict:
    """The meta every result file carries: experiment, command, date, versions, git commit, threads."""
    info = meta(model, command(), threads=threads, **extra)
    return {"experiment": CONTEXT["experiment"], **info, "commit": git_commit()}


def keep_experiment(meta: dict, earlier: dict) -> dict:
    """`meta` naming the experiment (and its `python -m benchmarks run` line) that `earlier`, the meta of the file
    a direct invocation merges into, names: a rerun of some rows keeps the file the experiment's."""
    for k in ("experiment", "run"):
        meta[k] = meta.get(k) or earlier.get(k)
    if meta["experiment"] and not meta["run"]:
        meta["run"] = f"python -m benchmarks run {meta['experiment']}"
    return meta


def info_line(info: dict) -> str:
    """The meta as one markdown line."""
    return ", ".join(f"{k}: {v}" for k, v in info.items() if v is not None and not isinstance(v, list | dict))


def arguments(doc: str, name: str, threads: int) -> argparse.ArgumentParser:
    """A parser with --model, --threads and --out (default benchmarks/results/<name>)."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--threads", type=int, default=threads)
    ap.add_argument("--out", default=str(RESULTS / name))
    return ap


def start(args):
    """Set the thread count, load the model (in --dtype, where the runner has it); returns (model, tokenizer, start
    time)."""
    torch.set_num_threads(args.threads)
    dtype = getattr(args, "dtype", None)
    model, tok = kvsum.load_model(args.model, **({"dtype": DTYPES[dtype]} if dtype else {}))
    return model, tok, time.perf_counter()


def finish(rows: list[dict], args, t0: float) -> None:
    """Write rows as JSON + markdown with the run's meta and wall time, and print the table."""
    info = run_info(args.model, args.threads, wall_s=round(time.perf_counter() - t0, 1))
    js, md = write(rows, args.out, **{k: v for k, v in info.items()})
    print(md.read_text())
    print(f"wrote {js} and {md}")


@torch.no_grad()
def paired_decode(model, caches: list, tokens: torch.Tensor, skip: int = 2) -> list[list[float]]:
    """Decode `tokens` (1, n) one at a time on top of every cache, step t of every cache back to back (order
    rotated), so the load of a shared machine hits them alike. Returns each cache's step seconds, aligned
    across caches, without the first `skip` steps (warm-up). The caches grow as in generate."""
    times = [[] for _ in caches]
    for t in range(tokens.shape[1]):
        order = list(range(len(caches)))
        for i in order[t % len(order):] + order[:t % len(order)]:
            t0 = time.perf_counter()
            model(tokens[:, t:t + 1], cache=caches[i])
            times[i].append(time.perf_counter() - t0)
    return [ts[skip:] for ts in times]


def paired_medians(times: list[list[float]]) -> tuple[list[float], list[float]]:
    """Per cache: the median step seconds and the median over steps of its step time over the first cache's."""
    return ([statistics.median(ts) for ts in times],
            [statistics.median(a / b for a, b in zip(ts, times[0])) for ts in times])


def write_page(rows: list[dict], args, t0: float, title: str, table: list[str], **extra) -> None:
    """JSON rows (+ extra keys) and a markdown page (title, the run's meta, table), for tables that are not the
    eval runner's rows."""
    stem = Path(args.out)
    stem.parent.mkdir(parents=True, exist_ok=True)
    info = run_info(args.model, args.threads, wall_s=round(time.perf_counter() - t0, 1))
    data = json.dumps({"meta": info, "rows": rows, **extra}, indent=1, default=str)
    stem.with_name(stem.name + ".json").write_text(data + "\n")
    md = [f"# {title}", "", info_line(info), "", *table, ""]
    stem.with_name(stem.name + ".md").write_text("\n".join(md))
    print("\n".join(md))
