"""Gemma 3 270M: every family at 50%, 25% and 12.5% of the global layers' bytes (sliding layers kept).

Gemma 3 interleaves five sliding-window layers (window 512) with one global layer; kvsum keeps the
sliding layers exactly as transformers does (they hold at most 511 tokens) and compresses the three
global layers. The budget governs the global layers (`global ratio`); `total ratio` is every byte held
(the sliding layers in the model's float32 dtype included) over the full cache at 16 bits.

Passkey and multi-key retrieval at 2k tokens, lm fidelity on a 2k-token prefix, query-agnostic.
One task per invocation (`--task`), so each locked run stays short; rows merge into
benchmarks/results/gemma/gemma.{json,md}.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from kvsum.budget import full_nbytes
from kvsum.errors import KVSumError
from kvsum.eval import run
from kvsum.methods import LayerInput, make_method

from .common import CALIBRATED, arguments, calibrated, info_line, keep_experiment, parse_method, run_info, start

METHODS = ["full", "streaming_llm", "snapkv", "restkv", "summary", "turboquant", "kivi"]
BUDGETS = [0.5, 0.25, 0.125]


def feasible(name: str, knobs: dict, budget: float, length: int, H: int = 1, d: int = 256) -> str | None:
    """None if `name` with `knobs` fits `budget` on a Gemma-shaped layer of `length` tokens, else kvsum's reason
    (whether bit widths or a code cover fit depends on the bytes alone, so random activations tell)."""
    x = LayerInput(keys=torch.randn(H, length, d), values=torch.randn(H, length, d), queries=torch.randn(4 * H, 64, d),
                   query_pos=torch.arange(length - 64, length), scale=d ** -0.5, layer_idx=0, n_layers=1,
                   budget_bytes=budget * full_nbytes(1, H, d, length), storage=torch.float16,
                   surprisal=torch.rand(length))
    try:
        make_method(name, **knobs).compress(x)
    except KVSumError as e:
        return str(e)
    return None


def label(row: dict) -> str:
    """A row's method as given on the command line: `name` or `name:knob=value,...` (the artifact path left out)."""
    knobs = {k: v for k, v in (row.get("knobs") or {}).items() if k != "artifact"}
    return row["method"] + (":" + ",".join(f"{k}={v}" for k, v in knobs.items()) if knobs else "")


def render(rows: list[dict], runs: list[dict], info: dict) -> str:
    parts = ["# Gemma 3 270M", "", info_line(info), "", __doc__.split("\n\n")[1].replace("\n", " "), "",
             "An empty cell: the method cannot fit that budget on this model (kvsum raises a KVSumError naming what "
             "fits; the messages are listed under Runs).", ""]
    for task in ("passkey", "multikey", "lm"):
        sub = [r for r in rows if r["task"] == task]
        if not sub:
            continue
        lm = task == "lm"
        what = "KL(full || compressed) nats, top-1 agreement %" if lm else "accuracy %"
        parts += [f"## {task} @ {sub[0]['length']} tokens ({what}; n = {sub[0]['n']})", ""]
        header = ["method"] + [f"{b:g}" for b in BUDGETS] + ["global ratio", "total ratio"]
        parts += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        for name in dict.fromkeys(label(r) for r in sub):
            mine = {r["budget"]: r for r in sub if label(r) == name}
            if name == "full":
                r = mine[1.0]
                cells = [f"{r['kl']:.3f} / {r['top1']:.0f}" if lm else f"{r['full_score']:.0f}"] * len(BUDGETS)
            else:
                cells = [(f"{mine[b]['kl']:.3f} / {mine[b]['top1']:.0f}" if lm else f"{mine[b]['score']:.0f}")
                         if b in mine else "" for b in BUDGETS]
            ratios = [mine[b] for b in ([1.0] if name == "full" else BUDGETS) if b in mine]
            cells += [" / ".join(f"{r['global_ratio']:.3f}" for r in ratios),
                      " / ".join(f"{r['ratio']:.3f}" for r in ratios)]
            parts.append("| " + " | ".join([name] + cells) + " |")
        parts.append("")
    parts += ["## Runs", ""]
    for r in runs:
        parts.append(f"- `{r['command']}` ({r['date']}, {r['wall_s']} s, threads {r['threads']})")
        parts += [f"  - refused: {x['method']} at {x['budget']:g}: {x['error']}" for x in r.get("refused", [])]
    parts.append("")
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> None:
    ap = arguments(__doc__, "gemma/gemma", threads=2)
    ap.set_defaults(model="gemma3-270m")
    ap.add_argument("--task", choices=["passkey", "multikey", "lm"], required=True)
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--n", type=int, default=6, help="examples")
    ap.add_argument("--methods", nargs="+", default=METHODS + list(CALIBRATED),
                    help="names or name:knob=value,... ; rows of other methods already in the results are kept")
    args = ap.parse_args(argv)
    model, tokenizer, t0 = start(args)
    methods, refused = [], []
    for given in args.methods:
        name, knobs = parse_method(given)
        why = {b: feasible(name, knobs, b, args.length) for b in BUDGETS} if name not in ("full", *CALIBRATED) else {}
        refused += [dict(method=given, budget=b, error=e) for b, e in why.items() if e]
        if name in CALIBRATED:
            knobs["artifact"] = str(calibrated(model, tokenizer))
        methods.append((name, knobs, [b for b in BUDGETS if not why.get(b)]))
    rows = run(model, tokenizer, args.task, methods, BUDGETS, [args.length], args.n)
    out = Path(args.out)
    js = out.with_name(out.name + ".json")
    old = json.loads(js.read_text()) if js.exists() else {"rows": [], "runs": []}
    info = run_info(args.model, args.threads, wall_s=round(time.perf_counter() - t0, 1), task=args.task)
    info["refused"] = refused
    info["methods"] = args.methods
    keep = [r for r in old["rows"] if r["task"] != args.task or label(r) not in args.methods]
    runs = [r for r in old["runs"] if r.get("task") != args.task
            or not set(r.get("methods", METHODS)) <= set(args.methods)] + [info]
    order = {"passkey": 0, "multikey": 1, "lm": 2}
    meta = keep_experiment({**info, "command": None, "commands": [r["command"] for r in runs]}, old.get("meta", {}))
    data = {"meta": meta,
            "rows": sorted(keep + rows, key=lambda r: order[r["task"]]),
            "runs": sorted(runs, key=lambda r: order[r["task"]])}
    js.parent.mkdir(parents=True, exist_ok=True)
    js.write_text(json.dumps(data, indent=1, default=str) + "\n")
    md = out.with_name(out.name + ".md")
    md.write_text(render(data["rows"], data["runs"], data["meta"]))
    print(md.read_text())


if __name__ == "__main__":
    main()
