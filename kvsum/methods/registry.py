"""The registry: method names to their config classes, and the factory that builds one from a name and knobs.

`make_method("a+b", **knobs)` composes method `a` with quantizer `b` (kvsum/methods/compose.py says what a
composition does). Knobs go to the part that declares them; a knob both declare (`seed`, `window` ...) is
written with its part's name in front, `snapkv_window=32` or `snapkv.window=32` (either works for any knob).
A knob value may be a method: a built `Method`, a `kvsum.spec.Spec`, or a spec string for a method-typed
knob (`cover="turboquant(bits=3.5)"`). make_method builds every spec, its name included: a Spec or a spec string
(`make_method("snapkv+turboquant:key_shift=1")`), so a configuration copied from a result table builds as it reads.
"""

from __future__ import annotations

import dataclasses
import sys
import typing
from types import UnionType

from ..errors import KVSumError
from ..spec import Spec, parse_spec
from .base import Method
from .compose import Composed
from .quantizer import Quantizer

REGISTRY: dict[str, type[Method]] = {}


def register(cls):
    """Class decorator: make a method available to kvsum.compress by its `name`."""
    if not (isinstance(cls, type) and issubclass(cls, Method)) or not isinstance(cls.name, str) or not cls.name:
        raise KVSumError(f"register takes a kvsum.Method subclass with a non-empty `name`, got {cls!r}")
    REGISTRY[cls.name] = cls
    return cls


def prefill_needs(methods) -> dict:
    """The kvsum.prefill extras any of `methods` asks for (the union of their prefill_options), as keywords;
    a value "optional" (sentence ends where a tokenizer is given) gives way to True."""
    out = {}
    for m in methods:
        for k, v in m.prefill_options().items():
            if v and out.get(k) is not True:  # True (needed) over "optional" (used where available)
                out[k] = v
    return out


def make_method(name: str | Spec, **knobs) -> Method:
    """Build a registered method from its name and keyword knobs, with clear errors for either.
    "a+b" composes a method with a quantizer (see the module docstring for how knobs are routed). The name may be a
    Spec or a spec string with its knobs, as the CLI and the result tables write one ("turboquant:bits=2.5,skew=0",
    "turboquant(bits=2.5)")."""
    if isinstance(name, Spec) or (isinstance(name, str) and (":" in name or "(" in name)):
        spec = name if isinstance(name, Spec) else parse_spec(name)
        both = sorted(set(spec.knobs) & set(knobs))
        if both:
            raise KVSumError(f"knob {', '.join(both)} given twice: in {str(name)!r} and as a keyword")
        return make_method(spec.name, **spec.knobs, **knobs)
    if isinstance(name, str) and "+" in name:
        return _compose(name, knobs)
    if name not in REGISTRY:
        raise KVSumError(f"unknown method {name!r}; accepted: {', '.join(sorted(REGISTRY))}")
    cls = REGISTRY[name]
    unknown = set(knobs) - set(cls.knobs())
    if unknown:
        raise KVSumError(f"method {name!r} has no knob {', '.join(sorted(unknown))}; "
                         f"accepted: {', '.join(cls.knobs()) or 'none'}")
    defaults = {f.name: f.default for f in dataclasses.fields(cls)}
    kinds = _method_fields(cls)
    built = {}
    for knob, value in knobs.items():
        built[knob] = value = _build(name, knob, value, kinds.get(knob))
        _check_knob(name, knob, value, defaults[knob], kinds.get(knob))
    return cls(**built)


def _method_fields(cls) -> dict[str, tuple[type, ...]]:
    """The knobs of `cls` typed as methods, with the Method classes each accepts."""
    out = {}
    for f in dataclasses.fields(cls):
        hint = f.type
        if isinstance(hint, str):  # postponed annotation: resolve it in the module that defines the class
            try:
                hint = eval(hint, vars(sys.modules[cls.__module__]))
            except (NameError, AttributeError, TypeError, SyntaxError):  # unresolvable: not a method type
                continue
        args = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, UnionType) else (hint,)
        kinds = tuple(a for a in args if isinstance(a, type) and issubclass(a, Method))
        if kinds:
            out[f.name] = kinds + ((type(None),) if type(None) in args else ())
    return out


