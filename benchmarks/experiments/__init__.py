"""The registry of named experiments: what each committed result under benchmarks/results/ was run with.

An experiment names its runner (a module of benchmarks/, or the kvsum CLI), the runner's part, its method
configurations as spec strings (`name:knob=value,...`, own budgets after `@`: `snapkv@0.5,0.25`), tasks,
lengths, examples and threads; its name fixes where its results go: benchmarks/results/<family>/<name>.json
and .md. `python -m benchmarks run NAME` reruns it there; `python -m benchmarks list` lists them.
"""

from __future__ import annotations

from . import evict, gpu, other, quant, serving, summary
from .base import RESULTS, Experiment, spec

__all__ = ["EXPERIMENTS", "RESULTS", "Experiment", "spec"]


def _collect() -> dict[str, Experiment]:
    found = [e for mod in (quant, evict, summary, other, serving, gpu) for e in mod.EXPERIMENTS]
    names = [e.name for e in found]
    dup = sorted({x for x in names if names.count(x) > 1})
    if dup:
        raise ValueError(f"experiment names used twice: {dup}")
    return {e.name: e for e in found}


EXPERIMENTS: dict[str, Experiment] = _collect()
