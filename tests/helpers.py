"""Plain helpers that tests call with arguments: tiny models, hand-built layers, tokenizers, comparisons.

Fixtures (a model or artifact a test just receives) are in tests/conftest.py; what a test builds to its own
measure (a tiny Llama with 4 layers, a layer of 2,000 random tokens) is here. No test module imports another.
"""

import dataclasses
import shutil
from types import SimpleNamespace

import torch
from hypothesis import HealthCheck, event, settings
from transformers import (
    DynamicCache,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

import kvsum
from kvsum.attention import use_kvsum_attention
from kvsum.methods import LayerInput, Plan, make_method
from kvsum.methods.quant import native

# ---- models -------------------------------------------------------------------------------------------------


def tiny_llama(attn: str = "sdpa", dtype=torch.float32, heads: int = 4, kv_heads: int = 2, layers: int = 2,
               head_dim: int = 16, seed: int = 0):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=128, hidden_size=heads * head_dim, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                      max_position_embeddings=4096, attn_implementation=attn)
    model = LlamaForCausalLM(cfg).to(dtype).eval()
    use_kvsum_attention(model)
    return model


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


def random_ids(n, seed):
    return torch.randint(0, 128, (1, n), generator=torch.Generator().manual_seed(seed))


SERVED = native._cpu_has_avx2() and shutil.which("cc") is not None  # the packed-code kernel serves decoding steps


# ---- tokenizers ---------------------------------------------------------------------------------------------


class CharTokenizer:
    """One token per ASCII character: real task text within the tiny Llama's 128-token vocabulary."""

    pad_token_id = eos_token_id = 0

    def __call__(self, s, add_special_tokens=False, return_tensors=None):
        ids = [ord(c) if ord(c) < 128 else ord("?") for c in s]
        return SimpleNamespace(input_ids=torch.tensor([ids], dtype=torch.long) if return_tensors == "pt" else ids)

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(int(i)) for i in ids)


class SentenceTokenizer:
    """Token id i is the i-th character of `chars` (enough to mark sentence ends)."""

    chars = "abcdefgh .!?\n"

    def batch_decode(self, ids):
        return ["".join(self.chars[i] for i in row) for row in ids]


class ProbeTokenizer(SentenceTokenizer):
    """SentenceTokenizer that also encodes (each character of `chars` its id, any other 0): the retrieval probe runs."""

    def __call__(self, text: str, add_special_tokens: bool = False):
        return SimpleNamespace(input_ids=[max(self.chars.find(c), 0) for c in text])


# ---- hand-built layers --------------------------------------------------------------------------------------


def random_layer(H=2, T=300, d=16, budget=1.0, seed=0, outlier=True):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(H, T, d, generator=g)
    if outlier:
        keys[:, :, 3] = keys[:, :, 3] * 8 + 5  # a fixed outlier channel, as real keys have
    values = torch.randn(H, T, d, generator=g)
    full = 2 * H * T * d * 2
    return LayerInput(keys, values, None, None, d ** -0.5, 0, 1, budget * full, torch.float16)


def reference_layer(seed=0, T=200, d=16, H=1, G=2, n=48, budget=0.25):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(H, T, d, generator=g)
    values = torch.randn(H, T, d, generator=g)
    queries = torch.randn(H * G, n, d, generator=g) + keys[:, -n:].repeat_interleave(G, 0) * 0.5
    pos = torch.arange(T - n, T)
    full = 2 * H * T * d * 2
    return LayerInput(keys, values, queries, pos, d ** -0.5, 0, 1, budget * full, torch.float32,
                      surprisal=torch.rand(T, generator=g))


# ---- running a model ----------------------------------------------------------------------------------------


def greedy_logits(model, full_ids, cache, steps: int = 20):
    out = model.generate(full_ids, cache=cache, max_new_tokens=steps, do_sample=False, min_new_tokens=steps,
                         output_logits=True, return_dict_in_generate=True)
    return out.logits


def assert_full_is_dynamic_cache(model, ctx, question, steps: int = 20):
    """kvsum's `full` cache and transformers' own DynamicCache (with the model's own attention) give the same
    greedy logits, bit for bit; returns both caches."""
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


def teacher_forced(model, cache, cont):
    with torch.no_grad():
        return model(cont, past_key_values=cache).logits[0].float()


def cached_logits(model, cache, q):
    with torch.no_grad():
        return model(q, past_key_values=cache).logits


def kl_div(ref, other):
    return torch.nn.functional.kl_div(other.log_softmax(-1), ref.log_softmax(-1), log_target=True,
                                      reduction="batchmean").item()


