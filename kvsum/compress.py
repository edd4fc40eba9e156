"""kvsum.compress: prefill -> plan -> per-layer states -> Cache, every global layer under one byte budget.

Sliding-window layers (Gemma 3's local layers) stay as transformers holds them: they are bounded by
their window already. A batch is compressed one sequence at a time (its padding stripped) and stacked.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .budget import check_budget, check_storage, full_nbytes
from .cache import Cache, KVSumSlidingLayer
from .errors import KVSumError
from .methods import LayerInput, Method, make_method, prefill_needs
from .methods.quant.stream import BatchQuantStream, QuantStream
from .prefill import Prefill, check_attention_mask, check_ids, check_prefill, prefill
from .rope import layer_rope
from .spec import Spec, format_spec


@dataclass
class Decision:
    """What was picked for one request, and why (one line, with the thresholds used)."""

    method: str
    budget: float
    knobs: dict
    reason: str

    @property
    def spec(self) -> str:
        """The configuration picked, as a spec string ("summary+turboquant:center=True")."""
        return format_spec(Spec(self.method, self.knobs))


def _copy_layer(src, dst) -> None:
    """dst holds a copy of src's uncompressed keys and values (and its sliding-window position)."""
    if isinstance(src, KVSumSlidingLayer):
        dst.lazy_initialization(src.keys, src.values)
        dst.cumulative_length = src.cumulative_length
    else:
        dst.set_state(None, 0, src.keys[:, :, :0])
    dst.keys, dst.values = src.keys.clone(), src.values.clone()


@torch.no_grad()
def compress_prefill(pre: Prefill, method: Method, budget: float, storage_dtype=torch.float16,
                     consume: bool = False) -> Cache:
    """A compressed Cache from a prefill. With `consume`, the prefill's full layers are freed as they go.

    Only global layers are compressed; sliding-window layers are kept (moved with `consume`, else copied)
    as transformers holds them, and the budget is a fraction of the global layers' full 16-bit bytes.
    A method that stands for several configurations (`summary` with no knobs: Method.choices) compresses with
    the first that fits the prompt, and `cache.decision` says which and why.
    """
    if isinstance(method, str):
        method = make_method(method)
    if not isinstance(method, Method):
        raise KVSumError(f"method must be a method name or a kvsum.Method (make_method(name, **knobs)), "
                         f"got {type(method).__name__}")
    budget, storage_dtype = check_budget(budget), check_storage(storage_dtype)
    pre = check_prefill(pre)
    choices = method.choices(budget, pre.tokens, pre.sentence_ends is not None, pre.shape)
    skipped = []
    for k, c in enumerate(choices):
        try:  # a configuration that does not fit fails before it frees anything (_compress builds all states first)
            out = _compress(pre, c.method, budget, storage_dtype, consume)
        except KVSumError as e:
            if k + 1 == len(choices):
                raise
            skipped.append(f"{format_spec(Spec(c.name, c.knobs))} does not fit this prompt: {e}")
            continue
        if c.method is not method:
            out.decision = Decision(c.name, budget, dict(c.knobs), "; ".join([*skipped, c.why]))
        return out


