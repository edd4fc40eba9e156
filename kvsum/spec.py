"""Method spec strings, the way the CLI and the benchmarks name a configured method (no torch needed).

Grammar::

    spec   := name [":" knobs] | name "(" [knobs] ")"
    knobs  := knob ("," knob)*
    knob   := key "=" value
    value  := "'...'" | '"..."' | name "(" [knobs] ")" | bare

A name may compose methods with `+` ("summary+turboquant"); a key may be dotted (compositions route
"snapkv.window" to a part). A bare value is read as a bool (true / false, any case), None (none, any case),
an int, a float, or else the text itself; a quoted value is always a string. A value written as a call is a
nested spec: `summary:cover=turboquant(bits=3.5,center=True),score=surprisal`.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, NamedTuple

from .errors import KVSumError

_NAME = re.compile(r"[A-Za-z_][\w.+-]*")
_KEY = re.compile(r"[A-Za-z_][\w.]*")


class Spec(NamedTuple):
    """A method name and its knobs; a knob whose value is a method holds a nested Spec."""

    name: str
    knobs: dict[str, Any]

    def __str__(self) -> str:
        return format_spec(self)


def parse_spec(text: str) -> Spec:
    """Parse one spec string (see the module docstring); raises KVSumError naming the position of a mistake."""
    if not isinstance(text, str):
        raise KVSumError(f"a method spec is a string such as 'summary:score=surprisal', got {text!r}")
    p = _Parser(text.strip())
    spec = p.spec(top=True)
    p.end()
    return spec


def parse_specs(text: str) -> list[Spec]:
    """Several specs separated by commas: an item without `=` starts the next method
    ("summary:score=surprisal,snapkv:window=16,full" is three)."""
    items = _split(text.strip(), ",")
    groups: list[list[str]] = []
    for item in items:
        if groups and "=" in item and ":" not in item.split("=", 1)[0] and "(" not in item.split("=", 1)[0]:
            groups[-1].append(item)
        else:
            groups.append([item])
    return [parse_spec(",".join(g)) for g in groups]


def format_spec(spec: Spec) -> str:
    """The spec string that parses back to `spec` (nested specs in the call form)."""
    return spec.name + (":" + _knobs_text(spec.knobs) if spec.knobs else "")


def _knobs_text(knobs: dict) -> str:
    return ",".join(f"{k}={_value_text(v)}" for k, v in knobs.items())


def format_value(v) -> str:
    """A knob value as a spec writes it; a method config (a dataclass with a `name`) as name(changed knobs)."""
    return _value_text(v)


def _value_text(v) -> str:
    if isinstance(v, Spec):
        return f"{v.name}({_knobs_text(v.knobs)})"
    if dataclasses.is_dataclass(v) and not isinstance(v, type) and isinstance(getattr(v, "name", None), str):
        changed = {f.name: getattr(v, f.name) for f in dataclasses.fields(v)
                   if f.default is dataclasses.MISSING or getattr(v, f.name) != f.default}
        return f"{v.name}({_knobs_text(changed)})"
    if isinstance(v, str):
        return v if _bare(v) == v and re.fullmatch(r"[^,()'\"=]+", v) else repr(v)
    return str(v)


def _bare(text: str):
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    if low == "none":
        return None
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def _split(text: str, sep: str) -> list[str]:
    """`text` cut at `sep` outside quotes and parentheses."""
    out, depth, quote, start = [], 0, None, 0
    for i, c in enumerate(text):
        if quote:
            quote = None if c == quote else quote
        elif c in "'\"":
            quote = c
        elif c == "(":
            depth += 1
        elif c == ")":
            depth -= 1
        elif c == sep and depth == 0:
            out.append(text[start:i])
            start = i + 1
    return out + [text[start:]]


class _Parser:
    def __init__(self, text: str):
        self.text, self.i = text, 0

    def fail(self, what: str):
        raise KVSumError(f"method spec {self.text!r}: {what} at position {self.i} "
                         "(write name:knob=value,knob=value; a method-valued knob as name(knob=value))")

    def peek(self) -> str:
        while self.text[self.i:self.i + 1] == " ":
            self.i += 1
        return self.text[self.i] if self.i < len(self.text) else ""

    def match(self, pattern: re.Pattern, what: str) -> str:
        self.peek()
        m = pattern.match(self.text, self.i)
        if not m:
            self.fail(f"expected {what}")
        self.i = m.end()
        return m.group()

    def end(self) -> None:
        if self.peek():
            self.fail(f"unexpected {self.peek()!r}")

    def spec(self, top: bool = False) -> Spec:
        name = self.match(_NAME, "a method name")
        if self.peek() == "(":
            self.i += 1
            knobs = {} if self.peek() == ")" else self.knobs(")")
            if self.peek() != ")":
                self.fail("expected ')'")
            self.i += 1
            return Spec(name, knobs)
        if top and self.peek() == ":":
            self.i += 1
            return Spec(name, self.knobs(""))
        return Spec(name, {})

    def knobs(self, close: str) -> dict:
        knobs = {}
        while True:
            key = self.match(_KEY, "a knob name")
            if self.peek() != "=":
                self.fail(f"expected '=' after knob {key!r}")
            self.i += 1
            if key in knobs:
                self.fail(f"knob {key!r} given twice")
            knobs[key] = self.value(close)
            if self.peek() != ",":
                return knobs
            self.i += 1

    def value(self, close: str):
        c = self.peek()
        if c in ("'", '"'):
            j = self.text.find(c, self.i + 1)
            if j < 0:
                self.fail("unterminated quote")
            out, self.i = self.text[self.i + 1:j], j + 1
            return out
        m = _NAME.match(self.text, self.i)
        if m and m.end() < len(self.text) and self.text[m.end()] == "(":
            return self.spec()
        j = self.i
        while j < len(self.text) and self.text[j] not in ",()" + close:
            j += 1
        raw = self.text[self.i:j].strip()
        if not raw:
            self.fail("expected a value")
        if re.fullmatch(r"[A-Za-z_][\w.+-]*:.*=.*", raw):
            self.fail(f"a method-valued knob is written name(knob=value), not {raw!r}")
        self.i = j
        return _bare(raw)
