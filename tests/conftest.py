"""Shared fixtures: a tiny random Llama (seconds) and the bundled SmolLM2 (integration, marked `model`)."""

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from kvsum.attention import use_kvsum_attention


def tiny_llama(attn: str = "sdpa", dtype=torch.float32, heads: int = 4, kv_heads: int = 2, layers: int = 2,
               head_dim: int = 16, seed: int = 0):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=128, hidden_size=heads * head_dim, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                      max_position_embeddings=4096, attn_implementation=attn)
    model = LlamaForCausalLM(cfg).to(dtype).eval()
    use_kvsum_attention(model)
    return model


@pytest.fixture
def tiny():
    return tiny_llama()


@pytest.fixture
def ids():
    return torch.randint(0, 128, (1, 300), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="session")
def smollm2():
    import kvsum

    return kvsum.load_model("smollm2")


def greedy_logits(model, full_ids, cache, steps: int = 20):
    out = model.generate(full_ids, cache=cache, max_new_tokens=steps, do_sample=False, min_new_tokens=steps,
                         output_logits=True, return_dict_in_generate=True)
    return out.logits


def assert_full_is_dynamic_cache(model, ctx, question, steps: int = 20):
    """kvsum's `full` cache and transformers' own DynamicCache (with the model's own attention) give the same
    greedy logits, bit for bit; returns both caches."""
    import kvsum

    full_ids = torch.cat([ctx, question], -1)
    cache = kvsum.compress(model, ctx, method="full")
    ours = greedy_logits(model, full_ids, cache, steps)
    base = model.config._attn_implementation.removeprefix("kvsum_")
    model.set_attn_implementation(base)
    try:
        ref_cache = DynamicCache(config=model.config)
        with torch.no_grad():
            model(ctx, cache=ref_cache)
        ref = greedy_logits(model, full_ids, ref_cache, steps)
    finally:
        model.set_attn_implementation("kvsum_" + base)
    assert len(ours) == len(ref) == steps
    for a, b in zip(ours, ref):
        assert torch.equal(a, b)
    return cache, ref_cache