def _build(method: str, knob: str, value, kinds: tuple[type, ...] | None):
    """A knob value with every Spec (and, for a method-typed knob, a spec string or name) built into a Method."""
    if isinstance(value, Spec) or (isinstance(value, str) and kinds):
        try:
            return make_method(value)
        except KVSumError as e:
            raise KVSumError(f"{method}: {knob}={value}: {e}") from None
    return value


def _check_knob(method: str, knob: str, value, default, kinds: tuple[type, ...] | None = None) -> None:
    """A knob takes the type of its default (bool, int >= 0, float >= 0 and finite, str); a method-typed knob
    (or one whose default is a method) takes a method of its type (None where its type or default allows it);
    None defaults take anything else (the method checks them)."""
    unset = default is None or default is dataclasses.MISSING
    if kinds or isinstance(default, Method) or (isinstance(value, Method) and unset):
        kinds = kinds or (Method,)
        if not isinstance(value, kinds) and not (value is None and default is None):
            names = " or ".join(k.__name__ for k in kinds if k is not type(None))
            raise KVSumError(f"{method}: {knob} must be a {names} (a method, its spec or spec string), got {value!r}")
        return
    if unset:
        return
    if isinstance(default, bool):
        ok, want = isinstance(value, bool), "True or False"
    elif isinstance(default, int):
        ok, want = isinstance(value, int) and not isinstance(value, bool) and value >= 0, "an integer >= 0"
    elif isinstance(default, float):
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value < float("inf")
        want = "a finite number >= 0"
    elif isinstance(default, str):
        ok, want = isinstance(value, str), "a string"
    else:
        return
    if not ok:
        raise KVSumError(f"{method}: {knob} must be {want}, got {value!r}")


def _compose(name: str, knobs: dict) -> Composed:
    """The Composed method of a name "first+quantizer", its knobs routed (see the module docstring)."""
    parts = name.split("+")
    if len(parts) != 2 or not all(parts):
        raise KVSumError(f"a composed method is 'method+quantizer' (e.g. 'summary+turboquant'), got {name!r}")
    first, quant = parts
    for p in parts:
        if p not in REGISTRY:
            raise KVSumError(f"unknown method {p!r} in {name!r}; accepted: {', '.join(sorted(REGISTRY))}")
    quantizers = sorted(n for n, cls in REGISTRY.items() if issubclass(cls, Quantizer))
    if quant not in quantizers:
        raise KVSumError(f"{name!r}: the second method must be a quantizer; accepted: {', '.join(quantizers)}")
    if first in quantizers or first == "full":
        raise KVSumError(f"{name!r}: the first method must select or fit entries (eviction or summary), got {first!r}")
    own = {first: set(REGISTRY[first].knobs()), quant: set(REGISTRY[quant].knobs())}
    routed = {first: {}, quant: {}}
    for key, value in knobs.items():
        for m in parts:
            if key[:len(m) + 1] in (m + "_", m + ".") and key[len(m) + 1:] in own[m]:
                routed[m][key[len(m) + 1:]] = value
                break
        else:
            holders = [m for m in parts if key in own[m]]
            if len(holders) == 2:
                raise KVSumError(f"{name!r}: knob {key!r} belongs to both methods; "
                                 f"write {first}_{key} or {quant}_{key}")
            if not holders:
                accepted = sorted(f"{m}_{k}" if k in own[first] & own[quant] else k for m in parts for k in own[m])
                raise KVSumError(f"{name!r} has no knob {key!r}; accepted: {', '.join(dict.fromkeys(accepted))}")
            routed[holders[0]][key] = value
    exact = sorted(set(routed[quant]) & set(REGISTRY[quant].exact_knobs))
    if exact:
        raise KVSumError(f"{name!r}: {quant}'s exact prompt tokens ({', '.join(exact)}) do not apply in a composition: "
                         f"{quant} codes every entry {first} keeps, and {first} decides what stays exact")
    knob = next((k for k in REGISTRY[quant].position_knobs if routed[quant].get(k)), None)
    if knob:  # refused before the quantizer checks its own knobs (Composed refuses it for built parts too)
        raise KVSumError(f"{name!r}: {quant}'s {knob} un-rotates each key by its position, and {first} keeps "
                         f"entries whose positions the codes do not get; drop {knob} in a composition")
    for m in parts:  # e.g. turboquant's key shift off, summary as configured (not by budget)
        routed[m] = {**REGISTRY[m].composed_defaults, **routed[m]}
    return Composed(first=make_method(first, **routed[first]), quant=make_method(quant, **routed[quant]))
