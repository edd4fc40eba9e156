"""The report's evaluation: kvsum.eval's tasks and scoring, one cached result per example and configuration.

The unit of work (and of the cache) is one example of one task with one (method, knobs, budget): the
prefill of an example is shared by every configuration it still lacks, exactly as `kvsum.eval.runner.run`
does, and rows are aggregated with the runner's own `_row`, so numbers match `kvsum eval`. A run stopped
by its deadline keeps everything finished; the same command later computes only what is missing, and a
larger `n` reuses the first examples.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from ..errors import KVSumError
from ..eval.runner import _configs, _row, prefill_example, record
from ..eval.tasks import DEPTHS, example_seed, get_task
from .specs import Store


def _example(task, tokenizer, length: int, seed: int, i: int):
    return task.example(tokenizer, length, example_seed(seed, i), DEPTHS[i % len(DEPTHS)])


def evaluate(model, tokenizer, model_name: str, tasks: list[str], specs: list[tuple[str, dict]],
             budgets: list[float], length: int, n: int, seed: int, store: Store, deadline: float | None = None,
             on_unit: Callable[[str], None] | None = None) -> tuple[list[dict], bool, dict[str, str]]:
    """Rows as `kvsum.eval.runner.run` makes them (one per task x config), whether every unit is done, errors.

    Rows of configurations with missing examples are left out until a later run completes them. A
    configuration that raises is reported in the errors ("method@budget" -> message), not cached.
    `on_unit(description)` is called once per (example, configuration) unit, cached or computed.
    """
    configs = _configs(specs, budgets)
    rows, complete, errors = [], True, {}
    for tname in tasks:
        t = get_task(tname)
        recs: list[list[dict]] = [[] for _ in configs]
        for i in range(n):
            base = dict(model=model_name, task=t.name, length=length, seed=seed, example=i)
            fields = [dict(base, method=name, knobs=knobs, budget=budget) for name, knobs, budget in configs]
            have = [store.get(f) for f in fields]
            missing = [j for j, h in enumerate(have) if h is None]
            if missing and not (deadline is not None and time.time() > deadline):
                done = _run_example(model, tokenizer, t, _example(t, tokenizer, length, seed, i),
                                    [configs[j] for j in missing], deadline)
                for j, rec in zip(missing, done):
                    if "error" not in rec or rec.get("deterministic"):
                        store.put(fields[j], rec)  # a KVSumError (e.g. a budget too small) stays one
                    have[j] = rec
            for j, h in enumerate(have):
                if h is not None and "error" in h:
                    errors[f"{configs[j][0]}@{configs[j][2]:g}"] = h["error"]
                    have[j] = None
            for j, h in enumerate(have):
                if h is None:
                    complete = complete and f"{configs[j][0]}@{configs[j][2]:g}" in errors
                else:  # records cached before global_* existed: models without sliding layers, where they agree
                    recs[j].append({"global_bytes": h["bytes"], "global_full_bytes": h["full_bytes"], **h})
                if on_unit:
                    on_unit(f"{t.name} example {i} {configs[j][0]}")
        rows += [_row(t, length, cfg, r) for cfg, r in zip(configs, recs) if len(r) == n]
    return rows, complete, errors


def _run_example(model, tokenizer, t, ex, configs, deadline) -> list[dict]:
    """Records for a prefix of `configs` on one example (stopping at the deadline), as the runner makes them."""
    pre, prefill_s, ref = prefill_example(model, tokenizer, t, ex, configs)
    out = []
    for name, knobs, budget in configs:
        if out and deadline is not None and time.time() > deadline:
            break
        try:
            out.append(record(model, tokenizer, t, ex, pre, prefill_s, ref, name, knobs, budget))
        except Exception as e:  # one broken configuration must not sink a long report run
            out.append(dict(error=f"{type(e).__name__}: {e}", deterministic=isinstance(e, KVSumError)))
    return out
