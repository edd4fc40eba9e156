"""The `kvsum` command line: the arguments, their help and defaults; what each command does is kvsum/commands.py.

Nothing here imports torch: `kvsum --help` and argument errors answer at once.
"""

from __future__ import annotations

import argparse
import sys

from . import commands
from .errors import KVSumError

SPEC = ('a method spec: name[:knob=value,...], a method-valued knob as name(knob=value,...), e.g. '
        '"summary:cover=turboquant(bits=3.5,center=True),score=surprisal"')


class _Help(argparse.HelpFormatter):
    """Every option's help line ends with its default (unless it has none or says it already)."""

    def _get_help_string(self, action):
        text = action.help or ""
        hidden = action.default is None or action.default is False or action.default == argparse.SUPPRESS
        if hidden or "default" in text or not action.option_strings:
            return text
        return f"{text} (default: %(default)s)"


class _Parser(argparse.ArgumentParser):
    """argparse with its errors in one line (no usage block): what is wrong, then exit 2 before any model loads."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def _count(text: str) -> int:
    """A positive integer (an argparse type: every count and length of the commands is checked here)."""
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return n


def _counts(text: str) -> list[int]:
    """Comma-separated positive integers (an argparse type)."""
    try:
        return [_count(v) for v in text.split(",")]
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"must be comma-separated positive integers, got {text!r}") from None


def _sub(sub, name: str, help: str, fn) -> argparse.ArgumentParser:
    p = sub.add_parser(name, help=help, description=help, formatter_class=_Help)
    p.set_defaults(fn=fn)
    return p


def _model(p) -> None:
    p.add_argument("--model", default="smollm2", help="bundled model name or a Hugging Face model id / path")


def _resume(p, what: str) -> None:
    p.add_argument("--time-limit", type=float, default=0,
                   help="seconds; start no new unit after it (run the same command again to resume); 0: no limit")
    p.add_argument("--cache", default=None, help=f"result cache folder (default: ~/.cache/kvsum/{what})")
    p.add_argument("--fresh", action="store_true", help="ignore cached results")


def parser() -> argparse.ArgumentParser:
    p = _Parser(prog="kvsum", description="Compress the KV cache of transformers models.",
                                formatter_class=_Help)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _sub(sub, "methods", "list the compression methods", commands.cmd_methods)

    d = _sub(sub, "demo", "compress a long document on the bundled model and answer questions", commands.cmd_demo)
    _model(d)
    d.add_argument("--method", default=None, help=f"{SPEC} (default: the flagship summary configuration)")
    d.add_argument("--budget", type=float, default=0.25, help="fraction of the full 16-bit cache's bytes, in (0, 1]")
    d.add_argument("--tokens", type=_count, default=2000, help="document length in tokens")

    c = _sub(sub, "calibrate", "fit the per-model artifacts of echokv and lowrank", commands.cmd_calibrate)
    _model(c)
    c.add_argument("--text", default=None, help="calibration text file (default: Python stdlib source)")
    c.add_argument("--method", default="all", choices=["all", "echokv", "lowrank"], help="which artifacts to fit")
    c.add_argument("--tokens", type=int, default=4096, help="calibration tokens")
    c.add_argument("--out", default=None, help="artifact path (default: under the kvsum cache, named by the model's "
                   "fingerprint, where echokv and lowrank find it without artifact=)")

    e = _sub(sub, "eval", "evaluate methods on a task; writes JSON and a markdown table", commands.cmd_eval)
    _model(e)
    e.add_argument("--method", required=True, help=f"one or more methods, comma-separated; each is {SPEC}")
    e.add_argument("--budget", default="0.5,0.25,0.125", help="comma-separated fractions in (0, 1]")
    e.add_argument("--task", default="passkey", help="the task: passkey, multikey, lm, or a long-context suite task: "
                   "niah_single, niah_multikey, niah_multivalue, niah_multiquery, vt (add _code for the code "
                   "haystack), cwe, fwe")
    e.add_argument("--lengths", type=_counts, default="2000", help="context lengths in tokens, comma-separated")
    e.add_argument("--n", type=_count, default=10, help="examples per length")
    e.add_argument("--seed", type=int, default=0, help="seed of the examples")
    e.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"], help="the model's precision")
    e.add_argument("--chat", action="store_true", help="long-context suite tasks: prompts in the tokenizer's chat "
                   "template")
    e.add_argument("--threads", type=_count, default=None, help="torch threads (default: torch's own; the count is in "
                   "the result's meta)")
    e.add_argument("--out", default=None, help=f"output folder (default: ./{commands.RESULTS}/eval-<task>-<time>)")

    s = _sub(sub, "stability", "cache-on vs cache-off per precision, then each method vs the full cache",
             commands.cmd_stability)
    _model(s)
    s.add_argument("--dtypes", default="fp32,bf16,fp16", help="comma-separated: fp32, bf16, fp16")
    s.add_argument("--method", default="all", help="methods compared with the full cache, comma-separated: all, "
                   "or specs")
    s.add_argument("--budget", default="0.25", help="the methods' budget")
    s.add_argument("--prompts", type=int, default=3, help="prose prompts per precision")
    s.add_argument("--onepass", default="", help="precisions whose cache-off run is one teacher-forced pass "
                   "instead of one pass per step (e.g. fp16: CPU fp16 matmuls are slow); default: none")
    s.add_argument("--dtype-prompts", default="", help="fewer prompts for some precisions, e.g. fp16=1 "
                   "(fp16 matrix products are slow on CPU); default: --prompts for every precision")
    s.add_argument("--prompt-tokens", type=int, default=512, help="prompt length in tokens")
    s.add_argument("--new-tokens", type=int, default=32, help="greedy tokens generated per prompt")
    s.add_argument("--seed", type=int, default=0, help="seed of the prompts")
    s.add_argument("--threads", type=_count, default=None, help="torch threads (default: torch's own)")
    _resume(s, "stability")
    s.add_argument("--out", default=str(commands.RESULTS / "stability"), help="output stem (.json and .md)")

    r = _sub(sub, "report", "decision report: accuracy vs bytes, throughput, overhead, complexity, stability, "
                            "recommendations (HTML + markdown); resumable", commands.cmd_report)
    _model(r)
    r.add_argument("--methods", default="all", help="comma-separated: all, or specs")
    r.add_argument("--budgets", default="0.5,0.25,0.125,0.0625", help="comma-separated fractions in (0, 1]")
    r.add_argument("--task", default="lm,passkey,multikey", help="comma-separated tasks")
    r.add_argument("--length", type=_count, default="2048", help="context length of the evaluation in tokens")
    r.add_argument("--n", type=int, default=3, help="examples per task")
    r.add_argument("--seed", type=int, default=0, help="seed of the examples")
    r.add_argument("--perf-budget", default="0.25", help="budget of the timing measurements")
    r.add_argument("--short-lengths", type=_counts, default="128,512",
                   help="prompt lengths of the throughput measurement")
    r.add_argument("--new-tokens", type=int, default=32, help="generated tokens per throughput request")
    r.add_argument("--scaling-lengths", type=_counts, default="1024,2048,4096",
                   help="lengths of the overhead/decode measurement")
    r.add_argument("--timings", default="auto", choices=["auto", "measure", "files", "none"],
                   help="auto: benchmarks/perf.py's results when all present, else measure a small grid")
    r.add_argument("--threads", type=_count, default=2, help="torch threads")
    _resume(r, "report")
    r.add_argument("--stability", default=str(commands.RESULTS / "stability.json"),
                   help="kvsum stability results to include")
    r.add_argument("--out", default=str(commands.RESULTS / "report"), help="output folder")

    b = _sub(sub, "bench", "timing calibrations (breakeven: where compression starts to pay)", commands.cmd_bench)
    b.add_argument("what", choices=["breakeven"], help="the calibration to measure")
    _model(b)
    b.add_argument("--methods", default="turboquant,kivi,summary,summary+turboquant,streaming_llm,snapkv",
                   help="method names, comma-separated")
    b.add_argument("--lengths", type=_counts, default="256,512,1024,2048,4096", help="context lengths, comma-separated")
    b.add_argument("--new-tokens", type=_count, default=64, help="generated tokens the totals include")
    b.add_argument("--budget", default="0.25", help="budget of every method")
    b.add_argument("--rounds", type=int, default=9, help="decode steps per cache (median)")
    b.add_argument("--threads", type=_count, default=2, help="torch threads")
    b.add_argument("--out", default=str(commands.RESULTS / "breakeven"), help="output stem (.json and .md)")

    st = _sub(sub, "store", "the prefix store of compressed caches (kvsum.Store): list, size, remove",
              commands.cmd_store)
    st.add_argument("action", choices=["ls", "du", "rm"], help="ls: entries, most recently used first; du: bytes "
                    "on disk; rm: remove entries")
    st.add_argument("keys", nargs="*", help="with rm: the keys of the entries to remove (see ls)")
    st.add_argument("--all", action="store_true", help="with rm: remove every entry")
    st.add_argument("--dir", default=None, help="store directory (default: $KVSUM_CACHE/store, else "
                    "~/.cache/kvsum/store)")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    p = parser()
    try:
        args = p.parse_args(argv)
    except SystemExit as e:  # _Parser already printed its one line (or --help its text); keep the exit code
        return int(e.code or 0)
    args.argv = argv
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
