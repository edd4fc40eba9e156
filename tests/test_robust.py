"""Robustness: batches with left padding, sliding-window layers (a tiny random Gemma 3), long inputs."""

import pytest
import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig

import kvsum
from kvsum.attention import use_kvsum_attention
from kvsum.cache import BatchState, KVSumSlidingLayer

from .conftest import assert_full_is_dynamic_cache, tiny_llama


def tiny_gemma(attn: str = "sdpa", window: int = 32, dtype=torch.float32, seed: int = 0):
    """Gemma 3 layout in miniature: sliding layers with global ones every third layer, one KV head."""
    torch.manual_seed(seed)
    cfg = Gemma3TextConfig(vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=6,
                           num_attention_heads=4, num_key_value_heads=1, head_dim=32, sliding_window=window,
                           layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
                           max_position_embeddings=4096, attn_implementation=attn)
    model = Gemma3ForCausalLM(cfg).to(dtype).eval()
    use_kvsum_attention(model)
    return model


def _greedy(model, ids, cache, steps=8, mask=None):
    out = model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=steps,
                         min_new_tokens=steps, do_sample=False)
    return out[:, ids.shape[1]:]


def _left_pad(seqs, pad=0):
    T = max(s.shape[-1] for s in seqs)
    ids = torch.full((len(seqs), T), pad, dtype=torch.long)
    mask = torch.zeros(len(seqs), T, dtype=torch.long)
    for b, s in enumerate(seqs):
        ids[b, T - s.shape[-1]:], mask[b, T - s.shape[-1]:] = s, 1
    return ids, mask


def _batch_equals_alone(model, method, lengths, budget=0.25, steps=8, **knobs):
    g = torch.Generator().manual_seed(3)
    ctxs = [torch.randint(1, 128, (n,), generator=g) for n in lengths]
    question = torch.randint(1, 128, (5,), generator=g)
    ids, mask = _left_pad(ctxs)
    cache = kvsum.compress(model, ids, method=method, budget=budget, attention_mask=mask, **knobs)
    assert cache.get_seq_length() == ids.shape[1] and cache.batch_size == len(lengths)
    held = cache.nbytes()
    full = torch.cat([ids, question.expand(len(lengths), -1)], -1)
    full_mask = torch.cat([mask, torch.ones(len(lengths), 5, dtype=torch.long)], -1)
    batch = _greedy(model, full, cache, steps, full_mask)
    alone_bytes = reference = 0
    for b, ctx in enumerate(ctxs):
        solo = kvsum.compress(model, ctx[None], method=method, budget=budget, **knobs)
        alone_bytes += solo.nbytes()
        reference += solo.reference_nbytes
        want = _greedy(model, torch.cat([ctx, question])[None], solo, steps)
        assert torch.equal(batch[b], want[0]), (method, b)
    assert cache.reference_nbytes == reference
    return cache, held, alone_bytes


@pytest.mark.parametrize("method", ["streaming_llm", "snapkv", "summary", "random", "turboquant"])
def test_left_padded_batch_equals_each_sequence_alone(method):
    model = tiny_llama()
    cache, held, alone = _batch_equals_alone(model, method, [300, 231, 97])
    state = cache.layers[0].state
    assert isinstance(state, BatchState) and len(state) == 3
    assert held == alone  # ragged lengths held for real: no padding in the compressed batch
    lens = [s.lengths()[0] for s in state.states]
    assert lens[0] > lens[1] > lens[2]  # each sequence got its own budget


def test_left_padded_batch_full_method_and_eager():
    _batch_equals_alone(tiny_llama("eager"), "full", [120, 64])
    _batch_equals_alone(tiny_llama("sdpa"), "snapkv", [120, 70, 120])


def test_batch_without_padding_and_single_padded_row():
    model = tiny_llama()
    _batch_equals_alone(model, "streaming_llm", [80, 80])
    _batch_equals_alone(model, "streaming_llm", [80])  # B = 1, no padding: the plain path