def _compress(pre: Prefill, method: Method, budget: float, storage_dtype, consume: bool) -> Cache:
    s = pre.shape
    if method.name == "full":
        out = pre.cache
        if not consume:
            out = Cache(s.n_layers, s.windows)
            for src, dst in zip(pre.cache.layers, out.layers):
                _copy_layer(src, dst)
            out.copy_references(pre.cache)
        out.config = method
        return out
    glob = s.global_layers
    if not glob:
        raise KVSumError(f"method {method.name!r}: this model has only sliding-window layers, nothing to compress; "
                         "use method='full'")
    layer_full = full_nbytes(1, s.n_kv_heads, s.head_dim, pre.tokens)
    inputs = []
    for i in glob:
        layer = pre.cache.layers[i]
        inputs.append(LayerInput(
            keys=layer.keys[0].float(), values=layer.values[0].float(),
            queries=pre.queries.get(i) if method.needs_queries else None,
            query_pos=pre.query_pos, scale=s.scales[i], layer_idx=i, n_layers=s.n_layers, surprisal=pre.surprisal,
            sentence_ends=pre.sentence_ends, key_scores=pre.repeat_scores.get(i) if pre.repeat_scores else None,
            rope=layer_rope(pre.rope, i), fingerprint=pre.fingerprint,
            retrieval=pre.retrieval.get(i) if pre.retrieval else None,
            budget_bytes=budget * layer_full, storage=storage_dtype))
    plan = method.plan(inputs, budget)
    for x, f in zip(inputs, plan.fractions):
        x.budget_bytes = f * layer_full
    states = method.compress_layers(inputs, plan)  # all first: a failing method leaves no half-built cache
    out = Cache(s.n_layers, s.windows)
    for i, state in zip(glob, states):
        src = pre.cache.layers[i]
        out.layers[i].set_state(state, pre.tokens, src.keys[:, :, :0].clone())
        if consume:
            src.reset()
    for i, w in enumerate(s.windows):
        if w is not None:
            if consume:
                out.layers[i] = pre.cache.layers[i]
                pre.cache.layers[i] = type(out.layers[i])(sliding_window=w)
            else:
                _copy_layer(pre.cache.layers[i], out.layers[i])
    out.copy_references(pre.cache)
    out.method, out.budget, out.config = method.name, budget, method
    streams = {i: method.stream(i, state) for i, state in zip(glob, states)}
    if any(st is not None for st in streams.values()):
        out.attach(streams.get)  # e.g. quantizers: generated tokens are quantized as they arrive
    return out


def compress(model, input_ids: Tensor, method: str = "streaming_llm", budget: float = 0.25, *,
             attention_mask: Tensor | None = None, storage_dtype: torch.dtype = torch.float16, policy=None,
             tokenizer=None, **knobs) -> Cache:
    """Prefill `input_ids` and return a kvsum.Cache holding at most `budget` of the full 16-bit bytes.

    `input_ids` is (1, T), or a batch (B, T) left padded with its `attention_mask`: every sequence is
    compressed alone (its padding stripped, its own budget), and the cache is laid out like the padded
    batch, so `model.generate(padded_ids_plus_more, attention_mask=..., past_key_values=cache)` gives each
    sequence what it gets alone. Method knobs are keyword arguments (`sinks=4` for streaming_llm);
    `kvsum.methods()` lists methods. With `policy` (a kvsum.Policy), the policy picks the method and budget
    for this context length (the full cache below its measured break-even); `cache.decision` says why.
    `tokenizer` is needed by methods that keep whole sentences (summary's score="sentence").
    """
    if policy is not None:
        return policy.compress(model, input_ids, storage_dtype=storage_dtype, tokenizer=tokenizer, **knobs)
    m = make_method(method, **knobs)
    budget, storage_dtype = check_budget(budget), check_storage(storage_dtype)  # fail before the prefill
    input_ids = check_ids(model, input_ids, batch=True)
    mask = None if attention_mask is None else check_attention_mask(attention_mask, input_ids)
    B, T = input_ids.shape
    opts = prefill_needs([m])
    if B == 1 and (mask is None or bool(mask.all())):
        pre = prefill(model, input_ids, tokenizer=tokenizer, **opts)
        return compress_prefill(pre, m, budget, storage_dtype, consume=True)
    lengths = [T] * B if mask is None else mask.sum(1).tolist()
    caches = [compress_prefill(prefill(model, input_ids[b:b + 1, T - n:], tokenizer=tokenizer, **opts),
                               m, budget, storage_dtype, consume=True) for b, n in enumerate(lengths)]
    out = Cache.stack(caches, T)
    for i, layer in enumerate(out.layers):  # quantizers keep quantizing each sequence's generated tokens
        streams = [c.layers[i].stream for c in caches]
        if streams[0] is not None and all(isinstance(st, QuantStream) for st in streams):
            layer.stream = BatchQuantStream(streams)
    return out
