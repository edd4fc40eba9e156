"""Which methods a report or a stability audit covers, and the knobs each needs to run at all."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from ..errors import KVSumError
from ..methods import REGISTRY, make_method
from ..spec import Spec, format_spec, parse_spec


def artifact_path(model_name: str) -> Path:
    """Where `kvsum calibrate --model M` wrote the reconstruction artifact before artifacts were named by the
    model's fingerprint; a file there is still passed on as `artifact=`."""
    from ..models import cache_dir

    return cache_dir() / f"{Path(model_name).name}-reconstruct.kvsum"


def _calibrated(method: str) -> bool:
    """Whether `kvsum calibrate` saved an artifact for `method` under the cache (named by a model fingerprint:
    the method finds the one of its model, and says so clearly when it does not)."""
    from ..models import cache_dir

    folder = cache_dir() / "calibration"
    return any(folder.glob(f"*.{method}.kvsum")) or any(folder.glob("*.all.kvsum"))


def method_specs(names: list | None, model_name: str, skip: tuple[str, ...] = ()) -> tuple[list, list[str]]:
    """(name, knobs) for each method and notes on those left out. A name may be a spec string
    ("summary:score=surprisal") or a kvsum.spec.Spec; "all" stands for every registered method;
    compositions ("summary+turboquant") are named explicitly.

    Methods with an `artifact` knob run on the model's calibration artifact; without one they are left out
    with a note saying how to make it (rather than failing the whole run).
    """
    given = [n if isinstance(n, Spec) else parse_spec(n) for n in names or ["all"]]
    items = [s for g in given for s in ([Spec(n, {}) for n in sorted(REGISTRY)] if g == ("all", {}) else [g])]
    specs, notes, seen = [], [], set()
    for name, knobs in items:
        key_ = (name, repr(knobs))
        if key_ in seen:
            continue
        seen.add(key_)
        if "+" not in name and name not in REGISTRY:
            raise KVSumError(f"unknown method {name!r}; accepted: all, {', '.join(sorted(REGISTRY))} "
                             "or a composition such as summary+turboquant")
        if knobs or "+" in name:
            make_method(name, **knobs)  # a bad knob or composition fails here, before any model work
        if name in skip:
            continue
        knobs = dict(knobs)
        if "+" not in name and "artifact" in REGISTRY[name].knobs() and "artifact" not in knobs:
            path = artifact_path(model_name)
            if path.is_file():
                knobs["artifact"] = str(path)
            elif not _calibrated(name):
                notes.append(f"{name}: left out, no calibration artifact (run `kvsum calibrate --model {model_name}`)")
                continue
        specs.append((name, knobs))
    return specs, notes


def label(name: str, knobs: dict) -> str:
    """How a report names a configuration: its spec string, without the artifact path method_specs adds."""
    return format_spec(Spec(name, {k: v for k, v in knobs.items() if k != "artifact"}))


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