def test_beam_search_reorders_states(tiny, ids):
    """Beam search reorders the batch (transformers leaves a passed cache's expansion to the caller:
    batch_repeat_interleave); states follow. With the whole prompt kept in the state the beams equal
    those over transformers' own cache."""
    full_ids = torch.cat([ids, ids[:, :4]], -1)
    kw = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, num_beams=3, num_return_sequences=2)
    cache = kvsum.compress(tiny, ids, method="streaming_llm", budget=1.0)
    assert cache.layers[0].state.lengths() == [300, 300]
    cache.batch_repeat_interleave(3)
    one = cache.layers[0].state.states[0]
    assert cache.batch_size == 3 and cache.nbytes() == sum(layer.state.states[0].nbytes() for layer in cache.layers)
    out = tiny.generate(full_ids, past_key_values=cache, **kw)
    assert isinstance(cache.layers[0].state, BatchState) and cache.layers[0].state.states == [one] * 3
    ref_cache = kvsum.compress(tiny, ids, method="full")
    ref_cache.batch_repeat_interleave(3)
    ref = tiny.generate(full_ids, past_key_values=ref_cache, **kw)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("mask, match", [
    (torch.ones(2, 9), "integer or bool"),
    (torch.ones(2, 8, dtype=torch.long), "shape of input_ids"),
    (torch.tensor([[1] * 9, [1, 1, 1, 0, 0, 0, 0, 0, 0]]), "left padded"),
    (torch.tensor([[1] * 9, [0] * 9]), "padding only"),
    (torch.full((2, 9), 2), "only 0"),
])
def test_bad_attention_mask(tiny, mask, match):
    with pytest.raises(kvsum.KVSumError, match=match):
        kvsum.compress(tiny, torch.ones(2, 9, dtype=torch.long), attention_mask=mask)


# --- sliding-window layers -----------------------------------------------------------------------------

@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_gemma_full_is_bit_identical_to_dynamic_cache(attn):
    model = tiny_gemma(attn)
    ctx = torch.randint(0, 128, (1, 100), generator=torch.Generator().manual_seed(1))
    cache, _ = assert_full_is_dynamic_cache(model, ctx, ctx[:, :7], steps=40)
    assert [isinstance(layer, KVSumSlidingLayer) for layer in cache.layers] == [True, True, False] * 2
    # the window layers hold what transformers holds: window - 1 tokens
    assert [layer.keys.shape[2] for layer in cache.layers] == [31, 31, 146] * 2


@pytest.mark.parametrize("method", ["streaming_llm", "snapkv", "summary", "turboquant"])
def test_gemma_compresses_global_layers_only(method):
    model = tiny_gemma()
    ctx = torch.randint(0, 128, (1, 200), generator=torch.Generator().manual_seed(1))
    pre = kvsum.prefill(model, ctx)
    window_keys = [layer.keys.clone() for layer in pre.cache.layers if isinstance(layer, KVSumSlidingLayer)]
    cache = kvsum.compress(model, ctx, method=method, budget=0.25)
    sliding = [layer for layer in cache.layers if isinstance(layer, KVSumSlidingLayer)]
    assert len(sliding) == 4 and all(layer.state is None for layer in sliding)
    assert all(torch.equal(a, layer.keys) for a, layer in zip(window_keys, sliding))
    assert all(cache.layers[i].state is not None for i in (2, 5))
    # the budget governs the global layers; the windows are counted too
    assert cache.budget_nbytes() <= 0.27 * cache.budget_reference_nbytes
    assert cache.window_nbytes() == 4 * 2 * 31 * 32 * 4  # fp32 model: 31 tokens, K and V, 1 head, d = 32
    assert cache.nbytes() == cache.budget_nbytes() + cache.window_nbytes()
    assert cache.reference_nbytes == cache.budget_reference_nbytes + 4 * 2 * 31 * 32 * 2
    out = _greedy(model, torch.cat([ctx, ctx[:, :5]], -1), cache, steps=40)
    assert out.shape == (1, 40) and cache.get_seq_length() == 200 + 5 + 39


@pytest.mark.parametrize("method", ["full", "streaming_llm", "summary"])
def test_gemma_left_padded_batch_equals_alone(method):
    _batch_equals_alone(tiny_gemma(), method, [90, 40, 33], steps=30)


def test_gemma_repeat_scoring_crops_the_windows():
    model = tiny_gemma()
    ctx = torch.randint(0, 128, (1, 100), generator=torch.Generator().manual_seed(1))
    pre = kvsum.prefill(model, ctx, repeat=True)
    assert set(pre.repeat_scores) == {2, 5}
    ref = kvsum.prefill(model, ctx)
    for a, b in zip(pre.cache.layers, ref.cache.layers):
        assert a.get_seq_length() == 100
        torch.testing.assert_close(a.keys, b.keys)


# --- bad input -----------------------------------------------------------------------------------------

