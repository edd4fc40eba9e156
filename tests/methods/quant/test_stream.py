"""kvsum/methods/quant/stream.py: decoded tokens quantized in groups as they arrive, in batches too."""

import pytest
import torch

import kvsum
from kvsum.methods import make_method
from tests.helpers import batch_equals_alone, kl_div, left_pad, tiny_llama


def _stepwise(model, cache, cont):
    """Next-token logits when `cont` is fed one token at a time, as generation does."""
    with torch.no_grad():
        return torch.stack([model(cont[:, t:t + 1], past_key_values=cache).logits[0, -1].float()
                            for t in range(cont.shape[1])])


@pytest.mark.parametrize("method,knobs", [("turboquant", dict(bits=4, sinks=0)),
                                          ("turboquant", dict(bits=3, qjl=True, sinks=0)),
                                          ("turboquant", dict(bits=3, key_basis="pca", sinks=0)),
                                          ("turboquant", dict(bits=3, key_basis="pca", pre_rope=True, sinks=0)),
                                          ("turboquant", dict(bits=3, center=True, sinks=0)),
                                          ("turboquant", dict(bits=3, unbiased="both", sinks=0)),
                                          ("kivi", dict(bits=2)), ("kivi", dict(bits=2, sinks=4))])
def test_decoded_tokens_are_quantized_in_groups(method, knobs):
    model = tiny_llama()
    ids = torch.randint(0, 128, (1, 500), generator=torch.Generator().manual_seed(2))
    ctx, cont = ids[:, :300], ids[:, 300:]
    full = _stepwise(model, kvsum.compress(model, ctx, method="full"), cont)
    plain = kvsum.compress(model, ctx, method=method, budget=1.0, **knobs).attach(lambda i: None)
    ref = _stepwise(model, plain, cont)  # the same quantized prompt, decoded tokens kept in full precision
    cache = kvsum.compress(model, ctx, method=method, budget=1.0, **knobs)
    state0, start = cache.layers[0].state, cache.nbytes()
    coded0 = state0.T - state0.pending()
    ours = _stepwise(model, cache, cont)
    m = make_method(method, **knobs)
    for layer in cache.layers:
        assert layer.state is state0 or type(layer.state) is type(state0)  # one store, extended in place
        assert layer.get_seq_length() == 500 and layer.state.T == layer.offset
        pending = layer.state.pending() + layer.tail_length()
        assert m.residual <= pending <= m.residual + m.group  # the window is kept, whole groups are folded
    assert cache.get_seq_length() == 500
    H, d = 2, 16
    if method == "turboquant":  # the state is exactly a prompt-time state of all its tokens
        shift = cache.layers[0].state.widths[0] - m.widths(knobs["bits"])[0]  # key bits by layer entropy
        want = m.nbytes(H, cache.layers[0].offset, d, knobs["bits"], shift=shift)
        held = cache.layers[0].state.nbytes()
        assert held <= want if m.key_basis == "pca" else held == want  # pca: within the same bytes
    # memory grows by the quantized size: per decoded token well under the 2 x H x d fp16 elements
    tail = sum(layer.keys.numel() + layer.values.numel() for layer in cache.layers) * 4  # fp32 model
    grown = (cache.nbytes() - tail - start) / (2 * 200)  # per token per layer
    assert grown < {4: 0.35, 3: 0.3, 2: 0.35}[knobs["bits"]] * 2 * H * d * 2
    coded = cache.layers[0].state.T - cache.layers[0].state.pending()
    assert coded - coded0 >= 200 - m.residual - m.group  # the decoded tokens were quantized
    # outputs: the extra quantization of 200 decoded tokens costs less than quantizing the 300-token prompt
    assert 0 < kl_div(ref, ours) < kl_div(full, ref)
    out = model.generate(ids[:, :305], cache=kvsum.compress(model, ctx, method=method, budget=1.0, **knobs),
                         max_new_tokens=60, min_new_tokens=60, do_sample=False)
    assert out.shape == (1, 365)


def test_turboquant_with_exact_tokens_streams_decoded_tokens_into_its_codes():
    model = tiny_llama()
    ids = torch.randint(0, 128, (1, 400), generator=torch.Generator().manual_seed(3))
    cache = kvsum.compress(model, ids[:, :300], method="turboquant", budget=1.0, bits=4, sinks=4, window=16)
    coded = cache.layers[0].state.parts[1]
    _stepwise(model, cache, ids[:, 300:])
    assert coded.T == 300 - 20 + 100 - cache.layers[0].tail_length()  # decoded tokens joined the codes
    assert cache.layers[0].tail_length() <= 32


@pytest.mark.parametrize("method,knobs", [("turboquant", {}), ("kivi", dict(bits=4, residual=16)),
                                          ("turboquant", dict(bits=3, key_basis="pca", pre_rope=True))])
def test_batch_quantizes_each_sequences_generated_tokens(method, knobs):
    """Streams follow a batch: every sequence's generated tokens are folded into its own quantized state as
    they arrive (turboquant folds exactly when each sequence alone would, so greedy outputs are equal; with
    pre_rope each sequence's decoded keys take positions from its own prompt length on, as the mask gives them)."""
    model = tiny_llama()
    lengths = [300, 231, 97]
    if method == "turboquant":
        cache, _, _ = batch_equals_alone(model, method, lengths, budget=0.5, steps=70, **knobs)
    else:
        g = torch.Generator().manual_seed(3)
        ids, mask = left_pad([torch.randint(1, 128, (n,), generator=g) for n in lengths])
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
