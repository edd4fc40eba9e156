"""The frontier (issue 32): bytes held against retrieval and lm KL across budgets, the flagship beside each family.

One configuration per family (default: `summary`, the flagship, configured by budget; `snapkv`, eviction;
`turboquant`, quantization at the widest codes that fit; `echokv`, reconstruction; `snapkv+turboquant:key_shift=1`,
composition), each at every budget, with the full cache once per length: passkey and multikey accuracy (%, the full
cache's beside it, --n examples each) and lm KL(full || compressed) in nats (--n-lm examples), and the bytes held
as a ratio of the full 16-bit cache. A configuration that refuses a budget (its codes or kept tokens do not fit) is
recorded as a refusal, not a crash. Writes <out>.json (meta, rows, command) and <out>.md (one table per length:
a row per configuration, a column per budget; under it what the flagship became at each budget).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

import kvsum
from kvsum.eval import run

from .common import CALIBRATED, arguments, calibrated, command, commands_with, info_line, recorded_commands, run_info
from .specs import parse_row

METHODS = ("summary", "snapkv", "turboquant", "echokv", "snapkv+turboquant:key_shift=1")
BUDGETS = (0.03, 0.05, 0.1, 0.125, 0.25, 0.5)
RETRIEVAL = ("passkey", "multikey")
LM = "lm"


def _groups(n: int, n_lm: int) -> list[tuple[list[str], int]]:
    """(tasks, examples) per call of the runner: retrieval at n, lm at n_lm (a count of 0 skips its tasks)."""
    return [(ts, k) for ts, k in ((list(RETRIEVAL), n), ([LM], n_lm)) if k > 0]


def _configs(specs: list[str], budgets: list[float]) -> tuple[list, list[str]]:
    """(the runner's configurations: the full cache, then each spec at each of its budgets; the spec string of
    each row the runner returns per task and length, in its order). A spec's own budgets after `@` limit it."""
    methods, labels = ["full"], ["full"]
    for s in specs:
        name, knobs, own = parse_row(s)
        mine = [b for b in budgets if own is None or b in own]
        if mine:
            methods.append((name, knobs, mine))
            labels += [s] * len(mine)
    return methods, labels


def measure(model, tok, specs, budgets, lengths, n: int, n_lm: int, seed: int = 0,
            progress: bool = False) -> list[dict]:
    """Rows for the full cache and every spec at every budget and length; each row is the runner's (score,
    full_score, kl, ratio, bytes, n, chosen) plus `config` (the spec string), or a refusal (`refused`: the error's
    first line). Each example is prefilled once for every configuration."""
    methods, labels = _configs(specs, budgets)  # the runner fails on a bad name or knob before any prefill
    rows = []
    for length in lengths:
        for tasks, k in _groups(n, n_lm):
            got = run(model, tok, tasks, methods, budgets, [length], k, seed=seed, progress=progress, refusals=True)
            for i, r in enumerate(got):  # task-major, then the configurations in order
                r.update(config=labels[i % len(labels)], length=length)
            rows += got
    return rows


def _fmt(x: float | None, digits: int = 0) -> str:
    return "–" if x is None else f"{x:.{digits}f}"


def cell(rows: list[dict]) -> str:
    """One table cell from a configuration's rows at one length and budget: "passkey / multikey (full) · KL",
    bytes held over the full 16-bit cache, the examples; "refuses" where it refused."""
    if not rows:
        return ""
    if any("refused" in r for r in rows):
        return "refuses"
    by = {r["task"]: r for r in rows}
    ret = [by.get(t) for t in RETRIEVAL]
    text = " / ".join(_fmt(r and r["score"]) for r in ret) + " (" + " / ".join(
        _fmt(r and r["full_score"]) for r in ret) + ")"
    if LM in by:
        text += f" · KL {by[LM]['kl']:.4f}"
    ratio = next(r["ratio"] for r in rows)
    ns = "/".join(str(r["n"]) for r in [*ret, by.get(LM)] if r)
    return f"{text} · {ratio:.3f}× bytes, n = {ns}"


def table(rows: list[dict], length: int, specs: list[str], budgets: list[float]) -> list[str]:
    """Markdown for one length: one line per configuration (full first), one column per budget, then a line
    naming what a spec configured by budget (`summary` with no knobs) became at each budget."""
    here = [r for r in rows if r["length"] == length]
    full = cell([r for r in here if r["config"] == "full"])
    lines = [f"| configuration | {' | '.join(f'{b:g}' for b in budgets)} |", "|---" * (len(budgets) + 1) + "|",
             f"| `full` | {' | '.join(full for _ in budgets)} |"]
    notes = []
    for s in specs:
        mine = [r for r in here if r["config"] == s]
        lines.append(f"| `{s}` | " + " | ".join(cell([r for r in mine if r["budget"] == b]) for b in budgets) + " |")
        became = [(b, sorted({c for r in mine if r["budget"] == b for c in r.get("chosen", [])})) for b in budgets]
        if any(c for _, c in became):
            notes.append(f"`{s}` became: " + "; ".join(f"{b:g}: {', '.join(f'`{c}`' for c in cs)}"
                                                         for b, cs in became if cs) + ".")
    return lines + ([""] + notes if notes else [])


