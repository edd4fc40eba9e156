"""The long-context benchmark on Qwen2.5-Coder-0.5B: each family's best configuration beside the full cache on the
RULER-style suite at 4k-32k tokens, with what each costs.

Per example (test split, seeds from --seed) the prompt is prefilled once, with every extra the configurations
need (prompts over kvsum.prefill.WHOLE tokens in chunks), and the full cache answers the question; then every
configuration compresses that prefill (`kvsum.compress_prefill`) and answers the same question. A cell records
the suite's score (string-match recall %) beside the full cache's on the same examples, the bytes held
(`cache.nbytes()` over the full cache at 16 bits), compression time over the prefill's, the decode step over
the full cache's (the question's first tokens decoded one at a time on a copy of every cache, back to back,
`common.paired_decode`), and the process's peak resident memory during the prefill and during each compression
(`memory.rss`, VmHWM reset before each step), against the long_memory bound's sum (resident after loading the
model + the full cache + one chunk's activations).

Every length runs in a fresh process (glibc told to mmap large buffers, so freed memory leaves RSS), examples in
the order index -> task, so a cut-off run leaves every task with examples. Each example's records merge into
--out.json as soon as it is done (keyed by task, length, example index and configuration) and the rows and the
markdown are rebuilt from all records, so a run stopped midway leaves usable cells and the same command resumes
it, skipping the examples done. Committed runs: benchmarks/experiments/other.py (long_suite).
"""

from __future__ import annotations

import argparse
import copy
import fcntl
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .experiments import RESULTS
from .long_memory import BOUND, chunk_activations
from .memory import reset_peak, rss
from .specs import parse_row

TASKS = ("niah_single", "niah_single_code")
DTYPES = ("fp32", "bf16")  # kvsum.stability.DTYPES' names (it imports torch, which only the child loads)
MIB = 2 ** 20


def configs(specs: list[str], budgets: list[float]) -> list[tuple[str, str, dict, float]]:
    """(label, method name, knobs, budget) per configuration; `full` once at 1.0, a spec's own budgets after @."""
    out = []
    for text in specs:
        name, knobs, own = parse_row(text)
        label = text.rpartition("@")[0] if "@" in text else text
        out += [(label, name, knobs, b) for b in ([1.0] if name == "full" else own or budgets)]
    return out


def indices(args, length: int) -> range:
    """The example indices run at `length`: from --first up to that length's --n (one --n serves every length)."""
    return range(args.first, args.n[min(args.lengths.index(length), len(args.n) - 1)])


