import subprocess
import sys

import pytest

from kvsum.errors import KVSumError
from kvsum.spec import Spec, format_spec, format_value, parse_spec, parse_specs


@pytest.mark.parametrize("text, spec", [
    ("summary", Spec("summary", {})),
    ("summary+turboquant:bits=3", Spec("summary+turboquant", {"bits": 3})),
    ("x:a=TRUE,b=false,c=None,d=3,e=3.5,f=-2,g=1e-3,h=hadamard", Spec("x", dict(
        a=True, b=False, c=None, d=3, e=3.5, f=-2, g=1e-3, h="hadamard"))),
    ("x:s='a,b',t=\"True\"", Spec("x", {"s": "a,b", "t": "True"})),
    ("summary:cover=turboquant(bits=3.5,center=True),score=surprisal",
     Spec("summary", {"cover": Spec("turboquant", {"bits": 3.5, "center": True}), "score": "surprisal"})),
    ("summary:cover=turboquant()", Spec("summary", {"cover": Spec("turboquant", {})})),
    ("turboquant(bits=3)", Spec("turboquant", {"bits": 3})),
    ("snapkv+kivi:snapkv.window=16", Spec("snapkv+kivi", {"snapkv.window": 16})),
    (" summary : score = surprisal ", Spec("summary", {"score": "surprisal"})),
])
def test_parse_and_round_trip(text, spec):
    got = parse_spec(text)
    assert got == spec
    assert parse_spec(format_spec(got)) == got


def test_values_keep_their_types():
    k = parse_spec("x:a=3,b=3.0,c=true,d=none,e='3'").knobs
    assert type(k["a"]) is int and type(k["b"]) is float and k["c"] is True and k["d"] is None and k["e"] == "3"


@pytest.mark.parametrize("text, needle", [
    ("", "expected a method name"),
    ("a:", "expected a knob name"),
    ("a:b", "expected '=' after knob 'b'"),
    ("a:b=", "expected a value"),
    ("a:b=1,b=2", "given twice"),
    ("a:c=tq:bits=3", "written name(knob=value)"),
    ("a:c=tq(bits=3", "expected ')'"),
    ("a:b='x", "unterminated quote"),
    ("a:b=1)", "unexpected ')'"),
])
def test_mistakes_are_one_clear_error(text, needle):
    with pytest.raises(KVSumError, match="method spec") as e:
        parse_spec(text)
    assert needle in str(e.value)


def test_several_specs_split_where_a_method_starts():
    assert parse_specs("summary:score=surprisal,cover=tq(bits=3,center=True),snapkv:window=16,full") == [
        Spec("summary", {"score": "surprisal", "cover": Spec("tq", {"bits": 3, "center": True})}),
        Spec("snapkv", {"window": 16}), Spec("full", {})]


def test_a_method_config_formats_as_its_changed_knobs():
    from dataclasses import dataclass

    @dataclass(frozen=True)
    class Q:
        name = "q"
        bits: float = 4.0
        center: bool = False

    assert format_value(Q(bits=3.5)) == "q(bits=3.5)"
    assert format_spec(Spec("summary", {"cover": Q(center=True)})) == "summary:cover=q(center=True)"


def test_parsing_needs_no_torch():
    code = "import sys, kvsum.spec, kvsum.cli; kvsum.cli.parser().format_help(); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
