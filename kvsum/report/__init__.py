"""`kvsum report`: the decision report a serving team acts on.

Accuracy against bytes held (kvsum.eval tasks), short-context throughput, compression overhead and decode
time against context length, operational complexity, numerical stability (kvsum.stability's results) and
recommendations derived by the documented rules in `rules.py`. Every measured unit is cached (see
`specs.Store`), so a long report is built by repeating the same command until it says it is complete.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from . import render, rules
from .evaluate import evaluate
from .perf import from_files, scaling, throughput
from .specs import Store, label, method_specs
from .stability import markdown as stability_markdown

__all__ = ["Settings", "build", "method_specs"]


@dataclass
class Settings:
    model: str = "smollm2"
    methods: list[str] = field(default_factory=lambda: ["all"])
    budgets: list[float] = field(default_factory=lambda: [0.5, 0.25, 0.125, 0.0625])
    tasks: list[str] = field(default_factory=lambda: ["lm", "passkey", "multikey"])
    length: int = 2048
    n: int = 3
    seed: int = 0
    perf_budget: float = 0.25
    short_lengths: list[int] = field(default_factory=lambda: [128, 512])
    new_tokens: int = 32
    scaling_lengths: list[int] = field(default_factory=lambda: [1024, 2048, 4096])
    timings: str = "auto"  # auto: benchmarks/perf.py's results if all present, else measure; measure; files; none
    threads: int = 2
    perf_dir: str = "benchmarks/results/perf"


BYTES = "bytes / 16-bit full cache"  # what every bytes ratio of the report is a fraction of


def _f(v, spec=".3f", none="-"):
    return none if v is None else format(v, spec)


def _bytes(r: dict, info: dict) -> str:
    """A row's bytes ratio; the full cache's row names its dtype (fp32 entries hold twice the 16-bit bytes)."""
    dtype = info.get("dtype")
    return f"{r['ratio']:.3f}" + (f" ({dtype} entries)" if r["method"] == "full" and dtype else "")


def build(s: Settings, out_dir: Path, store: Store, deadline: float | None = None, progress: bool = True,
          stability_json: Path | None = None, reconstruct_json: Path | None = None, command: str | None = None,
          model=None, tokenizer=None) -> dict:
    """Measure what is missing (until `deadline`), then write report.html/.md/.json into `out_dir`."""
    import torch

    from ..eval.report import meta
    from ..extras import progress as progress_bar

    specs, notes = method_specs(s.methods, s.model)
    eval_specs = [("full", {})] + [sp for sp in specs if sp[0] != "full"]
    perf_specs = [sp for sp in specs if sp[0] != "full"]
    if model is None:
        from ..models import load_model

        model, tokenizer = load_model(s.model)
    torch.set_num_threads(s.threads)
    n_cfg = 1 + len(perf_specs) * len(s.budgets)
    total = len(s.tasks) * s.n * n_cfg
    files = from_files(Path(s.perf_dir), s.perf_budget) if s.timings in ("auto", "files") else None
    measure = s.timings == "measure" or (s.timings == "auto" and files is None)
    if measure:
        total += len(perf_specs) * (len(s.short_lengths) + len(s.scaling_lengths))
    t0 = time.time()
    with progress_bar("report", total, enabled=progress) as bar:
        def tick(desc):
            bar.advance(desc)

        rows, ok_eval, errors = evaluate(model, tokenizer, s.model, s.tasks, eval_specs, s.budgets, s.length, s.n,
                                         s.seed, store, deadline, tick)
        tp, sc, ok_tp, ok_sc = [], [], True, True
        if files is not None:
            tp, sc, _ = files
        elif s.timings == "files":
            errors["timings"] = f"--timings files: no perf_short/overhead/decode.json in {s.perf_dir}"
        if measure:
            tp, ok_tp = throughput(model, tokenizer, s.model, perf_specs, s.perf_budget, s.short_lengths, s.new_tokens,
                                   s.threads, store, deadline, tick, errors)
            sc, ok_sc = scaling(model, tokenizer, s.model, perf_specs, s.perf_budget, s.scaling_lengths, s.threads,
                                store, deadline, tick, errors)
    complete = ok_eval and ok_tp and ok_sc
    stab = json.loads(stability_json.read_text()) if stability_json and stability_json.is_file() else None
    comp = rules.complexity(perf_specs, rows, sc, reconstruct_json)
    recs = rules.recommend(rows, comp, tp, sc, stab)
    info = meta(s.model, command, settings=asdict(s), complete=complete, cached=store.hits,
                computed=store.misses, wall_s=round(time.time() - t0, 1))
    info["timing_source"] = files[2] if files else ("measured" if measure else None)
    info["dtype"] = str(getattr(model, "dtype", "")).removeprefix("torch.")
    blocks = _blocks(s, rows, tp, sc, comp, recs, stab, notes, errors, info, [label(*sp) for sp in eval_specs])
    html_path, md_path = render.render(blocks, out_dir, f"kvsum decision report: {s.model}")
    data = dict(meta=info, rows=rows, throughput=tp, scaling=sc, complexity=comp, recommendations=recs,
                errors=errors, notes=notes)
    (out_dir / "report.json").write_text(json.dumps(data, indent=1, default=str) + "\n")
    return dict(complete=complete, html=html_path, md=md_path, rows=len(rows), cached=store.hits,
                computed=store.misses, errors=errors)


def _blocks(s: Settings, rows, tp, sc, comp, recs, stab, notes, errors, info, methods) -> list[tuple]:
    b: list[tuple] = []
    status = "complete" if info["complete"] else "**incomplete** (run the same command again to finish)"
    b.append(("p", f"Model `{s.model}`, {info['date']}, kvsum {info['kvsum']}, torch {info['torch']}, "
                   f"transformers {info['transformers']}, {s.threads} threads. Report {status}."))
    if info.get("command"):
        b.append(("p", f"Command: `{info['command']}`"))
    b.append(("p", f"Evaluation: tasks {', '.join(s.tasks)} at {s.length} tokens, n = {s.n} examples per task "
                   f"(seed {s.seed}), budgets {', '.join(f'{x:g}' for x in s.budgets)}. Budgets and bytes are "
                   "fractions of the full cache at 16 bits; bytes held is `cache.nbytes()` after compression. "
                   f"The full cache itself keeps the model's dtype ({info.get('dtype') or '?'}), so its ratio is the "
                   "size of that dtype over 16 bits (2 for fp32). "
                   "Retrieval scores are accuracy %, beside the full cache on the same examples; lm scores are "
                   "KL(full || compressed) over 128 teacher-forced tokens. With n this small a retrieval score moves "
                   f"in steps of {100 / s.n:.0f} points: read the plots for trends, not single points."))
    b.append(("h2", "Recommendations"))
    b.append(("p", "Rules (applied in order to the numbers below; thresholds are constants in "
                   "`kvsum/report/rules.py`):"))
    b.append(("list", [f"R{i + 1}. {r}" for i, r in enumerate(rules.RULES)]))
    b.append(("table", ["case", "recommendation", "numbers it rests on"],
              [[r["case"], r["advice"], r["evidence"]] for r in recs]))
    b.append(("h2", "Accuracy against bytes held"))
    rows = [dict(r, method=label(r["method"], r.get("knobs") or {})) for r in rows]  # a configuration's spec
    for task in s.tasks:
        if any(r["task"] == task for r in rows):
            b.append(("plot", f"pareto_{task}", render.pareto(rows, task, methods)))
    for task in s.tasks:
        sub = [r for r in rows if r["task"] == task]
        if not sub:
            continue
        lm = "kl" in sub[0]
        head = ["method", "budget", BYTES] + (["KL", "top-1 %", "ppl ratio"] if lm else ["score %", "full %"]) \
            + ["compress s"]
        b.append(("p", f"**{task}**"))
        b.append(("table", head, [[r["method"], f"{r['budget']:g}", _bytes(r, info)]
                                  + ([f"{r['kl']:.4f}", f"{r['top1']:.1f}", f"{r['ppl_ratio']:.4f}"] if lm
                                     else [f"{r['score']:.0f}", f"{r['full_score']:.0f}"])
                                  + [f"{r['compress_s']:.2f}"] for r in sub]))
    src = info.get("timing_source")
    if src:
        b.append(("h2", "Throughput and overhead"))
        if src == "measured":
            b.append(("p", "Measured by this report; each method's number and the full cache's were taken in the same "
                           f"unit of work, so the ratios come from one run. Methods at budget {s.perf_budget:g}. "
                           "Throughput: one request = prefill (+ kvsum prefill and compression) + "
                           f"{s.new_tokens} greedy tokens, best of 2. Decode step: median of 5."))
        else:
            b.append(("p", "From the performance benchmarks (`benchmarks/perf.py`, each part one locked run, ratios "
                           "within a run): " + ", ".join(f"`{x}`" for x in src) + f". Budget {s.perf_budget:g}; "
                           "throughput over 64 generated tokens, the policy row is `kvsum.generate` with the "
                           "default Policy; decode steps are medians over round-robin steps. They cover the methods "
                           "that benchmark measures."))
        if tp:
            b.append(("plot", "throughput", render.throughput_bars(tp)))
            b.append(("table", ["prompt", "method", "tok/s", "full tok/s", "ratio", BYTES],
                      [[r["length"], r["method"], _f(r["tok_s"], ".1f"), _f(r["full_tok_s"], ".1f"),
                        _f(r["ratio_to_full"], ".2f"), _f(r["bytes_ratio"])] for r in tp]))
        if sc:
            b.append(("plot", "overhead", render.scaling_plot(
                sc, "overhead", "(kvsum prefill + compress) / plain prefill", "compression overhead against length")))
            b.append(("plot", "decode", render.scaling_plot(
                sc, "step_ms", "decode step, ms", "decode step against context length", full_key="full_step_ms")))
            b.append(("table", ["length", "method", "prefill s", "compress s", "overhead", "step ms", "full step ms",
                                "decode ratio"],
                      [[r["length"], r["method"], _f(r["prefill_s"], ".2f"), _f(r["compress_s"], ".2f"),
                        _f(r["overhead"], ".2f"), _f(r["step_ms"], ".1f"), _f(r["full_step_ms"], ".1f"),
                        _f(r["decode_ratio"], ".2f")] for r in sc]))
    b.append(("h2", "Operational complexity"))
    b.append(("table", ["method", "family", "knobs", "prefill must capture", "calibration", "training",
                        f"compress s ({s.length} tok)", "decode ratio"],
              [[c["method"], c["family"], f"{len(c['knobs'])}: {', '.join(c['knobs'])}",
                ", ".join(c["prefill_extras"]) or "-",
                "none" if c["calibration"] is None else
                f"{_f(c['calibration']['seconds'], '.0f')} s on {c['calibration'].get('tokens')} tokens, artifact "
                f"{_f((c['calibration']['nbytes'] or 0) / 2**20, '.1f')} MiB",
                c["training"], _f(c["compress_s"], ".2f"),
                _f(c["decode_ratio"], ".2f") + (f" @ {c['decode_length']}" if c["decode_ratio"] else "")]
               for c in comp]))
    b.append(("h2", "Numerical stability"))
    if stab:
        st = stab["summary"]
        b.append(("p", "From `kvsum stability` (benchmarks/results/stability/stability.json): "
                  + stab.get("command", "")))
        b.append(("plot", "stability_layers", render.stability_layers(st)))
        b.append(("plot", "stability_methods", render.stability_methods(st)))
        text = stability_markdown(stab)
        for para in text.split("\n\n")[1:]:
            lines = para.strip().splitlines()
            if lines and lines[0].startswith("|"):
                header = [c.strip() for c in lines[0].strip("|").split("|")]
                body = [[c.strip() for c in ln.strip("|").split("|")] for ln in lines[2:]]
                b.append(("table", header, body))
            elif lines and lines[0].startswith("- "):
                b.append(("list", [ln[2:] for ln in lines]))
            elif lines:
                b.append(("p", " ".join(lines)))
    else:
        b.append(("p", "No stability results: run `kvsum stability` first."))
    if notes or errors:
        b.append(("h2", "Left out"))
        b.append(("list", notes + [f"{k}: {v}" for k, v in errors.items()]))
    return b
