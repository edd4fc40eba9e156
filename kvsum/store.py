"""`kvsum.Store`: compress a prompt once, load it afterwards, from any process sharing the directory.

An entry is one saved cache (kvsum.persist), named by the hash of what determines it: the model's fingerprint,
the prompt's token ids, the configured method (knobs included, defaults filled in) and the budget. Writers
never leave a partial entry (a temporary name, fsync, an atomic rename), and one lock file per key makes
processes that miss on the same prompt at once compress it once: the others wait and load. Past `max_bytes`
the least recently used entries (by modification time, which a hit refreshes) are removed.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import time
import warnings
from pathlib import Path

import torch

from .compress import compress
from .errors import KVSumError
from .methods import make_method
from .models import cache_dir
from .persist import SUFFIX, from_bytes, read_header, write_atomic
from .shape import fingerprint
from .spec import format_value


def default_directory() -> Path:
    """The `store` folder of kvsum's cache ($KVSUM_CACHE, else ~/.cache/kvsum): the CLI's `kvsum store` default."""
    return cache_dir() / "store"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class Store:
    """A directory of compressed prefixes: `store.get_or_compress(model, ids, method=..., budget=...)`.

    `max_bytes`: the size the directory is held to after each write (None: unbounded); the entry just written
    is kept even when it alone exceeds it. `hits` and `compressions` count this object's own calls."""

    def __init__(self, directory: str | os.PathLike | None = None, max_bytes: int | None = None):
        if max_bytes is not None and (isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0):
            raise KVSumError(f"max_bytes must be a number of bytes >= 0 or None, got {max_bytes!r}")
        self.directory = Path(directory) if directory is not None else default_directory()
        self.directory.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self.hits = self.compressions = 0

    def key(self, model, ids: torch.Tensor, method: str = "summary", budget: float = 0.25,
            storage_dtype: torch.dtype = torch.float16, **knobs) -> str:
        """The entry's name: a hash of the model's fingerprint, the token ids, the method with its knobs (as the
        built config, so a default passed by name and one left out are the same entry) and the budget."""
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.shape[0] != 1:
            raise KVSumError(f"a store entry is one prompt: ids of shape (1, T), got "
                             f"{tuple(ids.shape) if isinstance(ids, torch.Tensor) else type(ids).__name__}")
        what = [fingerprint(model), format_value(make_method(method, **knobs)), float(budget), str(storage_dtype)]
        h = hashlib.sha256(json.dumps(what, sort_keys=True).encode())
        h.update(ids.detach().to(torch.int64).cpu().contiguous().numpy().tobytes())
        return h.hexdigest()[:32]

    def path(self, key: str) -> Path:
        return self.directory / f"{key}{SUFFIX}"

    def get(self, key: str, model=None, *, fingerprint: dict | None = None, device=None):
        """The saved cache for `key` loaded onto `model` (or checked against `fingerprint` and loaded onto
        `device`, for callers with no transformers model, such as a KV connector's pages), or None if there is
        none. A hit refreshes the entry's use time. An entry that does not load (altered on disk, another
        model's) raises KVSumError."""
        path = self.path(key)
        try:
            data = path.read_bytes()
            os.utime(path)
        except FileNotFoundError:  # never written, or removed by another process's eviction meanwhile
            return None
        self.hits += 1
        return from_bytes(data, model, fingerprint=fingerprint, device=device)

    def put(self, key: str, cache) -> Path:
        """Save `cache` as `key` (atomically), then hold the directory to `max_bytes`."""
        path = write_atomic(self.path(key), cache.to_bytes())
        self.evict(keep=path)
        return path

    def _load(self, key: str, model):
        """get(), but an entry damaged on disk is removed (with a warning) and counts as a miss."""
        try:
            return self.get(key, model)
        except KVSumError as e:
            warnings.warn(f"kvsum.Store: removing the damaged entry {key} ({e})", stacklevel=3)
            self.rm(key)
            return None

    @contextlib.contextmanager
    def _lock(self, key: str):
        locks = self.directory / ".locks"
        locks.mkdir(exist_ok=True)
        with open(locks / f"{key}.lock", "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)  # released by the OS if this process dies
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def get_or_compress(self, model, ids: torch.Tensor, method: str = "summary", budget: float = 0.25, *,
                        storage_dtype: torch.dtype = torch.float16, tokenizer=None, **knobs):
        """The compressed cache of `ids`: loaded when the store has it, else compressed (kvsum.compress, same
        arguments), saved and returned. Concurrent callers on the same prompt compress it once; an entry damaged
        on disk is replaced."""
        key = self.key(model, ids, method, budget, storage_dtype, **knobs)
        cache = self._load(key, model)
        if cache is not None:
            return cache
        with self._lock(key):
            cache = self._load(key, model)  # written by another process while this one waited
            if cache is not None:
                return cache
            cache = compress(model, ids, method=method, budget=budget, storage_dtype=storage_dtype,
                             tokenizer=tokenizer, **knobs)
            self.put(key, cache)
            self.compressions += 1
            return cache

    def _entries(self) -> list[Path]:
        return [p for p in self.directory.glob(f"*{SUFFIX}") if not p.name.startswith(".")]

    def _sweep(self) -> None:
        """Remove temporary files left by writers that died mid-write (their process no longer runs)."""
        for tmp in self.directory.glob(f".*{SUFFIX}.*.tmp"):
            pid = tmp.name.rsplit(".", 3)[-3]
            if pid.isdigit() and not _alive(int(pid)):
                tmp.unlink(missing_ok=True)

    def ls(self) -> list[dict]:
        """One row per entry, most recently used first: key, bytes, last use (epoch seconds) and the saved
        header's method spec, budget and token count."""
        rows = []
        for p in self._entries():
            try:
                st, h = p.stat(), read_header(p)
            except (FileNotFoundError, KVSumError):
                continue
            rows.append(dict(key=p.name[:-len(SUFFIX)], bytes=st.st_size, used=st.st_mtime, spec=h.get("spec"),
                             budget=h.get("budget"), tokens=h.get("tokens")))
        return sorted(rows, key=lambda r: -r["used"])

    def du(self) -> int:
        """Bytes the entries take on disk."""
        self._sweep()
        total = 0
        for p in self._entries():
            with contextlib.suppress(FileNotFoundError):
                total += p.stat().st_size
        return total

    def rm(self, key: str) -> bool:
        """Remove one entry; False if there was none."""
        path = self.path(key)
        (self.directory / ".locks" / f"{key}.lock").unlink(missing_ok=True)
        if path.exists():
            path.unlink(missing_ok=True)
            return True
        return False

    def clear(self) -> int:
        """Remove every entry; returns how many there were."""
        return sum(self.rm(p.name[:-len(SUFFIX)]) for p in self._entries())

    def evict(self, keep: Path | None = None) -> list[str]:
        """Remove least recently used entries until the directory holds at most `max_bytes` (never `keep`)."""
        self._sweep()
        if self.max_bytes is None:
            return []
        sized = []
        for p in self._entries():
            with contextlib.suppress(FileNotFoundError):
                st = p.stat()
                sized.append((st.st_mtime, st.st_size, p))
        total, removed = sum(s for _, s, _ in sized), []
        for _, size, p in sorted(sized, key=lambda e: e[0]):
            if total <= self.max_bytes:
                break
            if keep is not None and p == keep:
                continue
            p.unlink(missing_ok=True)
            total -= size
            removed.append(p.name[:-len(SUFFIX)])
        return removed

    def __repr__(self) -> str:
        return f"Store({str(self.directory)!r}, max_bytes={self.max_bytes})"


def age(seconds: float) -> str:
    """A last-use time as a short age, for `kvsum store ls`."""
    d = max(0.0, time.time() - seconds)
    for unit, n in (("d", 86400), ("h", 3600), ("m", 60)):
        if d >= n:
            return f"{d / n:.0f}{unit}"
    return f"{d:.0f}s"
