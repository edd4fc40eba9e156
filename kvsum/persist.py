"""Saved caches: a `kvsum.Cache` as one safetensors file (never pickle) and back, in this process or another.

The file holds every tensor the cache holds, as it holds it (packed codes stay packed, so the file is about
`cache.nbytes()`), and in its metadata one JSON document (one entry: safetensors writes several in an order that
varies from save to save, and the same cache must give the same bytes, for stores keyed by content): a header
(format version, the model's fingerprint, the method and its knobs, the budget, the token count, a SHA-256 of
everything else) and, under "graph", the object graph that ties the tensors together (the cache, its layers, their
states and decoding-time streams, as kvsum's own classes and their attributes; a class's `transient` attributes,
per-process tables, are left out and its `restore()` resolves them on load). Loading rebuilds only classes defined
in kvsum, by module and name, and only after the checksum, the format version and the model's fingerprint all
match; a truncated, altered or foreign file is one KVSumError and nothing is built.

`fork(obj)` copies such a graph sharing every tensor: kvsum never writes into a tensor it holds (a new token
replaces a layer's tensors, it does not write into them), so a fork costs Python objects, not bytes.
"""

from __future__ import annotations

import copy
import hashlib
import importlib
import json
import os
import uuid
from pathlib import Path

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from ._version import __version__  # not installed metadata: a source checkout has none
from .errors import KVSumError
from .shape import fingerprint as model_fingerprint
from .spec import format_value

FORMAT = 2  # the file layout this kvsum writes; it reads 1 too (the graph in a second metadata entry)
SUFFIX = ".kvsum"
GRAPH_SEPARATORS = (",", ":")  # the graph's text as digested (format 1 wrote it so; format 2 rebuilds it so)


class _Encoder:
    """An object graph -> JSON-able nodes + named tensors; shared objects and cycles become references."""

    def __init__(self):
        self.objects: list[dict] = []
        self.ids: dict[int, int] = {}
        self.tensors: dict[str, torch.Tensor] = {}
        self.tensor_ids: dict[int, str] = {}
        self.storages: set[tuple[int, int]] = set()
        self.keep: list = []  # what was memoized stays alive, so ids are not reused while encoding

    def node(self, x, where: str):
        if x is None or isinstance(x, bool | int | float | str):
            return x
        if isinstance(x, torch.Tensor):
            return {"$t": self.tensor(x)}
        if isinstance(x, torch.dtype):
            return {"$dtype": str(x).removeprefix("torch.")}
        if isinstance(x, torch.device):
            return {"$device": None}  # the device the cache is loaded onto
        if isinstance(x, torch.Size):
            return {"$size": list(x)}
        if isinstance(x, list):
            return [self.node(v, f"{where}[{i}]") for i, v in enumerate(x)]
        if isinstance(x, tuple):
            return {"$tuple": [self.node(v, f"{where}[{i}]") for i, v in enumerate(x)]}
        if isinstance(x, dict):
            return {"$dict": [[self.node(k, where), self.node(v, f"{where}[{k!r}]")] for k, v in x.items()]}
        cls = type(x)
        if cls.__module__.split(".")[0] != "kvsum" or not hasattr(x, "__dict__"):
            raise KVSumError(f"cannot save this cache: {where} holds a {cls.__module__}.{cls.__qualname__}, "
                             "not a kvsum state")
        if id(x) not in self.ids:
            self.ids[id(x)] = len(self.objects)
            self.keep.append(x)
            entry = {"cls": f"{cls.__module__}:{cls.__qualname__}"}
            self.objects.append(entry)
            skip = getattr(cls, "transient", ())
            entry["attrs"] = {k: self.node(v, f"{where}.{k}") for k, v in vars(x).items() if k not in skip}
        return {"$ref": self.ids[id(x)]}

    def tensor(self, t: torch.Tensor) -> str:
        if id(t) not in self.tensor_ids:
            self.keep.append(t)
            flat = t.detach().cpu().contiguous()
            key = (flat.untyped_storage().data_ptr(), flat.storage_offset())
            if key in self.storages or flat.untyped_storage().nbytes() != flat.numel() * flat.element_size():
                flat = flat.clone()  # a view into a larger or shared buffer: only its own bytes are written
            self.storages.add((flat.untyped_storage().data_ptr(), flat.storage_offset()))
            name = f"t{len(self.tensors)}"
            self.tensors[name], self.tensor_ids[id(t)] = flat, name
        return self.tensor_ids[id(t)]


