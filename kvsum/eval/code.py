"""A code haystack: the Python standard library's own source files, with needles that are code facts.

The files are every `.py` file of a fixed set of pure-Python stdlib packages (`PACKAGES`) under
`sysconfig.get_paths()["stdlib"]`, sorted by path, without test folders and without files that do not parse.
So the haystack depends on the interpreter's stdlib: it is the same on any machine with the same Python minor
version (a patch release may edit a file). Top-level modules are left out because kvsum.calibrate fits echokv and
lowrank on them (the haystack must not be calibration text), and pydoc_data is the prose haystack.

A haystack is the files in a seeded order, each a `# file: <path>` line then its top-level statements (one unit
each, so that needles go between top-level statements and the code stays valid Python), cut to an exact token
length: the first unit loses its front, the last file stops after a whole statement.
"""

from __future__ import annotations

import ast
import random
import sysconfig
from functools import lru_cache
from pathlib import Path

from ..errors import KVSumError

PACKAGES = ("asyncio", "collections", "concurrent", "ctypes", "curses", "dbm", "email", "html", "http",
            "importlib", "json", "logging", "multiprocessing", "re", "sqlite3", "tomllib", "unittest", "urllib",
            "venv", "wsgiref", "xml", "xmlrpc", "zoneinfo")

ADJECTIVES = ("brave", "calm", "eager", "fancy", "gentle", "happy", "jolly", "kind", "lively", "merry", "nimble",
              "proud", "quiet", "rapid", "silly", "tidy", "vivid", "witty", "zesty", "bold", "crisp", "dusty",
              "frosty", "grand", "hollow", "icy", "lucky", "mellow", "noble", "rusty")
VERBS = ("resolve", "normalize", "compute", "validate", "render", "dispatch", "encode", "collect", "refresh",
         "schedule", "parse", "merge", "flush", "archive", "select", "convert")
NOUNS = ("path", "index", "buffer", "header", "token", "record", "payload", "window", "entry", "digest", "queue",
         "handle")
SUFFIXES = ("LIMIT", "BUDGET", "TIMEOUT", "OFFSET", "THRESHOLD", "CAPACITY", "RETRIES", "INTERVAL")
KINDS = ("Registry", "Manager", "Handler", "Builder", "Adapter", "Resolver", "Monitor", "Factory")


def _is_test(parts: tuple[str, ...]) -> bool:
    return any(p in ("test", "tests", "idle_test") or p.startswith("test_") for p in parts)


def chunks(source: str) -> tuple[tuple[str, ...], int] | None:
    """Top-level statement units of a file (each ends with a newline; comments and blank lines stay with the
    statement before them) and the first unit a needle may precede (after any `from __future__` import).
    None if the file does not parse."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return None
    lines = source.splitlines(keepends=True)
    starts = [min([s.lineno, *(d.lineno for d in getattr(s, "decorator_list", ()))]) - 1 for s in tree.body]
    if not starts:
        return None
    starts[0] = 0
    units = tuple("".join(lines[a:b]) for a, b in zip(starts, [*starts[1:], len(lines)]))
    units = tuple(u if u.endswith("\n") else u + "\n" for u in units)
    futures = [i for i, s in enumerate(tree.body) if isinstance(s, ast.ImportFrom) and s.module == "__future__"]
    return units, max(futures, default=0) + 1


@lru_cache(maxsize=4)
def files(packages: tuple[str, ...] = PACKAGES) -> tuple[tuple[str, tuple[str, ...], int], ...]:
    """(path under the stdlib, statement units, first unit a needle may precede) per file, sorted by path."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for pkg in packages:
        for f in sorted((root / pkg).rglob("*.py")):
            rel = f.relative_to(root)
            if _is_test(rel.parts):
                continue
            parsed = chunks(f.read_text(encoding="utf-8", errors="replace"))
            if parsed is not None:
                out.append((rel.as_posix(), *parsed))
    if not out:
        raise KVSumError(f"no parseable stdlib sources found under {root} for packages {', '.join(packages)}")
    return tuple(sorted(out))


def haystack(tokenizer, n_tokens: int, seed: int, packages: tuple[str, ...] = PACKAGES
             ) -> tuple[list[list[int]], list[bool]]:
    """Token ids of code units that, concatenated, are exactly `n_tokens` long, and per unit whether a needle may
    go right before it (a top-level statement boundary). Files come in a seeded order; each starts with a
    `# file: <path>` unit. Raises KVSumError naming the longest reachable length when the files run out."""
    order = list(files(packages))
    random.Random(f"code-{seed}").shuffle(order)
    units: list[list[int]] = []
    allowed: list[bool] = []
    total = 0
    for path, parts, first in order:
        texts = [f"\n# file: {path}\n", *parts]
        for k, ids in enumerate(tokenizer(texts, add_special_tokens=False).input_ids):
            units.append(list(ids))
            allowed.append(k == 0 or k > first)  # unit k > 0 is statement k - 1; none before a future import
            total += len(ids)
            if total >= n_tokens:
                break
        if total >= n_tokens:
            break
    else:
        raise KVSumError(f"the code haystack cannot reach {n_tokens} tokens: the stdlib packages it uses "
                         f"({len(order)} files) give at most {total} tokens with this tokenizer")
    excess = total - n_tokens
    while units and excess >= len(units[0]):
        excess -= len(units.pop(0))
        allowed.pop(0)
    if units:
        units[0] = units[0][excess:]
        allowed[0] = False  # cut at its front: not a statement start
    return units, allowed


def names(rng: random.Random, words: list[str], kind: str) -> list[str]:
    """One fresh identifier per (distinct) key word: a constant (BRAVE_LANTERN_LIMIT), a function
    (resolve_lantern_path) or a class (BraveLanternRegistry)."""
    if kind == "constant":
        return [f"{rng.choice(ADJECTIVES)}_{w}_{rng.choice(SUFFIXES)}".upper() for w in words]
    if kind == "function":
        return [f"{rng.choice(VERBS)}_{w}_{rng.choice(NOUNS)}" for w in words]
    return [f"{rng.choice(ADJECTIVES).title()}{w.title()}{rng.choice(KINDS)}" for w in words]


def constant(name: str, value: str, quoted: bool) -> str:
    """A module constant line, `NAME = 48213` or `NAME = "lantern"`."""
    return f"{name} = {value!r}\n" if quoted else f"{name} = {value}\n"


def call(caller: str, callee: str) -> str:
    """A top-level function whose only call is to `callee`."""
    return f"\n\ndef {caller}(value):\n    return {callee}(value)\n"


def method(cls: str, meth: str) -> str:
    """A top-level class that defines the method `meth`."""
    return f"\n\nclass {cls}:\n    def {meth}(self):\n        return self\n"