def answer(model, tok, task, ex, cache) -> tuple[float, str]:
    """kvsum.eval.runner.answer (the question after the context, greedy, up to the task's max_new_tokens),
    stopped as soon as the text holds every expected value: the suite's score is string-match recall, which more
    text cannot lower, so the score is the full generation's, at a fraction of the decode steps."""
    import torch
    from transformers import StoppingCriteria, StoppingCriteriaList

    ids = torch.cat([ex.context_ids, ex.question_ids], -1).to(model.device)
    start = ids.shape[1]

    class Answered(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            done = task.score(ex, tok.decode(input_ids[0, start:], skip_special_tokens=True)) >= 1.0
            return torch.full((input_ids.shape[0],), done, dtype=torch.bool, device=input_ids.device)

    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    out = model.generate(ids, cache=cache, max_new_tokens=task.max_new_tokens, do_sample=False,
                         attention_mask=torch.ones_like(ids), pad_token_id=pad,
                         stopping_criteria=StoppingCriteriaList([Answered()]))
    text = tok.decode(out[0, start:], skip_special_tokens=True)
    return task.score(ex, text), text


def _load(js: Path) -> dict:
    return json.loads(js.read_text()) if js.exists() else {"meta": {}, "records": [], "rows": []}


def one_length(args, length: int) -> None:
    """This process: every example of every task at one length, each merged into the JSON when done."""
    import torch

    import kvsum
    from kvsum.eval.runner import chosen, prompt_length
    from kvsum.eval.tasks import DEPTHS, example_seed, get_task
    from kvsum.methods import make_method, prefill_needs
    from kvsum.prefill import CHUNK, WHOLE
    from kvsum.stability import DTYPES as TORCH_DTYPES

    from .common import CALIBRATED, calibrated, paired_decode
    from .diagnose import build

    torch.set_num_threads(args.threads)
    model, tok = kvsum.load_model(args.model, dtype=TORCH_DTYPES[args.dtype])
    cfgs = configs(args.methods, args.budgets)
    built = [build(name, **knobs) for _, name, knobs, _ in cfgs]  # fail before any prefill; diagnoses too
    opts = prefill_needs(built)
    for name in sorted({name for _, name, _, _ in cfgs} & set(CALIBRATED)):
        calibrated(model, tok, name)  # a fresh machine runs the benchmark in one command
    kvsum.prefill(model, torch.zeros(1, 64, dtype=torch.long))  # warm-up
    loaded, _ = rss()
    js = Path(args.out).with_name(Path(args.out).name + ".json")
    for i in indices(args, length):
        for task in (get_task(name, chat=args.chat) for name in args.tasks):
            done = {(r["task"], r["length"], r["index"], r["config"], r["budget"]) for r in _load(js)["records"]}
            if all((task.name, length, i, label, b) in done for label, _, _, b in cfgs):
                continue
            seed = example_seed(args.seed, i)
            ex = task.example(tok, prompt_length(model, task, length), seed, DEPTHS[i % len(DEPTHS)])
            ids = ex.context_ids
            reset_peak()
            t0 = time.perf_counter()
            pre = kvsum.prefill(model, ids, tokenizer=tok, **opts)
            prefill_s = time.perf_counter() - t0
            _, prefill_peak = rss()
            full = kvsum.compress_prefill(pre, make_method("full"), 1.0)
            base = loaded + full.nbytes() + chunk_activations(model, length if length <= WHOLE else CHUNK, length)
            kept = [copy.deepcopy(full)]
            full_score, full_text = answer(model, tok, task, ex, full)
            del full
            recs = []
            for (label, name, knobs, budget), method in zip(cfgs, built):
                reset_peak()
                before, _ = rss()
                t0 = time.perf_counter()
                try:
                    cache = kvsum.compress_prefill(pre, method, budget)
                except kvsum.KVSumError as e:  # a budget the configuration cannot hold: recorded as refused
                    recs.append(dict(task=task.name, length=length, index=i, seed=seed, config=label, method=name,
                                     budget=budget, refused=str(e)))
                    print(f"{label}@{budget:g} refused: {e}", file=sys.stderr, flush=True)
                    continue
                compress_s = time.perf_counter() - t0
                _, peak = rss()
                held = cache.nbytes()  # before the question and answer grow it
                kept.append(copy.deepcopy(cache))
                score, text = answer(model, tok, task, ex, cache)
                recs.append(dict(task=task.name, length=length, index=i, seed=seed, depth=ex.depth, config=label,
                                 method=name, knobs={k: str(v) for k, v in knobs.items()}, budget=budget,
                                 score=100 * score, full_score=100 * full_score, output=text, full_output=full_text,
                                 bytes=held, full_bytes=cache.reference_nbytes,
                                 ratio=held / cache.reference_nbytes, prefill_s=prefill_s,
                                 compress_s=compress_s, compress_over_prefill=compress_s / prefill_s,
                                 prefill_peak=prefill_peak, compress_peak=peak, rss_before=before,
                                 compress_extra=peak - before, base=base,
                                 peak_over_base=max(prefill_peak, peak) / base,
                                 **chosen(cache)))
                del cache
            del pre
            steps = ex.question_ids[:, :args.decode_steps + 2]
            times = paired_decode(model, kept, steps) if args.decode_steps > 0 else []
            for rec, ts in zip([r for r in recs if "refused" not in r], times[1:]):
                rec["decode_s"] = statistics.median(ts)
                rec["full_decode_s"] = statistics.median(times[0])
                rec["decode_over_full"] = statistics.median(a / b for a, b in zip(ts, times[0]))
            del kept
            merge(js, recs, args)
            print(f"{task.name} @ {length} #{i}: prefill {prefill_s:.0f} s, full {100 * full_score:.0f}, "
                  + ", ".join(f"{r['config']}@{r['budget']:g} {r.get('score', 'refused')}" for r in recs),
                  file=sys.stderr, flush=True)


def merge(js: Path, recs: list[dict], args) -> None:
    """Add `recs` to the JSON's records (replacing any with the same key), rebuild rows and markdown."""
    js.parent.mkdir(parents=True, exist_ok=True)
    with open(Path(tempfile.gettempdir()) / f"kvsum-{js.stem}.lock", "w") as lock:  # lengths run in parallel
        fcntl.flock(lock, fcntl.LOCK_EX)
        _merge(js, recs, args)


def _merge(js: Path, recs: list[dict], args) -> None:
    from .common import commands_with, keep_experiment, recorded_commands, run_info

    data = _load(js)

    def key(r):
        return r["task"], r["length"], r["index"], r["config"], r["budget"]

    new = {key(r) for r in recs}
    records = [r for r in data["records"] if key(r) not in new] + recs
    records.sort(key=lambda r: (r["length"], r["task"], r["index"]))
    meta = run_info(args.model, args.threads, seed=args.seed, split="test" if args.seed < 1000 else "dev",
                    dtype=args.dtype, chat=args.chat)
    meta["commands"] = commands_with(recorded_commands(data["meta"]), args.command)
    keep_experiment(meta, data["meta"])
    rows = aggregate(records)
    tmp = js.with_suffix(".tmp")
    tmp.write_text(json.dumps({"meta": meta, "rows": rows, "records": records}, indent=1) + "\n")
    tmp.replace(js)
    js.with_suffix(".md").write_text(render(rows, meta))


def aggregate(records: list[dict]) -> list[dict]:
    """One row per task x length x configuration x budget over its examples."""
    groups: dict[tuple, list[dict]] = {}
    for r in (r for r in records if "refused" not in r):
        groups.setdefault((r["task"], r["length"], r["config"], r["budget"]), []).append(r)
    rows = []
    for (task, length, config, budget), rs in groups.items():
        def mean(k, rs=rs):
            return sum(r[k] for r in rs) / len(rs)

        rows.append(dict(task=task, length=length, config=config, method=rs[0]["method"], knobs=rs[0]["knobs"],
                         budget=budget, n=len(rs), score=mean("score"), full_score=mean("full_score"),
                         ratio=mean("ratio"), bytes=mean("bytes"), full_bytes=mean("full_bytes"),
                         prefill_s=mean("prefill_s"), compress_s=mean("compress_s"),
                         compress_over_prefill=mean("compress_over_prefill"),
                         decode_over_full=statistics.median(r.get("decode_over_full", float("nan")) for r in rs),
                         peak=max(max(r["prefill_peak"], r["compress_peak"]) for r in rs),
                         compress_extra=max(r["compress_extra"] for r in rs),
                         peak_over_base=max(r["peak_over_base"] for r in rs),
                         indices=sorted(r["index"] for r in rs),
                         **({"chosen": c} if (c := sorted({r["chosen"] for r in rs if "chosen" in r})) else {})))
    order = list(dict.fromkeys(r["config"] for r in records))
    return sorted(rows, key=lambda r: (r["length"], r["task"], r["config"] != "full", -r["budget"],
                                       order.index(r["config"])))


def _lk(length: int) -> str:
    return f"{length // 1024}k"


def summary_table(rows: list[dict], tasks=TASKS) -> list[str]:
    """Configurations x lengths: the NIAH single score over prose and code together (the full cache's on the same
    examples in brackets, n examples), and the bytes held."""
    lengths = sorted({r["length"] for r in rows})
    cfgs = list(dict.fromkeys((r["config"], r["budget"]) for r in rows if r["task"] in tasks))
    out = ["| configuration | budget | bytes held | " + " | ".join(_lk(L) for L in lengths) + " |",
           "|---|---|---|" + "---|" * len(lengths)]
    for config, budget in cfgs:
        cells, ratios = [], []
        for L in lengths:
            rs = [r for r in rows if r["config"] == config and r["budget"] == budget and r["length"] == L
                  and r["task"] in tasks]
            if not rs:
                cells.append("-")
                continue
            n = sum(r["n"] for r in rs)
            s, f = (sum(r[k] * r["n"] for r in rs) / n for k in ("score", "full_score"))
            ratios += [r["ratio"] for r in rs]
            cells.append(f"{s:.0f}" + ("" if config == "full" else f" ({f:.0f})") + f", n = {n}")
        held = f"{statistics.mean(ratios):.3f}" if ratios else "-"
        out.append(f"| `{config}` | {budget:g} | {held} | " + " | ".join(cells) + " |")
    return out


def other_tasks(rows: list[dict]) -> list[str]:
    """The suite's tasks beyond NIAH single, one table each (the same cells as the NIAH single table)."""
    out = []
    for task in dict.fromkeys(r["task"] for r in rows if r["task"] not in TASKS):
        out += [f"### {task}", "", *summary_table([r for r in rows if r["task"] == task], (task,)), ""]
    return out


def render(rows: list[dict], meta: dict) -> str:
    dtype = meta.get("dtype", "fp32")
    info = ", ".join(f"{k}: {v}" for k, v in meta.items() if v is not None and not isinstance(v, list | dict))
    single = any(r["task"] in TASKS for r in rows)  # a run of the other tasks alone has no NIAH single table
    first = [*summary_table(rows), ""] if single else []
    out = [f"# Long contexts: the families' best configurations on {meta.get('model')} at 4k-32k tokens", "", info,
           "", f"{'NIAH single (prose and code haystacks together)' if single else 'Each task'}: string-match recall "
           f"%, {meta.get('split', 'test')} split; the full cache's score on the same examples in brackets; n "
           "examples per cell; bytes held: `cache.nbytes()` over the full cache at 16 bits (the full cache is the "
           f"{dtype} model's own: {2 if dtype == 'fp32' else 1}.000).", "", *first, *other_tasks(rows),
           "## Per task and length", "",
           "Score: recall % (the full cache on the same examples); compress / prefill: compress_prefill's time over "
           "the prefill's (the prefill with every extra the configurations need); decode / full: the median over "
           "examples of the median decode step on this cache over the full cache's, paired step by step; peak: the "
           "process's VmHWM during the prefill or this compression (the larger), and over the sum resident after "
           f"loading + full cache + one chunk's activations (the long_memory bound is {BOUND} x it); compress +MiB: "
           "the compression's own peak over the resident size before it.", "",
           "| length | task | configuration | budget | n | score % (full %) | bytes held | compress / prefill | "
           "decode / full | peak MiB | peak / sum | compress +MiB |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['length']} | {r['task']} | `{r['config']}` | {r['budget']:g} | {r['n']} | "
                   f"{r['score']:.0f} ({r['full_score']:.0f}) | {r['ratio']:.3f} | {r['compress_over_prefill']:.4f} "
                   f"| {r['decode_over_full']:.2f} | {r['peak'] / MIB:,.0f} | {r['peak_over_base']:.3f} | "
                   f"{r['compress_extra'] / MIB:,.0f} |")
    out += ["", "Commands (records merged by task, length, example and configuration): "
            + "; ".join(f"`{c}`" for c in meta.get("commands", [])), ""]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tasks", nargs="+", default=list(TASKS))
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    ap.add_argument("--n", type=int, nargs="+", default=[4], help="examples per task (one per length, or one)")
    ap.add_argument("--first", type=int, default=0, help="skip the examples before this index (rerun one example)")
    ap.add_argument("--methods", nargs="+", default=["full", "snapkv"], help="spec strings, own budgets after @")
    ap.add_argument("--budgets", type=float, nargs="+", default=[0.25, 0.1])
    ap.add_argument("--seed", type=int, default=0, help="test split: seeds 0-999")
    ap.add_argument("--dtype", choices=DTYPES, default="fp32",
                    help="the model's dtype (bf16: how the model is served; ~5x faster on CPUs with AMX)")
    ap.add_argument("--chat", action="store_true", help="prompts in the tokenizer's chat template")
    ap.add_argument("--decode-steps", type=int, default=4,
                    help="decode steps timed per cache (after 2 warm-up; 0: none)")
    ap.add_argument("--out", default=str(RESULTS / "long" / "long_suite"))
    ap.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)  # child: one length
    ap.add_argument("--command", default=None, help=argparse.SUPPRESS)  # child: the parent's command line
    ap.add_argument("--experiment", default=None, help=argparse.SUPPRESS)  # child: the parent's experiment
    args = ap.parse_args(argv)
    from .common import CONTEXT, command

    CONTEXT["experiment"] = CONTEXT["experiment"] or args.experiment
    if args.one is not None:
        CONTEXT.update(command=args.command)
        one_length(args, args.one)
        return 0

    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": str(args.threads)}
    raw = sys.argv[1:] if argv is None else list(argv)
    for L in args.lengths:
        t0 = time.perf_counter()
        child = [sys.executable, "-m", "benchmarks.long_suite", *raw, "--out", str(Path(args.out).resolve()),
                 "--one", str(L), "--command", command(),
                 *(["--experiment", e] if (e := CONTEXT["experiment"]) else [])]
        code = subprocess.run(child, env=env, cwd=Path(__file__).parent.parent).returncode
        if code:
            print(f"length {L}: the child failed ({code})", file=sys.stderr)
            return code
        print(f"length {L}: {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    js = Path(args.out).with_name(Path(args.out).name + ".json")
    if js.exists():
        print(js.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
