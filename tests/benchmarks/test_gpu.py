"""benchmarks/gpu.py's parts that run without a GPU: its refusal, and the attention of one step alone (the CPU
takes the clock, no CUDA graph)."""

import torch

import kvsum
from benchmarks.gpu import _over_sdpa, refusal, step_attention
from tests.helpers import tiny_llama


def test_it_refuses_without_cuda_in_one_line():
    assert refusal("cpu") is None
    if not torch.cuda.is_available():
        assert "no CUDA device" in refusal("cuda")


def test_the_attention_of_one_step_alone():
    model = tiny_llama(head_dim=64)
    cfg = model.config
    ids = torch.randint(0, 128, (1, 400), generator=torch.Generator().manual_seed(2))
    full = kvsum.compress(model, ids, method="full")
    coded = kvsum.compress(model, ids, method="turboquant", budget=0.3, bits=3.5)
    a, b = step_attention(model, full, "cpu"), step_attention(model, coded, "cpu")
    token = 2 * cfg.num_key_value_heads * 64 * 4  # one fp32 key and value per layer, beside what the cache holds
    assert a["attn_bytes"] == full.nbytes() + cfg.num_hidden_layers * token
    assert b["attn_bytes"] == coded.nbytes() + cfg.num_hidden_layers * token < a["attn_bytes"]
    assert a["attn_s"] > 0 and b["attn_s"] > 0 and a["attn_gpu_s"] is None
    r = _over_sdpa(b, a)
    assert r["attn_over_sdpa"] == b["attn_s"] / a["attn_s"] and r["attn_gpu_over_sdpa"] is None


def test_a_profiled_step_leaves_the_cache_as_it_was_and_counts_what_it_dispatches():
    """benchmarks/gpu_profile.py on the CPU: no CUDA kernels, the host's operations counted (more for a coded
    cache than the full one: its rotation and its tail beside the codes), the cache cropped back each time."""
    from benchmarks.gpu_profile import profiled, table

    model = tiny_llama(head_dim=64)
    ids = torch.randint(0, 128, (1, 300), generator=torch.Generator().manual_seed(3))
    rows = []
    for name, budget, knobs in (("full", 1.0, {}), ("turboquant", 0.3, {"bits": 3.5})):
        cache = kvsum.compress(model, ids, method=name, budget=budget, **knobs)
        length = cache.get_seq_length()
        r = profiled(model, cache, ids[:, :1], rounds=2, device="cpu")
        assert cache.get_seq_length() == length
        assert r["kernels"] == 0 and r["gpu_busy_ms"] == 0 and r["top"] == [] and r["step_ms"] > 0
        rows.append(dict(length=300, method=name, budget=budget, **r))
    assert rows[1]["aten_ops"] > rows[0]["aten_ops"] > 0
    lines = table(rows)
    assert lines[-2].startswith("| 300 | `full` | 1 | ") and "| 1.00 | 0 | 0.00 | nan |" in lines[-2]
