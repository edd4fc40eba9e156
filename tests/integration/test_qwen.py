"""The bundled Qwen2.5-Coder-0.5B (Qwen2: 2 KV heads for 14 query heads, q/k/v biases, RoPE theta 1e6, 32k window)."""

import pytest
import torch

import kvsum
from kvsum.methods import make_method
from tests.helpers import assert_full_is_dynamic_cache

pytestmark = pytest.mark.model


def test_bundled_qwen_full_is_dynamic_cache_and_bad_input_is_refused():
    """The bundled model at 512 tokens: the full cache is transformers' own, snapkv and turboquant decode, and a
    prompt past the 32k window or an empty one is one clear error."""
    model, tok = kvsum.load_model("qwen2.5-coder-0.5b")
    cfg = model.config
    assert (cfg.model_type, cfg.num_key_value_heads, cfg.num_attention_heads, cfg.max_position_embeddings) == (
        "qwen2", 2, 14, 32768)
    text = "def area(r):\n    return 3.14159 * r * r  # the area of a circle of radius r\n\n" * 40
    ctx = tok(text, return_tensors="pt").input_ids[:, :512]
    q = tok("# In short,", return_tensors="pt").input_ids
    assert_full_is_dynamic_cache(model, ctx, q, steps=4)
    pre = kvsum.prefill(model, ctx)
    assert pre.rope is not None
    for name in ("snapkv", "turboquant"):
        cache = kvsum.compress_prefill(pre, make_method(name), 0.25)
        with torch.no_grad():
            assert torch.isfinite(model(q, past_key_values=cache).logits).all(), name
    with pytest.raises(kvsum.KVSumError, match="longer than the model's window"):
        kvsum.prefill(model, torch.zeros(1, 32769, dtype=torch.long))
    with pytest.raises(kvsum.KVSumError, match="empty"):
        kvsum.prefill(model, torch.zeros(1, 0, dtype=torch.long))
