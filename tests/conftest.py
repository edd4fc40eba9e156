"""Shared fixtures: a tiny random Llama (seconds) and the bundled SmolLM2 (integration, marked `model`)."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

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
