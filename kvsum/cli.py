"""The `kvsum` command line: argument parsing and printing only; the work is in the public API."""

from __future__ import annotations

import argparse
import sys
import time

from .errors import KVSumError


def _budgets(text: str) -> list[float]:
    from .budget import check_budget

    try:
        values = [float(v) for v in text.split(",")]
    except ValueError:
        raise KVSumError(f"--budget must be comma-separated numbers in (0, 1], got {text!r}") from None
    return [check_budget(v) for v in values]


def _ints(text: str, name: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise KVSumError(f"{name} must be comma-separated integers, got {text!r}") from None
    if any(v <= 0 for v in values):
        raise KVSumError(f"{name} must be positive, got {text!r}")
    return values


def cmd_methods(args) -> None:
    import kvsum

    for name, line in kvsum.methods().items():
        print(f"{name:20s} {line}")


def cmd_demo(args) -> None:
    from rich.console import Console
    from rich.table import Table

    from .demo import run_demo

    console = Console()
    with console.status("loading the bundled model (the first run converts it once, ~30 s)"):
        import kvsum

        model, tok = kvsum.load_model(args.model)
    result = run_demo(model, tok, method=args.method, budget=args.budget, tokens=args.tokens, console=console)
    table = Table(title=f"kvsum demo: {result['tokens']} tokens, method {result['method']} at budget {args.budget}")
    table.add_column("")
    table.add_column(f"full cache ({str(model.dtype).removeprefix('torch.')})", justify="right")
    table.add_column(f"{result['method']}", justify="right")
    table.add_row("full cache at 16 bits", f"{result['full16_bytes'] / 2**20:.2f} MiB", "")
    table.add_row("bytes held", f"{result['full_bytes'] / 2**20:.2f} MiB",
                  f"{result['bytes'] / 2**20:.2f} MiB ({result['bytes'] / result['full16_bytes']:.3f} of fp16)")
    table.add_row("prefill / compress time", f"{result['prefill_s']:.2f} s", f"+{result['compress_s']:.2f} s")
    for qa in result["answers"]:
        table.add_row(f"{qa['cue']!r} (expect {qa['expected']})", qa["full"], qa["compressed"])
    table.add_row("answer time (all questions)", f"{result['full_answer_s']:.2f} s", f"{result['answer_s']:.2f} s")
    console.print(table)


def cmd_eval(args) -> None:
    import kvsum
    from kvsum.eval.runner import run, write

    methods = [m.strip() for m in args.method.split(",")]
    for m in methods:
        if m not in kvsum.methods():
            raise KVSumError(f"unknown method {m!r}; accepted: {', '.join(kvsum.methods())}")
    budgets = _budgets(args.budget)
    lengths = _ints(args.lengths, "--lengths")
    model, tok = kvsum.load_model(args.model)
    limit = model.config.max_position_embeddings
    if max(lengths) > limit:
        raise KVSumError(f"--lengths {max(lengths)} is longer than the model's window ({limit})")
    t = time.time()
    rows = run(model, tok, args.task, methods, budgets, lengths, args.n, seed=args.seed, progress=True)
    stem = args.out or f"benchmarks/results/eval_{args.task}"
    js, md = write(rows, stem, model=args.model, command="kvsum " + " ".join(sys.argv[1:]))
    print(md.read_text())
    print(f"wrote {js} and {md} in {time.time() - t:.0f} s")


def cmd_calibrate(args) -> None:
    from pathlib import Path

    import kvsum
    from kvsum.calibrate import calibrate
    from kvsum.models import cache_dir

    text = None
    if args.text is not None:
        path = Path(args.text)
        if not path.is_file():
            raise KVSumError(f"--text {args.text!r} is not a readable file")
        text = path.read_text(errors="replace")
        if not text.strip():
            raise KVSumError(f"--text {args.text!r} is empty")
    model, tok = kvsum.load_model(args.model)
    art = calibrate(model, tok, text=text, method=args.method, tokens=args.tokens)
    out = Path(args.out) if args.out else cache_dir() / f"{Path(args.model).name}-reconstruct.kvsum"
    art.save(out)
    m = art.meta
    print(f"calibrated {', '.join(m['methods'])} for {args.model} in {m['seconds']:.0f} s; "
          f"artifact {m['nbytes'] / 2**20:.1f} MiB, {m['n_knobs']} knobs -> {out}")


def _dtype_prompts(text: str) -> dict[str, int]:
    out = {}
    for item in filter(None, text.split(",")):
        name, _, count = item.partition("=")
        try:
            out[name.strip()] = int(count)
        except ValueError:
            raise KVSumError(f"--dtype-prompts must look like fp16=1,bf16=2, got {text!r}") from None
    return out


def cmd_stability(args) -> None:
    import json
    from pathlib import Path

    from .models import cache_dir
    from .report.specs import Store, method_specs
    from .stability import Settings, markdown, run

    settings = Settings(model=args.model, dtypes=[d.strip() for d in args.dtypes.split(",")], prompts=args.prompts,
                        prompt_tokens=args.prompt_tokens, new_tokens=args.new_tokens,
                        budget=_budgets(args.budget)[0], seed=args.seed,
                        dtype_prompts=_dtype_prompts(args.dtype_prompts),
                        onepass=[d.strip() for d in args.onepass.split(",") if d.strip()]).check()
    specs, notes = method_specs([m.strip() for m in args.method.split(",")], args.model, skip=("full",))
    store = Store(Path(args.cache) if args.cache else cache_dir() / "stability", fresh=args.fresh)
    deadline = time.time() + args.time_limit if args.time_limit else None
    result = run(settings, specs, store, deadline=deadline, threads=args.threads)
    result["notes"] = notes
    result["command"] = "kvsum " + " ".join(sys.argv[1:])
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    md = markdown(result) + "".join(f"\n- {n}" for n in notes) + f"\n\nCommand: `{result['command']}`\n"
    out.with_suffix(".md").write_text(md)
    print(md)
    print(f"wrote {out}.json and {out}.md ({store.hits} cached results reused, "
          f"{'complete' if result['complete'] else 'INCOMPLETE: run again to finish'})")


def cmd_report(args) -> None:
    from pathlib import Path

    from .models import cache_dir
    from .report import Settings, build
    from .report.specs import Store

    tasks = [t.strip() for t in args.task.split(",")]
    from .eval.tasks import TASKS

    for t in tasks:
        if t not in TASKS:
            raise KVSumError(f"--task {t!r} is unknown; accepted: {', '.join(TASKS)}")
    s = Settings(model=args.model, methods=[m.strip() for m in args.methods.split(",")], budgets=_budgets(args.budgets),
                 tasks=tasks, length=_ints(args.length, "--length")[0], n=args.n, seed=args.seed,
                 perf_budget=_budgets(args.perf_budget)[0], short_lengths=_ints(args.short_lengths, "--short-lengths"),
                 new_tokens=args.new_tokens, scaling_lengths=_ints(args.scaling_lengths, "--scaling-lengths"),
                 timings=args.timings, threads=args.threads)
    store = Store(Path(args.cache) if args.cache else cache_dir() / "report", fresh=args.fresh)
    deadline = time.time() + args.time_limit if args.time_limit else None
    out = build(s, Path(args.out), store, deadline=deadline, stability_json=Path(args.stability),
                reconstruct_json=Path("benchmarks/results/reconstruct.json"),
                command="kvsum " + " ".join(sys.argv[1:]))
    state = "complete" if out["complete"] else "INCOMPLETE: run the same command again to resume"
    print(f"wrote {out['html']} and {out['md']}: {out['rows']} rows, {out['cached']} cached results reused, "
          f"{out['computed']} not cached before this run; {state}")
    for k, v in out["errors"].items():
        print(f"  error {k}: {v}")


def cmd_bench(args) -> None:
    import json
    from pathlib import Path

    import torch

    import kvsum
    from kvsum.breakeven import markdown, measure

    methods = [m.strip() for m in args.methods.split(",")]
    lengths = _ints(args.lengths, "--lengths")
    from kvsum.methods.base import make_method

    for m in methods:
        make_method(m)  # unknown names fail before the model loads
    budget = _budgets(args.budget)[0]
    if args.new_tokens < 1:
        raise KVSumError(f"--new-tokens must be >= 1, got {args.new_tokens}")
    torch.set_num_threads(args.threads)
    model, tok = kvsum.load_model(args.model)
    table = measure(model, tok, methods, lengths, new_tokens=args.new_tokens, budget=budget, rounds=args.rounds,
                    progress=True)
    table["model"], table["command"] = args.model, "kvsum " + " ".join(sys.argv[1:])
    table["date"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(table, indent=1) + "\n")
    md = markdown(table) + f"\nCommand: `{table['command']}` ({table['date']})\n"
    out.with_suffix(".md").write_text(md)
    print(md)
    print(f"wrote {out}.json and {out}.md; use it with kvsum.Policy(table='{out}.json')")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvsum", description="Compress the KV cache of transformers models.")
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("methods", help="list the compression methods").set_defaults(fn=cmd_methods)
    d = sub.add_parser("demo", help="compress a long document on the bundled model and answer questions")
    d.add_argument("--model", default="smollm2")
    d.add_argument("--method", default=None, help="default: the best method available")
    d.add_argument("--budget", type=float, default=0.25)
    d.add_argument("--tokens", type=int, default=2000, help="document length in tokens")
    d.set_defaults(fn=cmd_demo)
    c = sub.add_parser("calibrate", help="fit the per-model artifacts of echokv and lowrank")
    c.add_argument("--model", default="smollm2")
    c.add_argument("--text", default=None, help="calibration text file (default: Python stdlib source)")
    c.add_argument("--method", default="all", choices=["all", "echokv", "lowrank"])
    c.add_argument("--tokens", type=int, default=4096)
    c.add_argument("--out", default=None, help="artifact path (default ~/.cache/kvsum/<model>-reconstruct.kvsum)")
    c.set_defaults(fn=cmd_calibrate)
    e = sub.add_parser("eval", help="evaluate methods on a task; writes JSON and a markdown table")
    e.add_argument("--model", default="smollm2")
    e.add_argument("--method", required=True, help="one or more methods, comma-separated")
    e.add_argument("--budget", default="0.5,0.25,0.125", help="comma-separated fractions in (0, 1]")
    e.add_argument("--task", default="passkey", choices=["passkey", "multikey", "lm"])
    e.add_argument("--lengths", default="2000", help="context lengths in tokens, comma-separated")
    e.add_argument("--n", type=int, default=10, help="examples per length")
    e.add_argument("--seed", type=int, default=0)
    e.add_argument("--out", default=None, help="output stem (default benchmarks/results/eval_<task>)")
    e.set_defaults(fn=cmd_eval)
    s = sub.add_parser("stability", help="cache-on vs cache-off per precision, then each method vs the full cache")
    s.add_argument("--model", default="smollm2")
    s.add_argument("--dtypes", default="fp32,bf16,fp16", help="comma-separated: fp32, bf16, fp16")
    s.add_argument("--method", default="all", help="methods compared with the full cache, comma-separated")
    s.add_argument("--budget", default="0.25", help="the methods' budget")
    s.add_argument("--prompts", type=int, default=3)
    s.add_argument("--onepass", default="", help="precisions whose cache-off run is one teacher-forced pass "
                   "instead of one pass per step (e.g. fp16: CPU fp16 matmuls are ~10x slower)")
    s.add_argument("--dtype-prompts", default="", help="fewer prompts for some precisions, e.g. fp16=1 "
                   "(fp16 matrix products are ~10x slower than fp32 on CPU)")
    s.add_argument("--prompt-tokens", type=int, default=512)
    s.add_argument("--new-tokens", type=int, default=32)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--threads", type=int, default=None)
    s.add_argument("--time-limit", type=float, default=0, help="seconds; start no new unit after it (resume later)")
    s.add_argument("--cache", default=None, help="result cache folder (default ~/.cache/kvsum/stability)")
    s.add_argument("--fresh", action="store_true", help="ignore cached results")
    s.add_argument("--out", default="benchmarks/results/stability", help="output stem (.json and .md)")
    s.set_defaults(fn=cmd_stability)
    r = sub.add_parser("report", help="decision report: accuracy vs bytes, throughput, overhead, complexity, "
                                      "stability, recommendations (HTML + markdown); resumable")
    r.add_argument("--model", default="smollm2")
    r.add_argument("--methods", default="all", help="comma-separated methods, or all")
    r.add_argument("--budgets", default="0.5,0.25,0.125,0.0625")
    r.add_argument("--task", default="lm,passkey,multikey", help="comma-separated tasks")
    r.add_argument("--length", default="2048", help="context length of the evaluation in tokens")
    r.add_argument("--n", type=int, default=3, help="examples per task")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--perf-budget", default="0.25", help="budget of the timing measurements")
    r.add_argument("--short-lengths", default="128,512", help="prompt lengths of the throughput measurement")
    r.add_argument("--new-tokens", type=int, default=32, help="generated tokens per throughput request")
    r.add_argument("--scaling-lengths", default="1024,2048,4096", help="lengths of the overhead/decode measurement")
    r.add_argument("--timings", default="auto", choices=["auto", "measure", "files", "none"],
                   help="auto: benchmarks/perf.py's results when all present, else measure a small grid")
    r.add_argument("--threads", type=int, default=2)
    r.add_argument("--time-limit", type=float, default=0, help="seconds; start no new unit after it (resume later)")
    r.add_argument("--cache", default=None, help="result cache folder (default ~/.cache/kvsum/report)")
    r.add_argument("--fresh", action="store_true", help="ignore cached results")
    r.add_argument("--stability", default="benchmarks/results/stability.json", help="kvsum stability results")
    r.add_argument("--out", default="benchmarks/results/report", help="output folder")
    r.set_defaults(fn=cmd_report)
    b = sub.add_parser("bench", help="timing calibrations (breakeven: where compression starts to pay)")
    b.add_argument("what", choices=["breakeven"])
    b.add_argument("--model", default="smollm2")
    b.add_argument("--methods", default="turboquant,kivi,summary,summary+turboquant,streaming_llm,snapkv")
    b.add_argument("--lengths", default="256,512,1024,2048,4096", help="context lengths, comma-separated")
    b.add_argument("--new-tokens", type=int, default=64, help="generated tokens the totals include")
    b.add_argument("--budget", default="0.25", help="budget of every method")
    b.add_argument("--rounds", type=int, default=9, help="decode steps per cache (median)")
    b.add_argument("--threads", type=int, default=2)
    b.add_argument("--out", default="benchmarks/results/breakeven", help="output stem (.json and .md)")
    b.set_defaults(fn=cmd_bench)
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    try:
        args = p.parse_args(argv)
    except SystemExit as e:  # argparse already printed one usage line; keep its exit code 2
        return int(e.code or 0)
    try:
        if getattr(args, "budget", None) is not None and isinstance(args.budget, float):
            from .budget import check_budget

            check_budget(args.budget)
        args.fn(args)
    except KVSumError as e:
        print(f"kvsum: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