def _digest(header: dict, graph: str, tensors: dict[str, torch.Tensor]) -> str:
    """SHA-256 of the header (less its own checksum), the graph and every tensor's name, dtype, shape and bytes."""
    h = hashlib.sha256(json.dumps({k: v for k, v in header.items() if k != "sha256"}, sort_keys=True).encode())
    h.update(graph.encode())
    for name in sorted(tensors):
        t = tensors[name]
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        if t.numel():
            h.update(t.contiguous().reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def to_bytes(cache) -> bytes:
    """The cache as the bytes of a .kvsum file (see the module docstring)."""
    if getattr(cache, "fingerprint", None) is None:
        raise KVSumError("cannot save this cache: it does not know its model (build it with kvsum.compress or "
                         "kvsum.compress_prefill, which record the model's fingerprint)")
    enc = _Encoder()
    root = enc.node(cache, "cache")
    tree = {"root": root, "objects": enc.objects}
    graph = json.dumps(tree, separators=GRAPH_SEPARATORS)
    config = getattr(cache, "config", None)
    header = dict(format=FORMAT, kvsum=__version__, fingerprint=cache.fingerprint, method=cache.method,
                  spec=format_value(config) if config is not None else cache.method, budget=cache.budget,
                  tokens=cache.get_seq_length(), batch=cache.batch_size, nbytes=cache.nbytes())
    header["sha256"] = _digest(header, graph, enc.tensors)
    return st_save(enc.tensors, metadata={"kvsum": json.dumps({**header, "graph": tree})})


def write_atomic(path: str | os.PathLike, data: bytes) -> Path:
    """Write `data` to `path` so that no reader ever sees a partial file: a temporary name in the same folder,
    fsync, then an atomic rename (a process killed mid-write leaves only a temporary file behind)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def save(cache, path: str | os.PathLike) -> Path:
    """Write the cache to `path` (atomically); returns the path."""
    return write_atomic(path, to_bytes(cache))


def _metadata(data: bytes) -> tuple[dict, dict]:
    """(header, object graph) of a file's bytes, or a KVSumError saying the file is not a kvsum cache."""
    try:
        n = int.from_bytes(data[:8], "little")
        if len(data) < 8 or n > len(data) - 8:
            raise ValueError("truncated header")
        meta = json.loads(data[8:8 + n]).get("__metadata__") or {}
        header = json.loads(meta.get("kvsum", "null"))
        header = header if isinstance(header, dict) else {}
        # format 2: an object inside the header (as a string its quotes were escaped twice); 1: an entry of its own
        graph = header.pop("graph", None) or json.loads(meta.get("graph", "null"))
    except (ValueError, UnicodeDecodeError) as e:
        raise KVSumError(f"not a kvsum cache file, or a truncated one ({e})") from None
    if not header or not isinstance(graph, dict):
        raise KVSumError("not a kvsum cache file: its safetensors metadata has no kvsum header")
    return header, graph


def read_header(source: str | os.PathLike | bytes) -> dict:
    """The header of a saved cache (format, fingerprint, method, spec, budget, tokens, nbytes, sha256)."""
    data = source if isinstance(source, bytes | bytearray) else _read(source)
    return _metadata(data)[0]


def _read(path) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise KVSumError(f"cannot read the saved cache {str(path)!r}: {e.strerror}") from None


def _class(name: str):
    module, _, qualname = name.partition(":")
    if module.split(".")[0] != "kvsum":
        raise KVSumError(f"refusing to load {name!r}: a saved cache holds only kvsum's own classes")
    try:
        obj = importlib.import_module(module)
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError):
        raise KVSumError(f"the saved cache needs {name!r}, which this kvsum ({__version__}) does not have") from None
    if not isinstance(obj, type):
        raise KVSumError(f"refusing to load {name!r}: not a class")
    return obj