def greedy(model, ids, cache, steps=8, mask=None):
    out = model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=steps,
                         min_new_tokens=steps, do_sample=False)
    return out[:, ids.shape[1]:]


def left_pad(seqs, pad=0):
    T = max(s.shape[-1] for s in seqs)
    ids = torch.full((len(seqs), T), pad, dtype=torch.long)
    mask = torch.zeros(len(seqs), T, dtype=torch.long)
    for b, s in enumerate(seqs):
        ids[b, T - s.shape[-1]:], mask[b, T - s.shape[-1]:] = s, 1
    return ids, mask


def batch_equals_alone(model, method, lengths, budget=0.25, steps=8, **knobs):
    g = torch.Generator().manual_seed(3)
    ctxs = [torch.randint(1, 128, (n,), generator=g) for n in lengths]
    question = torch.randint(1, 128, (5,), generator=g)
    ids, mask = left_pad(ctxs)
    cache = kvsum.compress(model, ids, method=method, budget=budget, attention_mask=mask, **knobs)
    assert cache.get_seq_length() == ids.shape[1] and cache.batch_size == len(lengths)
    held = cache.nbytes()
    full = torch.cat([ids, question.expand(len(lengths), -1)], -1)
    full_mask = torch.cat([mask, torch.ones(len(lengths), 5, dtype=torch.long)], -1)
    batch = greedy(model, full, cache, steps, full_mask)
    alone_bytes = reference = 0
    for b, ctx in enumerate(ctxs):
        solo = kvsum.compress(model, ctx[None], method=method, budget=budget, **knobs)
        alone_bytes += solo.nbytes()
        reference += solo.reference_nbytes
        want = greedy(model, torch.cat([ctx, question])[None], solo, steps)
        assert torch.equal(batch[b], want[0]), (method, b)
    assert cache.reference_nbytes == reference
    return cache, held, alone_bytes


# ---- reconstruction methods ---------------------------------------------------------------------------------


def with_layer_budget(m, fraction):
    """`m` with a plan that gives every layer `fraction` of its 16-bit bytes (configs are frozen: a subclass)."""
    cls = type(m)
    sub = dataclasses.dataclass(frozen=True)(
        type(cls.__name__, (cls,), {"plan": lambda self, inputs, b: Plan((fraction,) * len(inputs))}))
    return sub(**{f.name: getattr(m, f.name) for f in dataclasses.fields(m)})


def compress_with_plan(model, ctx, method, budget, storage=torch.float16, layer_budget=None, **knobs):
    m = make_method(method, **knobs)
    if layer_budget is not None:  # e.g. fp32 storage at full rank holds twice the 16-bit bytes
        m = with_layer_budget(m, layer_budget)
    return kvsum.compress_prefill(kvsum.prefill(model, ctx), m, budget, storage)


def rebuild_errors(model, ctx, method, **knobs):
    """Relative Frobenius error of the rebuilt keys and values, over all layers."""
    pre = kvsum.prefill(model, ctx)
    cache = kvsum.compress_prefill(pre, make_method(method, **knobs), 1.0)
    err = {}
    for w, attr in (("k", "keys"), ("v", "values")):
        ref = torch.stack([getattr(layer, attr)[0] for layer in pre.cache.layers]).float()
        got = torch.stack([layer.state.rebuilt(w) for layer in cache.layers])
        err[w] = ((got - ref).norm() / ref.norm()).item()
    return err


# ---- property-based tests (hypothesis) ----------------------------------------------------------------------

ARTIFACT_METHODS = {"echokv", "lowrank"}  # need a calibration artifact of the model: tested on a fixed tiny model
PROPERTY_METHODS = sorted(set(kvsum.methods()) - ARTIFACT_METHODS - {"full"})
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SLACK = 0.02  # the documented tolerance: bytes <= (budget + 0.02) x full

PROPERTY_SETTINGS = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def refused(e: kvsum.KVSumError) -> None:
    assert str(e) and "\n" not in str(e)
    event(f"refused: {str(e).split(':')[0][:30]}")


# ---- the report ---------------------------------------------------------------------------------------------


def report_settings(**kw):
    from kvsum.report import Settings

    base = dict(model="tiny", methods=["full", "streaming_llm", "snapkv"], budgets=[0.5, 0.25],
                tasks=["lm", "passkey"], length=400, n=1, short_lengths=[96], new_tokens=3, scaling_lengths=[128, 256],
                threads=1, timings="measure")
    return Settings(**{**base, **kw})

