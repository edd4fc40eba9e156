"""kvsum/__init__.py: the public API, exported and documented."""

import kvsum
from kvsum.methods import make_method


def test_methods_lists_the_foundation_methods():
    names = kvsum.methods()
    assert {"full", "streaming_llm", "random", "summary", "hae"} <= set(names)
    assert all(isinstance(v, str) and v for v in names.values())


def test_the_public_api_is_exported_and_documented():
    assert {"TurboQuant", "KIVI", "Plan", "make_method", "compress", "prefill"} <= set(kvsum.__all__)
    assert all(getattr(kvsum, name).__doc__ for name in kvsum.__all__)
    assert kvsum.TurboQuant.name == "turboquant" and kvsum.KIVI.name == "kivi"
    assert isinstance(make_method("turboquant"), kvsum.TurboQuant)
