"""What the `eval` extra (`pip install 'kvsum[eval]'`: rich, matplotlib) adds, and the core's life without it.

The core never imports rich or matplotlib at module level: `progress` is the one progress bar every long loop
uses (rich's when it is installed, nothing otherwise), and `require_eval` turns a missing extra into one line.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from contextlib import contextmanager

from .errors import KVSumError

EVAL_MODULES = ("rich", "matplotlib")


def missing_eval(modules: tuple[str, ...] = EVAL_MODULES) -> list[str]:
    """Those of `modules` that are not installed."""
    return [m for m in modules if importlib.util.find_spec(m) is None]


def eval_message(what: str) -> str:
    return f"{what} needs the eval extra: pip install 'kvsum[eval]'"


def require_eval(what: str, modules: tuple[str, ...] = EVAL_MODULES, error: type[Exception] = KVSumError) -> None:
    """Raise `error` with one line naming the extra when any of `modules` is missing (`what` needs them)."""
    missing = missing_eval(modules)
    if missing:
        raise error(f"{eval_message(what)} ({', '.join(missing)} not installed)")


class Bar:
    """A handle on one progress bar; without rich (or when disabled) every call does nothing."""

    def __init__(self, progress=None, job=None):
        self._progress, self._job = progress, job

    def update(self, description: str | None = None, advance: float = 0) -> None:
        if self._progress is not None:
            kw = {} if description is None else {"description": description}
            self._progress.update(self._job, advance=advance, **kw)

    def advance(self, description: str | None = None, steps: float = 1) -> None:
        self.update(description, steps)


@contextmanager
def progress(description: str, total: float | None, enabled: bool = True, unit: str | None = None,
             eta: bool = False, transient: bool = False) -> Iterator[Bar]:
    """A progress bar over `total` steps (description, bar, done/total [unit], elapsed[, eta]) while the block runs.

    It shows nothing when `enabled` is false or rich is not installed; the loop runs the same either way.
    """
    if not enabled or missing_eval(("rich",)):
        yield Bar()
        return
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    count = MofNCompleteColumn() if unit is None else TextColumn("{task.completed}/{task.total} " + unit)
    columns = [TextColumn("{task.description}"), BarColumn(), count, TimeElapsedColumn()]
    if eta:
        columns += [TextColumn("eta"), TimeRemainingColumn()]
    with Progress(*columns, transient=transient) as p:
        yield Bar(p, p.add_task(description, total=total))