def render(rows: list[dict], info: dict, commands: list[str], specs: list[str], budgets: list[float]) -> str:
    """The markdown page: the commands the rows come from and meta on top, then a table per length."""
    lines = ["# Frontier: bytes held against retrieval and lm KL", "", "; ".join(f"`{c}`" for c in commands),
             "", info_line(info), "",
             "Cells: passkey / multikey accuracy % (the full cache's) · lm KL(full || compressed) nats · bytes held "
             "over the full 16-bit cache (the full cache in float32 holds 2×), n = examples per task; \"refuses\": "
             "the budget is below what the configuration can hold.", ""]
    for length in sorted({r["length"] for r in rows}):
        lines += [f"## {length} tokens", "", *table(rows, length, specs, budgets), ""]
    return "\n".join(lines)


def merge(rows: list[dict], out: str, specs: list[str], budgets: list[float]):
    """(rows, specs, budgets, earlier commands) with <out>.json's rows of the cells this run did not measure (a
    task, configuration, length and budget; the full cache is a cell of its own, rerun with every run) kept
    beside this run's, for a rerun of some configurations, budgets or tasks (a flagship changed at one budget, a
    retrieval-only rerun) without the rest."""
    js = Path(out).with_name(Path(out).name + ".json")
    if not js.exists():
        return rows, specs, budgets, []
    old = json.loads(js.read_text())

    def key(r):
        return r["task"], r["config"], r["length"], r["budget"]

    done = {key(r) for r in rows}
    kept = [r for r in old["rows"] if key(r) not in done]
    order = list(dict.fromkeys([*(r["config"] for r in old["rows"] if r["config"] != "full"), *specs]))
    return (kept + rows, order, sorted({*budgets, *(r["budget"] for r in kept if r["config"] != "full")}),
            recorded_commands(old))


def write(rows: list[dict], info: dict, out: str, specs: list[str], budgets: list[float],
          earlier: list[str] = ()) -> tuple[Path, Path]:
    """<out>.json (meta, rows, command: this run's; commands: every run the rows come from) and <out>.md."""
    stem = Path(out)
    stem.parent.mkdir(parents=True, exist_ok=True)
    cmd = command()
    commands = commands_with(list(earlier), cmd)
    js, md = stem.with_name(stem.name + ".json"), stem.with_name(stem.name + ".md")
    js.write_text(json.dumps({"meta": info, "rows": rows, "command": cmd, "commands": commands}, indent=1,
                             default=str) + "\n")
    md.write_text(render(rows, info, commands, specs, budgets))
    return js, md


def parser():
    """The command line: --model, --threads, --out, --length (several), --n, --n-lm, --budgets, --methods, --seed,
    --merge."""
    ap = arguments(__doc__, "frontier/frontier", threads=1)
    ap.add_argument("--length", "--lengths", dest="lengths", type=int, nargs="+", default=[2048])
    ap.add_argument("--n", type=int, default=20, help="passkey and multikey examples each")
    ap.add_argument("--n-lm", type=int, default=8, help="lm examples")
    ap.add_argument("--budgets", type=float, nargs="+", default=list(BUDGETS))
    ap.add_argument("--methods", nargs="+", default=list(METHODS), help="spec strings (name:knob=value,...)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--merge", action="store_true", help="keep the cells (task, configuration, length, budget) "
                    "of --out.json this run does not measure (rerun some of them on the same examples)")
    return ap


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tok = kvsum.load_model(args.model)
    for name in sorted({parse_row(s)[0] for s in args.methods} & set(CALIBRATED)):
        calibrated(model, tok, name)  # a fresh machine runs the frontier in one command
    t0 = time.perf_counter()
    rows = measure(model, tok, args.methods, args.budgets, args.lengths, args.n, args.n_lm, args.seed, progress=True)
    info = run_info(args.model, args.threads, wall_s=round(time.perf_counter() - t0, 1))
    specs, budgets, earlier = args.methods, args.budgets, []
    if args.merge:
        rows, specs, budgets, earlier = merge(rows, args.out, specs, budgets)
    js, md = write(rows, info, args.out, specs, budgets, earlier)
    print(md.read_text())
    print(f"wrote {js} and {md}")


if __name__ == "__main__":
    main()
