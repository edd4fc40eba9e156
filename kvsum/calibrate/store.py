"""Where artifacts live and how a method gets one: by path, as an object, or by the model's fingerprint.

`kvsum calibrate --model M` saves to `default_artifact_path(fingerprint(M), method)` under kvsum's cache
folder ($KVSUM_CACHE, else ~/.cache/kvsum); a method with `artifact=None` then finds it there by the
fingerprint of the model it compresses. Artifacts read from files are kept in a small module-level cache
keyed by (resolved path, mtime, size), so the fits they memoize serve every prompt, and a rewritten file
is read again.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from pathlib import Path

from ..errors import KVSumError
from ..models import cache_dir
from .artifact import Artifact, describe

METHODS = ("echokv", "lowrank", "all")
LOADED_MAX = 4  # artifacts kept read (each holds its moments and the fits derived from them)

_loaded: OrderedDict[tuple, Artifact] = OrderedDict()
_lock = threading.Lock()


def default_artifact_path(fp: dict, method: str = "all") -> Path:
    """Where the artifact of `method` ("echokv", "lowrank" or "all") for the model with fingerprint `fp` is
    saved by default and looked up: <cache>/calibration/<type>-<layers>x<kv heads>x<head dim>-<hash>.<method>.kvsum."""
    if method not in METHODS:
        raise KVSumError(f"calibrate: method {method!r}; accepted: {', '.join(METHODS)}")
    stem = f"{fp['model_type']}-{fp['layers']}x{fp['kv_heads']}x{fp['head_dim']}-{fp['weights_sha256']}"
    return cache_dir() / "calibration" / f"{stem}.{method}.kvsum"


def load_cached(path) -> Artifact:
    """Artifact.load(path), read once while the file is unchanged (same mtime and size)."""
    p = Path(path)
    try:
        st = p.resolve().stat()
    except OSError:
        return Artifact.load(p)  # says the file does not exist
    key = (str(p.resolve()), st.st_mtime_ns, st.st_size)
    with _lock:
        art = _loaded.get(key)
        if art is not None:
            _loaded.move_to_end(key)
            return art
    art = Artifact.load(p)
    with _lock:
        art = _loaded.setdefault(key, art)
        while len(_loaded) > LOADED_MAX:
            _loaded.popitem(last=False)
    return art


def find_artifact(fp: dict, method: str) -> Path | None:
    """The saved artifact that serves `method` for the model with fingerprint `fp`, or None."""
    for which in (method, "all"):
        path = default_artifact_path(fp, which)
        if path.is_file():
            return path
    return None


def _by_fingerprint(fp: dict | None, method: str) -> Artifact:
    how = (f"{method} needs artifact=<path or kvsum.calibrate.Artifact>, or one calibrated for this model: run "
           "`kvsum calibrate --model M` (M: the bundled name or folder the model was loaded from)")
    if fp is None:
        raise KVSumError(f"{how}; this model has no fingerprint (no k_proj weight), so pass artifact=")
    path = find_artifact(fp, method)
    if path is None:
        raise KVSumError(f"{how}; it is looked up at {default_artifact_path(fp, method)} by the model's fingerprint "
                         f"({describe(fp)})")
    try:
        art = load_cached(path)
    except KVSumError as e:
        raise KVSumError(f"{method}: the calibration artifact found for this model is unreadable or stale ({e}); "
                         "rerun `kvsum calibrate --model M`") from None
    if art.fingerprint != fp:
        raise KVSumError(f"{method}: the calibration artifact at {path} is for {describe(art.fingerprint)}, but the "
                         f"model is {describe(fp)}; rerun `kvsum calibrate --model M`")
    return art


def resolve(artifact, method: str, fp: dict | None = None) -> Artifact:
    """The Artifact behind a method's `artifact` knob: an Artifact as given, a path read (and cached), or, for
    None, the one saved for the model with fingerprint `fp` (LayerInput.fingerprint)."""
    if isinstance(artifact, Artifact):
        return artifact
    if isinstance(artifact, (str, os.PathLike)):
        return load_cached(artifact)
    if artifact is None:
        return _by_fingerprint(fp, method)
    raise KVSumError(f"{method} needs artifact=<path or kvsum.calibrate.Artifact>; create one with "
                     f"kvsum.calibrate.calibrate(model, tokenizer, method={method!r}).save(path)")


def artifact_for(x, method: str, value) -> Artifact:
    """The shape-checked Artifact a method's `artifact` knob `value` gives for layer input `x`."""
    art = resolve(value, method, getattr(x, "fingerprint", None))
    art.check_shape(method, x.n_layers, x.H, x.d)
    return art
