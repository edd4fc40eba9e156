"""Shared fixtures: a tiny random Llama and Qwen2 (seconds), a calibration artifact of the tiny Llama, and the
bundled SmolLM2 (integration, marked `model`). Helpers that tests call with arguments are in tests/helpers.py."""

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from kvsum.attention import use_kvsum_attention

# assert_full_is_dynamic_cache, greedy_logits, tiny_llama: re-exported for tests that still import them
# from here; new tests import them from tests.helpers
from tests.helpers import assert_full_is_dynamic_cache, greedy_logits, random_ids, tiny_llama  # noqa: F401


def tiny_qwen2(attn: str = "sdpa", heads: int = 14, kv_heads: int = 2, layers: int = 2, head_dim: int = 16,
               seed: int = 0):
    """A random Qwen2 shaped like Qwen2.5-Coder-0.5B where it matters to kvsum: 7 query heads per KV head,
    q/k/v projection biases (random, the key bias large as in the trained model), RoPE theta 1e6."""
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=128, hidden_size=heads * head_dim, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                      max_position_embeddings=4096, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                      attn_implementation=attn)
    model = Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            a = layer.self_attn
            for proj, scale in ((a.q_proj, 0.5), (a.k_proj, 4.0), (a.v_proj, 0.5)):
                proj.bias.copy_(torch.randn(proj.bias.shape) * scale)
    use_kvsum_attention(model)
    return model


@pytest.fixture
def tiny():
    return tiny_llama()


@pytest.fixture
def ids():
    return torch.randint(0, 128, (1, 300), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="session")
def tiny_art():
    """The calibration artifact (echokv, lowrank) of `tiny_llama()`, the model the `tiny` fixture returns."""
    from kvsum.calibrate import calibrate

    return calibrate(tiny_llama(), ids=random_ids(1600, 7), tokens=1600, seq_len=400, progress=False)


@pytest.fixture(scope="session")
def smollm2():
    import kvsum

    return kvsum.load_model("smollm2")
