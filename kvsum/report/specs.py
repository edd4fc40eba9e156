"""Which methods a report or a stability audit covers, and the knobs each needs to run at all."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from ..errors import KVSumError
from ..methods import REGISTRY


def artifact_path(model_name: str) -> Path:
    """Where `kvsum calibrate --model M` writes the reconstruction artifact by default."""
    from ..models import cache_dir

    return cache_dir() / f"{Path(model_name).name}-reconstruct.kvsum"


def method_specs(names: list[str] | None, model_name: str, skip: tuple[str, ...] = ()) -> tuple[list, list[str]]:
    """(name, knobs) for each method and notes on those left out. "all" stands for every registered method;
    compositions ("summary+turboquant") are named explicitly.

    Methods with an `artifact` knob get the default calibration artifact; without one they are left out
    with a note saying how to make it (rather than failing the whole run).
    """
    names = names or ["all"]
    names = list(dict.fromkeys(n for item in names for n in (sorted(REGISTRY) if item == "all" else [item])))
    specs, notes = [], []
    for name in names:
        if "+" in name:  # a composition "a+b" (kvsum/methods/compose.py): make_method checks it
            from ..methods import make_method

            make_method(name)
        elif name not in REGISTRY:
            raise KVSumError(f"unknown method {name!r}; accepted: all, {', '.join(sorted(REGISTRY))} "
                             "or a composition such as summary+turboquant")
        if name in skip:
            continue
        knobs = {}
        if "+" not in name and "artifact" in REGISTRY[name].knobs():
            path = artifact_path(model_name)
            if not path.is_file():
                notes.append(f"{name}: left out, no calibration artifact at {path} (run `kvsum calibrate "
                             f"--model {model_name}`)")
                continue
            knobs["artifact"] = str(path)
        specs.append((name, knobs))
    return specs, notes


def key(**fields) -> str:
    """A stable file name for one cached result: a hash of its defining fields."""
    blob = json.dumps(fields, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


class Store:
    """One JSON file per result under `folder`; what a second run with the same settings reuses."""

    def __init__(self, folder: str | Path, fresh: bool = False):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.fresh = fresh
        self.hits = self.misses = 0

    def get(self, fields: dict):
        path = self.folder / f"{key(**fields)}.json"
        if self.fresh or not path.is_file():
            self.misses += 1
            return None
        self.hits += 1
        return json.loads(path.read_text())["result"]

    def put(self, fields: dict, result) -> None:
        path = self.folder / f"{key(**fields)}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"fields": fields, "result": result}, default=str))
        tmp.replace(path)