def _bad_input_module():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parent.parent / "benchmarks" / "bad_input.py"
    spec = importlib.util.spec_from_file_location("kvsum_bad_input", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_every_bad_input_gives_one_clear_error():
    """The cases of benchmarks/bad_input.py (its table is benchmarks/results/bad_input.md)."""
    cases = _bad_input_module().cases()
    assert len(cases) >= 45
    for what, call in cases:
        with pytest.raises(kvsum.KVSumError) as info:
            call()
        assert "\n" not in str(info.value) and len(str(info.value)) > 20, what


class _FailOn:
    """A method that fails on one layer, after the others succeeded."""

    def __init__(self, layer):
        self.layer = layer

    def __call__(self):
        fail = self.layer

        class Boom(kvsum.Method):
            name = "boom"

            def compress(self, x):
                if x.layer_idx == fail:
                    raise RuntimeError("boom")
                return x.keep([torch.arange(3)] * x.H)

        return Boom()


def test_failed_compression_leaves_gemma_prefill_intact():
    model = tiny_gemma()
    ctx = torch.randint(0, 128, (1, 100), generator=torch.Generator().manual_seed(1))
    pre = kvsum.prefill(model, ctx)
    before = [(type(layer), layer.keys.clone(), layer.get_seq_length()) for layer in pre.cache.layers]
    with pytest.raises(RuntimeError):
        kvsum.compress_prefill(pre, _FailOn(5)(), 0.25, consume=True)
    for (kind, keys, seen), layer in zip(before, pre.cache.layers):
        assert type(layer) is kind and torch.equal(keys, layer.keys) and layer.get_seq_length() == seen
    cache = kvsum.compress_prefill(pre, "streaming_llm", 0.25)  # still usable
    assert cache.get_seq_length() == 100


def test_failed_decoding_step_leaves_the_cache_as_it_was(tiny, ids):
    """A bad input to a compressed cache is refused before any layer changes."""
    cache = kvsum.compress(tiny, ids, method="streaming_llm")
    held, seen = cache.nbytes(), cache.get_seq_length()
    with pytest.raises(kvsum.KVSumError, match="the cache holds 1 sequence"):
        with torch.no_grad():
            tiny(ids[:, :2].expand(2, -1), past_key_values=cache)
    assert cache.nbytes() == held and cache.get_seq_length() == seen


@pytest.mark.parametrize("method,knobs", [("turboquant", {}), ("kivi", dict(bits=4, residual=16)),
                                          ("turboquant", dict(bits=3, key_basis="pca", pre_rope=True))])
def test_batch_quantizes_each_sequences_generated_tokens(method, knobs):
    """Streams follow a batch: every sequence's generated tokens are folded into its own quantized state as
    they arrive (turboquant folds exactly when each sequence alone would, so greedy outputs are equal; with
    pre_rope each sequence's decoded keys take positions from its own prompt length on, as the mask gives them)."""
    model = tiny_llama()
    lengths = [300, 231, 97]
    if method == "turboquant":
        cache, _, _ = _batch_equals_alone(model, method, lengths, budget=0.5, steps=70, **knobs)
    else:
        g = torch.Generator().manual_seed(3)
        ids, mask = _left_pad([torch.randint(1, 128, (n,), generator=g) for n in lengths])
        cache = kvsum.compress(model, ids, method=method, budget=0.6, attention_mask=mask, **knobs)
        out = model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=70,
                             min_new_tokens=70, do_sample=False)
        assert out.shape == (3, ids.shape[1] + 70)
    for layer in cache.layers:
        assert layer.tail_length() <= 16 + 2 * 32  # folded in groups, whatever each sequence's window
        coded = [s.parts[1] if method == "turboquant" else s for s in layer.state.states]  # (past 4 exact sinks)
        folded = layer.offset - max(lengths)
        assert folded >= 32 and all(c.T == n - 4 * (method == "turboquant") + folded for c, n in zip(coded, lengths))


def test_sampled_copies_of_a_quantized_cache_stop_streaming(tiny, ids):
    """num_return_sequences repeats one sequence's state: its stream cannot serve the copies, so it stops and
    their generated tokens stay in the tail (before, a shared stream would fold one copy's tokens for all)."""
    cache = kvsum.compress(tiny, ids, method="turboquant", budget=0.5)
    cache.batch_repeat_interleave(2)  # transformers leaves a passed cache's expansion to the caller
    out = tiny.generate(torch.cat([ids, ids[:, :4]], -1), past_key_values=cache, max_new_tokens=40,
                        min_new_tokens=40, do_sample=True, num_return_sequences=2, top_k=5)
    assert out.shape == (2, ids.shape[1] + 44)
    assert all(layer.stream is None and layer.tail_length() == 43 for layer in cache.layers)
