"""What each `kvsum` command does (kvsum/cli.py parses the arguments): check every argument, then load the model.

torch, transformers and the eval extra are imported inside the commands, so `kvsum --help` and a bad
argument answer at once.
"""

from __future__ import annotations

import shlex
import time
from pathlib import Path

from .errors import KVSumError
from .extras import require_eval
from .spec import Spec, format_spec, parse_specs

RESULTS = Path("kvsum-results")  # where a user's runs go by default, under the working directory


def budgets(text: str) -> list[float]:
    from .budget import check_budget

    try:
        values = [float(v) for v in text.split(",")]
    except ValueError:
        raise KVSumError(f"--budget must be comma-separated numbers in (0, 1], got {text!r}") from None
    return [check_budget(v) for v in values]


def method_specs(text: str) -> list[Spec]:
    """Comma-separated method specs, each built once (unknown names or knobs fail before the model loads)."""
    from .methods import make_method

    if not text.strip():
        make_method(text)  # raises: unknown method ''
    specs = parse_specs(text)
    for s in specs:
        make_method(s)
    return specs


def dtype_prompts(text: str) -> dict[str, int]:
    out = {}
    for item in filter(None, text.split(",")):
        name, _, count = item.partition("=")
        try:
            out[name.strip()] = int(count)
        except ValueError:
            raise KVSumError(f"--dtype-prompts must look like fp16=1,bf16=2, got {text!r}") from None
    return out


def command_line(args) -> str:
    return shlex.join(["kvsum", *args.argv])


def cmd_methods(args) -> None:
    import kvsum

    for name, line in kvsum.methods().items():
        print(f"{name:20s} {line}")


def cmd_demo(args) -> None:
    require_eval("kvsum demo", ("rich",))
    spec = None if args.method is None else _one(method_specs(args.method), "--method")
    from rich.console import Console

    from .demo import run_demo

    console = Console()
    with console.status("loading the bundled model (the first run converts it once)"):
        import kvsum

        model, tok = kvsum.load_model(args.model)
    window = model.config.max_position_embeddings
    if args.tokens > window:
        raise KVSumError(f"--tokens {args.tokens} is longer than the model's window ({window})")
    result = run_demo(model, tok, method=spec, budget=args.budget, tokens=args.tokens)
    console.print(demo_table(result, str(model.dtype).removeprefix("torch."), args.budget))


def demo_table(result: dict, dtype: str, budget: float):
    """The demo's numbers and answers as a rich Table: one line per answer, marked right or wrong."""
    from rich.markup import escape
    from rich.table import Table

    from .demo import one_line

    def mib(b):
        return f"{b / 2**20:.2f} MiB"

    def said(qa, label):
        mark = "[green]right[/]" if qa[label + "_right"] else "[red]wrong[/]"
        return f"{escape(one_line(qa[label]))}  {mark}"

    name = result["method"]
    chosen = f" (configured by budget: {result['chosen']})" if result.get("chosen") else ""
    table = Table(title=f"kvsum demo: {result['tokens']} tokens, method {escape(name)} at budget {budget}"
                        f"{escape(chosen)}",
                  caption="each cache is compressed once; every question is answered from a copy of it "
                          "(generate() grows the cache it is given)")
    table.add_column("")
    table.add_column(f"full cache ({dtype})", justify="right")
    table.add_column(escape(name), justify="right")
    table.add_row("full cache at 16 bits", mib(result["full16_bytes"]), "")
    table.add_row("bytes held", mib(result["full_bytes"]),
                  f"{mib(result['bytes'])} ({result['bytes'] / result['full16_bytes']:.3f} of fp16)")
    table.add_row("prefill / compress time", f"{result['prefill_s']:.2f} s", f"+{result['compress_s']:.2f} s")
    for qa in result["answers"]:
        table.add_row(escape(f"{qa['cue']!r} (expect {qa['expected']})"), said(qa, "full"), said(qa, "compressed"))
    n = len(result["answers"])
    table.add_row("answers right", f"{sum(qa['full_right'] for qa in result['answers'])}/{n}",
                  f"{sum(qa['compressed_right'] for qa in result['answers'])}/{n}")
    table.add_row("answer time (all questions)", f"{result['full_answer_s']:.2f} s", f"{result['answer_s']:.2f} s")
    return table