def _decode(graph: dict, tensors: dict[str, torch.Tensor], device: torch.device):
    shells = [_class(o["cls"]).__new__(_class(o["cls"])) for o in graph["objects"]]

    def node(x):
        if isinstance(x, list):
            return [node(v) for v in x]
        if not isinstance(x, dict):
            return x
        (kind, v), = x.items()
        if kind == "$t":
            return tensors[v]
        if kind == "$ref":
            return shells[v]
        if kind == "$dtype":
            return getattr(torch, v)
        if kind == "$device":
            return device
        if kind == "$size":
            return torch.Size(v)
        if kind == "$tuple":
            return tuple(node(i) for i in v)
        if kind == "$dict":
            return {node(k): node(i) for k, i in v}
        raise KVSumError(f"a corrupt kvsum cache file: unknown node {kind!r}")

    for shell, o in zip(shells, graph["objects"]):
        vars(shell).update({k: node(v) for k, v in o["attrs"].items()})
    for shell in shells:
        if getattr(type(shell), "transient", ()):
            shell.restore()  # what a class keeps per process (its `transient` attributes) is resolved again
    return node(graph["root"])


def from_bytes(data: bytes, model=None, *, fingerprint: dict | None = None, device=None) -> object:
    """A kvsum.Cache from the bytes of a .kvsum file, checked against `model` (its fingerprint, onto its device).

    Without a model (a KV store's pages have none), give the `fingerprint` the bytes must carry and the `device`
    to load onto (default cpu); with neither model nor fingerprint, only the format and checksum are checked."""
    header, graph = _metadata(bytes(data))
    if header.get("format") not in (1, FORMAT):
        raise KVSumError(f"a kvsum cache file of format version {header.get('format')!r}; this kvsum "
                         f"({__version__}) reads versions 1 to {FORMAT}")
    try:
        tensors = st_load(bytes(data))
    except Exception as e:  # safetensors raises its own error types on a truncated or malformed file
        raise KVSumError(f"a truncated or corrupt kvsum cache file ({e})") from None
    if _digest(header, json.dumps(graph, separators=GRAPH_SEPARATORS), tensors) != header.get("sha256"):
        raise KVSumError("the kvsum cache file was altered or corrupted: its checksum does not match its contents")
    if model is not None:
        fingerprint, device = model_fingerprint(model), next(model.parameters()).device
    if fingerprint is not None and fingerprint != header.get("fingerprint"):
        raise KVSumError(f"this cache was saved for another model ({header.get('fingerprint')}); the model given "
                         f"is {fingerprint}")
    device = torch.device(device if device is not None else "cpu")
    cache = _decode(graph, {k: t.to(device) for k, t in tensors.items()}, device)
    if type(cache).__name__ != "Cache" or type(cache).__module__ != "kvsum.cache":
        raise KVSumError(f"a kvsum cache file whose root is a {type(cache).__qualname__}, not a kvsum.Cache")
    return cache


def load_cache(path: str | os.PathLike, model):
    """Load a cache saved with `cache.save(path)` for `model` (the same weights: checked by fingerprint).

    Greedy generations from the loaded cache are those of the saved one, bit for bit, decoding-time state
    (quantized groups, eviction observers) included."""
    return from_bytes(_read(path), model)


def _tensors(x, seen: set[int]):
    """Every tensor reachable from x through attributes, lists, tuples and dicts."""
    if id(x) in seen or x is None or isinstance(x, bool | int | float | str | torch.dtype | torch.device):
        return
    seen.add(id(x))
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, list | tuple | set | frozenset):
        for v in x:
            yield from _tensors(v, seen)
    elif isinstance(x, dict):
        for v in x.values():
            yield from _tensors(v, seen)
    elif hasattr(x, "__dict__") and not isinstance(x, type):
        for v in vars(x).values():
            yield from _tensors(v, seen)


def fork(obj):
    """A copy of an object graph that shares its tensors (see the module docstring)."""
    memo = {id(t): t for t in _tensors(obj, set())}
    return copy.deepcopy(obj, memo)
