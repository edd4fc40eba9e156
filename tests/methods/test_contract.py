"""The interface contract: every method takes every prompt of length >= 1 at every budget in (0, 1].

It compresses within the budget (+0.02 of the full cache) and decodes, saying in `cache.stats()` what it degraded
to fit, or raises one KVSumError that names the smallest budget that fits, and that budget then works."""

import re

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import kvsum
from kvsum.methods import REGISTRY
from tests.helpers import tiny_llama

CALIBRATED = ("echokv", "lowrank")  # need a per-model artifact: their own tests cover short prompts
METHODS = [(n, {}) for n in sorted(REGISTRY) if n not in CALIBRATED] + [
    ("summary", {"cover": "turboquant(bits=3.5,center=True)"}), ("summary+turboquant", {}), ("summary+kivi", {}),
    ("snapkv+turboquant", {}), ("snapkv+kivi", {}), ("h2o+turboquant", {})]
SMALLEST = re.compile(r"the smallest budget that fits: ([0-9.]+)")


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=100, hidden_size=128, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1024)
    return LlamaForCausalLM(cfg).eval()  # head dim 64, as the bundled models


def _within(model, ids, name, knobs, budget):
    cache = kvsum.compress(model, ids, method=name, budget=budget, **knobs)
    ratio = cache.budget_nbytes() / cache.budget_reference_nbytes
    assert name == "full" or ratio <= budget + 0.02, (name, ids.shape[1], budget, ratio)
    assert all(isinstance(r["note"], str) for r in cache.stats())
    with torch.no_grad():
        logits = model(torch.tensor([[1, 2, 3]]), cache=cache, use_cache=True).logits
    assert torch.isfinite(logits).all()
    return cache


@pytest.mark.parametrize("name,knobs", METHODS, ids=[n + (":" + ",".join(k) if k else "") for n, k in METHODS])
def test_every_prompt_at_every_budget_compresses_or_names_the_smallest_budget(model, name, knobs):
    for T in (1, 2, 5, 40, 160):
        ids = torch.randint(0, 100, (1, T), generator=torch.Generator().manual_seed(T))
        for budget in (0.01, 0.05, 0.25, 1.0):
            try:
                _within(model, ids, name, knobs, budget)
            except kvsum.KVSumError as e:
                found = SMALLEST.search(str(e))
                assert found, f"{name} T={T} budget={budget}: {e}"
                least = float(found.group(1))
                assert budget < least <= 1.0, (name, T, budget, str(e))
                _within(model, ids, name, knobs, least)


def test_the_flagship_fits_a_short_prompt_by_the_hadamard_rotation_and_says_so():
    """A 256-token prompt, head dim 64 over three KV heads (SmolLM2's shape): the dense fp16 rotation does not
    fit, so the 3.5-bit centered cover falls back to the seeded-sign Hadamard rotation (d bytes) and says so."""
    model = tiny_llama(heads=6, kv_heads=3, head_dim=64)
    ids = torch.randint(0, 128, (1, 256), generator=torch.Generator().manual_seed(0))
    cache = _within(model, ids, "summary", {"cover": "turboquant(bits=3.5,center=True)", "score": "surprisal"}, 0.25)
    assert all("rotation='hadamard'" in layer.state.note for layer in cache.layers)
    assert all(layer.state.parts[1].inner.R.kind == "hadamard" for layer in cache.layers)
    assert all("rotation='hadamard'" in row["note"] for row in cache.stats())
