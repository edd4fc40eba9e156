"""kvsum/methods/registry.py: the factory, method-valued knobs, composition names and knob routing."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import pytest

import kvsum
from kvsum.methods import REGISTRY, Method, make_method
from kvsum.spec import Spec


@dataclass(frozen=True)
class _Wrap(Method):
    """A method with a method-valued knob (only for these tests)."""

    name: ClassVar[str] = "wrap_test"
    inner: Method | None = None
    extra: object = None
    sinks: int = 4


@pytest.fixture
def wrap(monkeypatch):
    monkeypatch.setitem(REGISTRY, "wrap_test", _Wrap)


def test_a_method_knob_takes_a_method_a_spec_or_a_spec_string(wrap):
    want = make_method("streaming_llm", sinks=2)
    assert make_method("wrap_test", inner=want).inner == want
    assert make_method("wrap_test", inner=Spec("streaming_llm", {"sinks": 2})).inner == want
    assert make_method("wrap_test", inner="streaming_llm(sinks=2)").inner == want
    assert make_method("wrap_test", inner="streaming_llm:sinks=2").inner == want
    assert make_method("wrap_test", extra=want).extra == want  # a None default takes a method as it is
    assert make_method("wrap_test", extra=Spec("streaming_llm", {"sinks": 2})).extra == want  # a Spec is built
    nested = make_method("wrap_test", inner=Spec("wrap_test", {"inner": Spec("streaming_llm", {"sinks": 2})}))
    assert nested.inner.inner == want


@pytest.mark.parametrize("knobs, match", [
    (dict(inner=3), "inner must be a Method"),
    (dict(inner=Spec("nope", {})), "inner=nope: unknown method 'nope'"),
    (dict(inner=Spec("streaming_llm", {"window": 3})), "has no knob window"),
    (dict(sinks=Spec("streaming_llm", {})), "sinks must be an integer"),
    (dict(inner="streaming_llm(sinks=)"), "method spec"),
])
def test_bad_method_knobs_are_clear_errors(wrap, knobs, match):
    with pytest.raises(kvsum.KVSumError, match=match):
        make_method("wrap_test", **knobs)


def test_a_spec_string_names_a_method_with_its_knobs():
    assert make_method("turboquant:bits=2.5,skew=0") == make_method("turboquant", bits=2.5, skew=0)
    assert make_method("turboquant:bits=2.5", skew=0) == make_method("turboquant", bits=2.5, skew=0)
    assert make_method("turboquant(bits=2.5)") == make_method(Spec("turboquant", {"bits": 2.5})) == make_method(
        "turboquant", bits=2.5)
    assert (make_method("snapkv+turboquant:key_shift=1,snapkv_window=16")
            == make_method("snapkv+turboquant", key_shift=1, snapkv_window=16))
    assert make_method("summary:cover=turboquant(bits=3.5)").cover == make_method("turboquant", bits=3.5)
    assert make_method("summary:score=surprisal") != make_method("summary")  # a knob: not configured by the rule


@pytest.mark.parametrize("name, knobs, match", [
    ("turboquant:bits=2.5", {"bits": 3}, "knob bits given twice"),
    ("turboquant:nope=1", {}, "has no knob nope"),
    ("turboquant:bits=", {}, "method spec"),
])
def test_bad_spec_strings_are_clear_errors(name, knobs, match):
    with pytest.raises(kvsum.KVSumError, match=match):
        make_method(name, **knobs)


def test_a_composition_routes_knobs_by_prefix():
    m = make_method("snapkv+kivi", snapkv_window=16, **{"kivi.group": 16})
    assert (m.first.window, m.quant.group) == (16, 16)


@pytest.mark.parametrize("name, knobs, match", [
    ("snapkv+", {}, r"a composed method is 'method\+quantizer'"),
    ("snapkv+nope", {}, "unknown method 'nope'"),
    ("snapkv+snapkv", {}, "must be a quantizer"),
    ("kivi+turboquant", {}, "must select or fit entries"),
    ("snapkv+kivi", {"seed": 1}, "has no knob 'seed'"),
    ("snapkv+kivi", {"kivi_sinks": 2}, "exact prompt tokens"),
])
def test_bad_compositions_are_clear_errors(name, knobs, match):
    with pytest.raises(kvsum.KVSumError, match=match):
        make_method(name, **knobs)