def _one(specs: list[Spec], option: str) -> Spec:
    if len(specs) != 1:
        raise KVSumError(f"{option} takes one method here, got {len(specs)}")
    return specs[0]


def cmd_eval(args) -> None:
    require_eval("kvsum eval")
    specs = method_specs(args.method)
    bs = budgets(args.budget)
    out = Path(args.out) if args.out else RESULTS / f"eval-{args.task}-{time.strftime('%Y%m%d-%H%M%S')}"
    if out.exists() and not out.is_dir():
        raise KVSumError(f"--out {str(out)!r} is a file; give a folder")
    import torch

    import kvsum
    from kvsum.eval.runner import get_task, run, write
    from kvsum.stability import DTYPES

    task = get_task(args.task, chat=args.chat)  # an unknown task fails before the model loads
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok = kvsum.load_model(args.model, dtype=DTYPES[args.dtype])
    limit = model.config.max_position_embeddings
    if max(args.lengths) > limit:
        raise KVSumError(f"--lengths {max(args.lengths)} is longer than the model's window ({limit})")
    t = time.time()
    rows = run(model, tok, task, [(s.name, s.knobs) for s in specs], bs, args.lengths, args.n, seed=args.seed,
               progress=True)
    stem = f"eval_{args.task}" + ("_chat" if args.chat else "")  # both formats of a task can share a folder
    js, md = write(rows, out / stem, args.model, command_line(args), dtype=args.dtype, chat=args.chat,
                   threads=torch.get_num_threads())
    print(md.read_text())
    print(f"wrote {js} and {md} in {time.time() - t:.0f} s")


def cmd_calibrate(args) -> None:
    import kvsum
    from kvsum.calibrate import calibrate, default_artifact_path

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
    out = Path(args.out) if args.out else default_artifact_path(art.fingerprint, args.method)
    art.save(out)
    m = art.meta
    print(f"calibrated {', '.join(m['methods'])} for {args.model} in {m['seconds']:.0f} s; "
          f"artifact {m['nbytes'] / 2**20:.1f} MiB, {m['n_knobs']} knobs -> {out}")


def cmd_stability(args) -> None:
    require_eval("kvsum stability")
    import json

    from .models import cache_dir
    from .report.specs import Store
    from .report.specs import method_specs as report_specs
    from .report.stability import markdown
    from .stability import Settings, run

    settings = Settings(model=args.model, dtypes=[d.strip() for d in args.dtypes.split(",")], prompts=args.prompts,
                        prompt_tokens=args.prompt_tokens, new_tokens=args.new_tokens,
                        budget=budgets(args.budget)[0], seed=args.seed,
                        dtype_prompts=dtype_prompts(args.dtype_prompts),
                        onepass=[d.strip() for d in args.onepass.split(",") if d.strip()]).check()
    specs, notes = report_specs(parse_specs(args.method), args.model, skip=("full",))
    store = Store(Path(args.cache) if args.cache else cache_dir() / "stability", fresh=args.fresh)
    deadline = time.time() + args.time_limit if args.time_limit else None
    result = run(settings, specs, store, deadline=deadline, threads=args.threads)
    result["notes"] = notes
    result["command"] = command_line(args)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    md = markdown(result) + "".join(f"\n- {n}" for n in notes) + f"\n\nCommand: `{result['command']}`\n"
    out.with_suffix(".md").write_text(md)
    print(md)
    print(f"wrote {out}.json and {out}.md ({store.hits} cached results reused, "
          f"{'complete' if result['complete'] else 'INCOMPLETE: run again to finish'})")


