"""kvsum/integrations/codec.py: paged KV -> kvsum bytes -> paged KV with no model, for token-aligned quantizers only."""

import pytest
import torch
from transformers import DynamicCache

import kvsum
from kvsum.integrations import codec
from tests.helpers import greedy, random_ids, tiny_llama

FP = codec.layout("tiny", 2, 2, 16)
QUANTIZERS = [("turboquant", {"bits": 4, "key_shift": 0}, 1.0), ("turboquant", {"key_shift": 0, "sinks": 4}, 0.25),
              ("kivi", {"bits": 2}, 1.0)]


def prompt_kv(model, ids):
    """The full-precision KV of a prompt as an engine pages it: per layer (H, T, d), post-RoPE."""
    with torch.no_grad():
        cache = model(ids, use_cache=True).past_key_values
    return [layer.keys[0] for layer in cache.layers], [layer.values[0] for layer in cache.layers]


def dynamic(model, layers):
    """A transformers DynamicCache holding the given per-layer keys and values (H, T, d)."""
    cache = DynamicCache(config=model.config)
    for i, (k, v) in enumerate(layers):
        cache.update(k[None].to(model.dtype), v[None].to(model.dtype), i)
    return cache


def spec(name, knobs):
    return name + ":" + ",".join(f"{k}={v}" for k, v in knobs.items())


@pytest.mark.parametrize("name,knobs,budget", QUANTIZERS)
def test_bytes_rebuild_the_kv_kvsum_compress_attends_over_and_its_greedy_generation(name, knobs, budget):
    model, ids = tiny_llama(), random_ids(300, 1)
    ref = kvsum.compress(model, ids, method=name, budget=budget, **knobs)
    keys, values = prompt_kv(model, ids)
    data = codec.encode(codec.compress_kv(keys, values, spec(name, knobs), budget, fingerprint=FP))
    back = codec.decode(data, FP)
    rebuilt, expected = codec.dense_kv(back), codec.dense_kv(ref)
    assert len(rebuilt) == 2 and all(k.shape == (2, 300, 16) for k, _ in rebuilt)
    for (k, v), (k_ref, v_ref) in zip(rebuilt, expected):
        assert torch.equal(k, k_ref) and torch.equal(v, v_ref)  # the same codes as kvsum.compress, bit for bit
    assert not torch.equal(rebuilt[0][0], keys[0])  # and they are codes, not the original keys
    q = random_ids(6, 2)
    full = torch.cat([ids, q], -1)
    assert torch.equal(greedy(model, full, dynamic(model, rebuilt), steps=12), greedy(model, full, ref, steps=12))


def test_the_payload_is_about_the_compressed_bytes():
    model, ids = tiny_llama(), random_ids(1024, 3)
    keys, values = prompt_kv(model, ids)
    cache = codec.compress_kv(keys, values, "turboquant:bits=4,key_shift=0", fingerprint=FP)
    data = codec.encode(cache)
    assert cache.nbytes() < 0.35 * cache.reference_nbytes  # 4-bit codes + norms (16 bits per 16-dim head) + rotation
    assert len(data) < cache.nbytes() * 1.1 + 8192  # packed codes stay packed; the rest is the header


@pytest.mark.parametrize("method", ["snapkv", "summary", "turboquant", "turboquant:key_shift=0,key_basis=pca",
                                    "echokv", "streaming_llm"])
def test_methods_that_do_not_keep_one_plain_entry_per_token_are_refused(method):
    keys = [torch.randn(2, 64, 16)] * 2
    with pytest.raises(kvsum.KVSumError):
        codec.compress_kv(keys, keys, method, 0.5, fingerprint=FP)


def test_dense_kv_refuses_ragged_or_biased_caches():
    model, ids = tiny_llama(), random_ids(200, 1)
    for method in ("snapkv", "summary"):
        with pytest.raises(kvsum.KVSumError, match="per token"):
            codec.dense_kv(kvsum.compress(model, ids, method=method, budget=0.25))


def test_altered_truncated_or_foreign_bytes_are_refused():
    keys = [torch.randn(2, 64, 16)] * 2
    data = codec.encode(codec.compress_kv(keys, keys, codec.DEFAULT_METHOD, fingerprint=FP))
    codec.decode(data, FP)
    flipped = bytearray(data)
    flipped[-5] ^= 0x40  # a byte of the last tensor
    with pytest.raises(kvsum.KVSumError, match="altered or corrupted"):
        codec.decode(bytes(flipped), FP)
    with pytest.raises(kvsum.KVSumError):
        codec.decode(data[:len(data) // 2], FP)
    with pytest.raises(kvsum.KVSumError, match="another model"):
        codec.decode(data, codec.layout("other", 2, 2, 16))


def test_frames_carry_their_length():
    assert codec.unframe(codec.frame(b"abc") + b"\0" * 10) == b"abc"
    with pytest.raises(kvsum.KVSumError, match="truncated"):
        codec.unframe(codec.frame(b"abcdef")[:10])
