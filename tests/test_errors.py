"""kvsum/errors.py: every bad input gives one clear KVSumError."""

import pytest

import kvsum


def _bad_input_module():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parent.parent / "benchmarks" / "bad_input.py"
    spec = importlib.util.spec_from_file_location("kvsum_bad_input", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_every_bad_input_gives_one_clear_error():
    """The cases of benchmarks/bad_input.py (its table is benchmarks/results/robust/bad_input.md)."""
    cases = _bad_input_module().cases()
    assert len(cases) >= 45
    for what, call in cases:
        with pytest.raises(kvsum.KVSumError) as info:
            call()
        assert "\n" not in str(info.value) and len(str(info.value)) > 20, what
