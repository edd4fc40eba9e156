import copy

import pytest
import torch

from kvsum.compress import compress_prefill
from kvsum.demo import one_line, right, run_demo
from kvsum.methods import make_method
from kvsum.prefill import prefill
from tests.helpers import CharTokenizer

from .conftest import tiny_llama


@pytest.mark.parametrize("name, knobs, budget", [
    ("full", {}, 1.0), ("streaming_llm", {}, 0.25), ("snapkv", {"window": 16}, 0.25), ("kivi", {"residual": 16}, 0.5),
    ("turboquant", {}, 0.5), ("summary", {}, 0.5), ("summary+turboquant", {}, 0.5),
])
def test_a_copied_cache_answers_like_a_fresh_compression(name, knobs, budget):
    """generate() grows the cache it is given: the demo answers every question from a deepcopy instead."""
    model = tiny_llama()
    ctx = torch.randint(0, 128, (1, 200), generator=torch.Generator().manual_seed(3))
    m = make_method(name, **knobs)
    pre = prefill(model, ctx, **m.prefill_options())
    kept = compress_prefill(pre, m, budget)
    held = kept.nbytes()
    for q in range(2):
        ids = torch.cat([ctx, torch.tensor([[5 + q, 7, 9]])], -1)
        fresh = model.generate(ids, cache=compress_prefill(pre, m, budget), max_new_tokens=6, do_sample=False,
                               output_logits=True, return_dict_in_generate=True)
        copied = model.generate(ids, cache=copy.deepcopy(kept), max_new_tokens=6, do_sample=False,
                                output_logits=True, return_dict_in_generate=True)
        assert torch.equal(fresh.sequences, copied.sequences)
        assert all(torch.equal(a, b) for a, b in zip(fresh.logits, copied.logits))
    assert kept.nbytes() == held  # the kept cache was never grown


def test_answers_are_one_line_and_marked():
    assert one_line("  29772.\n\nThe next\n") == "29772.\\n\\nThe next"
    assert right("52445. Remember", "52445") and not right("1.\n52445", "52445") and not right("none", "1")


def test_demo_on_a_tiny_model():
    r = run_demo(tiny_llama(), CharTokenizer(), method="streaming_llm:sinks=4", budget=0.5, tokens=600,
                 progress=False)
    assert r["method"] == "streaming_llm:sinks=4" and r["tokens"] == 600 and len(r["answers"]) == 3
    assert r["bytes"] < r["full_bytes"] and r["full16_bytes"] > 0
    for qa in r["answers"]:
        assert isinstance(qa["full_right"], bool) and qa["compressed_right"] == right(qa["compressed"], qa["expected"])
