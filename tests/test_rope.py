"""kvsum/rope.py: RoPE tables, rotate / unrotate, read off a model (per layer type too)."""

import torch

import kvsum
from kvsum.rope import BLOCK, layer_rope, rope_of, rope_tables, shared_tables
from kvsum.rope import rotate as rope_rotate
from kvsum.rope import unrotate as rope_unrotate
from tests.helpers import random_ids


def test_rope_inverse_and_model_match(tiny):
    rope = rope_of(tiny, 16, 2)
    assert rope is not None and rope["inv_freq"].shape == (2, 8)
    cos, sin = rope_tables(rope["inv_freq"][1], float(rope["scaling"][1]), 50)
    x = torch.randn(2, 50, 16)
    assert torch.allclose(rope_unrotate(rope_rotate(x, cos, sin), cos, sin), x, atol=1e-5)
    assert not torch.allclose(rope_rotate(x, cos, sin)[:, 1:], x[:, 1:], atol=1e-2)
    # the shared tables: the same rows, one table per RoPE grown a block at a time (a step past a block grows it)
    inv, sc = rope["inv_freq"][1], float(rope["scaling"][1])
    for T in (50, BLOCK + 3):
        assert all(torch.equal(a, b) for a, b in zip(shared_tables(inv, sc, T), rope_tables(inv, sc, T)))
    assert shared_tables(inv, sc, 7)[0].data_ptr() == shared_tables(inv, sc, 9)[0].data_ptr()


def test_rope_per_layer_type_gemma3():
    """Gemma 3's sliding and global layers rotate with different bases: each layer is un-rotated with its own."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    from kvsum.attention import use_kvsum_attention

    torch.manual_seed(0)
    cfg = Gemma3TextConfig(vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
                           layer_types=["sliding_attention", "full_attention"], attn_implementation="sdpa")
    gemma = Gemma3ForCausalLM(cfg).eval()
    use_kvsum_attention(gemma)
    rope = rope_of(gemma, 16, 2)
    assert not torch.equal(rope["inv_freq"][0], rope["inv_freq"][1])
    captured = []  # keys before RoPE: Gemma 3 rotates the output of k_norm
    hooks = [layer.self_attn.k_norm.register_forward_hook(lambda m, i, out: captured.append(out[0].float()))
             for layer in gemma.model.layers]
    pre = kvsum.prefill(gemma, random_ids(200, 1))
    for h in hooks:
        h.remove()
    for i, (layer, want) in enumerate(zip(pre.cache.layers, captured)):
        r = layer_rope(rope, i)
        got = rope_unrotate(layer.keys[0].float(), *rope_tables(r["inv_freq"], r["scaling"], 200))
        assert torch.allclose(got, want, atol=1e-4), i