def cmd_report(args) -> None:
    require_eval("kvsum report")
    from .eval.tasks import TASKS
    from .models import cache_dir
    from .report import Settings, build
    from .report.specs import Store

    tasks = [t.strip() for t in args.task.split(",")]
    for t in tasks:
        if t not in TASKS:
            raise KVSumError(f"--task {t!r} is unknown; accepted: {', '.join(TASKS)}")
    methods = [format_spec(m) for m in parse_specs(args.methods)]
    s = Settings(model=args.model, methods=methods, budgets=budgets(args.budgets), tasks=tasks,
                 length=args.length, n=args.n, seed=args.seed,
                 perf_budget=budgets(args.perf_budget)[0], short_lengths=args.short_lengths,
                 new_tokens=args.new_tokens, scaling_lengths=args.scaling_lengths,
                 timings=args.timings, threads=args.threads)
    store = Store(Path(args.cache) if args.cache else cache_dir() / "report", fresh=args.fresh)
    deadline = time.time() + args.time_limit if args.time_limit else None
    out = build(s, Path(args.out), store, deadline=deadline, stability_json=Path(args.stability),
                reconstruct_json=Path("benchmarks/results/reconstruct/reconstruct.json"), command=command_line(args))
    state = "complete" if out["complete"] else "INCOMPLETE: run the same command again to resume"
    print(f"wrote {out['html']} and {out['md']}: {out['rows']} rows, {out['cached']} cached results reused, "
          f"{out['computed']} not cached before this run; {state}")
    for k, v in out["errors"].items():
        print(f"  error {k}: {v}")


def cmd_bench(args) -> None:
    import json

    import torch

    from kvsum.breakeven import markdown, measure
    from kvsum.eval.report import meta
    from kvsum.eval.text import prose_ids
    from kvsum.methods import make_method
    from kvsum.models import load_model

    methods = [m.strip() for m in args.methods.split(",")]
    for m in methods:
        make_method(m)  # unknown names fail before the model loads
    budget = budgets(args.budget)[0]
    torch.set_num_threads(args.threads)
    model, tok = load_model(args.model)
    table = measure(model, tok, methods, args.lengths, ids=prose_ids(tok, max(args.lengths)),
                    new_tokens=args.new_tokens, budget=budget, rounds=args.rounds, progress=True)
    info = meta(args.model, command_line(args), threads=args.threads)  # date and versions, like every result
    table.update(model=args.model, command=info["command"], date=info["date"], meta=info)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(table, indent=1) + "\n")
    md = markdown(table) + f"\nCommand: `{table['command']}` ({table['date']})\n"
    out.with_suffix(".md").write_text(md)
    print(md)
    print(f"wrote {out}.json and {out}.md; use it with kvsum.Policy(table='{out}.json')")


def cmd_store(args) -> None:
    """kvsum store ls | du | rm KEY... | rm --all: the prefix store's entries (kvsum.Store)."""
    from .store import Store, age

    if args.action == "rm" and not (args.keys or args.all):
        raise KVSumError("kvsum store rm needs entry keys (see kvsum store ls) or --all")
    store = Store(args.dir)
    if args.action == "ls":
        rows = store.ls()
        print(f"{len(rows)} entr{'y' if len(rows) == 1 else 'ies'} in {store.directory}")
        for r in rows:
            print(f"{r['key']}  {r['bytes'] / 2**20:9.2f} MiB  used {age(r['used']):>4} ago  {r['tokens']} tokens  "
                  f"budget {r['budget']}  {r['spec']}")
    elif args.action == "du":
        print(f"{store.du() / 2**20:.2f} MiB in {len(store.ls())} entries, {store.directory}")
    else:
        done = {} if args.all else {k: store.rm(k) for k in args.keys}
        removed = store.clear() if args.all else sum(done.values())
        print(f"removed {removed} entr{'y' if removed == 1 else 'ies'} from {store.directory}")
        missing = [k for k, ok in done.items() if not ok]
        if missing:
            raise KVSumError(f"no entry {', '.join(missing)} in {store.directory}")
