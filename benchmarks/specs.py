"""Method spec strings as the benchmarks write them: `name:knob=value,...`, own budgets after `@` (no torch)."""

from __future__ import annotations

from kvsum.spec import parse_spec


def parse_method(text: str) -> tuple[str, dict]:
    """A method given as `name` or `name:knob=value,...` (kvsum.spec's grammar; method-valued knobs nested)."""
    s = parse_spec(text)
    return s.name, dict(s.knobs)


def parse_row(text: str) -> tuple[str, dict, list[float] | None]:
    """A method spec with its own budgets after `@` (`snapkv@0.5,0.25`): (name, knobs, budgets or None)."""
    body, at, budgets = text.rpartition("@") if "@" in text else (text, "", "")
    name, knobs = parse_method(body)
    return name, knobs, [float(b) for b in budgets.split(",")] if at else None


def method_rows(specs: list[str], budgets: list[float]) -> list[tuple[str, dict, list[float]]]:
    """(name, knobs, budgets) triples for kvsum.eval.run: a spec's own budgets, else `budgets`."""
    return [(name, knobs, own or list(budgets)) for name, knobs, own in map(parse_row, specs)]
