"""The experiment record and spec strings (the registry itself is benchmarks/experiments/__init__.py)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

RESULTS = Path(__file__).resolve().parent.parent / "results"
PART_FLAG = {"quant": "--part", "long_generation": "--part"}  # runners whose part is an option, not the first word


def spec(name: str, budgets: tuple[float, ...] = (), **knobs) -> str:
    """A method spec string: `name[:knob=value,...][@budget,...]` (string values bare, others as Python writes
    them, so that the benchmarks' parser reads back the same types)."""
    text = name + (":" + ",".join(f"{k}={v if isinstance(v, str) else repr(v)}" for k, v in knobs.items())
                   if knobs else "")
    return text + ("@" + ",".join(f"{b:g}" for b in budgets) if budgets else "")


def tq(**knobs) -> str:
    """A TurboQuant spec as a method-valued knob (summary's `cover=`): `turboquant(bits=3.5,center=True)`."""
    return "turboquant(" + ",".join(f"{k}={v if isinstance(v, str) else repr(v)}" for k, v in knobs.items()) + ")"


@dataclass(frozen=True)
class Experiment:
    """One named experiment.

    Attributes:
        name: the experiment's name, which fixes its result files' names.
        family: the results folder it writes to (benchmarks/results/<family>/).
        runner: the module of benchmarks/ that runs it ("kvsum": the kvsum CLI; "pytest": a test run).
        doc: one line: what it measures.
        part: the runner's part (its first argument, or --part), if it has parts.
        methods: method configurations as spec strings, in the order the rows come out.
        tasks: the tasks (passkey, multikey, lm), where the runner takes --tasks.
        lengths: context lengths, where the runner takes --lengths.
        n: examples per task (one per length where a tuple), where the runner takes --n.
        threads: torch threads the committed run used.
        args: the runner's other options, as the committed run gave them.
        runs: for a file several invocations merged into: each invocation's options (after the part); the
            fields above (methods ... n) are then unused.
        out: how the runner is told where to write: "stem" (--out <stem>), "dir" (--out <folder>), "none".
        ext: the main result file's extension (json, or txt for a test log).
        pending: not run yet, so no result file is committed (a run that needs hardware this checkout's machines
            lack, e.g. a GPU); ready to run, and its file is committed once it has been.
    """

    name: str
    family: str
    runner: str
    doc: str
    part: str | None = None
    methods: tuple[str, ...] = ()
    tasks: tuple[str, ...] = ()
    lengths: tuple[int, ...] = ()
    n: int | tuple[int, ...] | None = None
    threads: int | None = None
    args: tuple[str, ...] = ()
    runs: tuple[tuple[str, ...], ...] = ()
    out: str = "stem"
    ext: str = "json"
    pending: bool = False

    def stem(self, root: Path = RESULTS) -> Path:
        """Where the results go: <root>/<family>/<name> (.json and .md); a folder for out="dir"."""
        return root / self.family / (self.name if self.out != "dir" else "")

    def path(self, root: Path = RESULTS) -> Path:
        """The main result file."""
        stem = self.stem(root)
        return stem / f"{self.name}.json" if self.out == "dir" else stem.with_name(f"{stem.name}.{self.ext}")

    def command(self) -> str:
        return f"python -m benchmarks run {self.name}"

    def invocations(self, root: Path = RESULTS, n: int | None = None) -> list[list[str]]:
        """The runner's argument lists, one per invocation, writing under `root`; `n` shrinks every example
        count (--n, --n-lm) for a smoke run."""
        head = [] if self.part is None else [PART_FLAG[self.runner], self.part] if self.runner in PART_FLAG \
            else self.part.split()
        tail = [*(["--threads", str(self.threads)] if self.threads is not None else [])]
        out = self.stem(root)
        out = out.relative_to(Path.cwd()) if out.is_relative_to(Path.cwd()) else out  # as a user would type it
        tail += [] if self.out == "none" else ["--out", str(out)]
        if self.runs:
            return [_shrink(head + list(r) + tail, n) for r in self.runs]
        body = [*(["--methods", *self.methods] if self.methods else []), *(["--tasks", *self.tasks] if self.tasks
                else []), *(["--lengths", *map(str, self.lengths)] if self.lengths else [])]
        if self.n is not None:
            body += ["--n", *map(str, self.n if isinstance(self.n, tuple) else (self.n,))]
        return [_shrink(head + body + list(self.args) + tail, n)]


def _shrink(argv: list[str], n: int | None) -> list[str]:
    """`argv` with the values of --n and --n-lm set to `n` (unchanged where n is None)."""
    if n is None:
        return argv
    out, flag = [], None
    for a in argv:
        if a.startswith("--"):
            flag = a
            out.append(a)
        else:
            out.append(str(n) if flag in ("--n", "--n-lm") else a)
    return out
