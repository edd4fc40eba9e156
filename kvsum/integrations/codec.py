"""Full-precision KV <-> kvsum's compressed bytes, with no model at hand: what a KV store or a serving engine carries.

An engine that pages KV per token (LMCache's chunks, vLLM's blocks) holds, for each layer, one key and one value
per token and head. `compress_kv` turns such KV into a `kvsum.Cache` with a kvsum quantizer, layer by layer, and
`encode` gives its bytes: a .kvsum file (kvsum.persist: safetensors, packed codes stay packed, a SHA-256 over
everything). `decode` checks and rebuilds it, and `dense_kv` gives back one key and one value per token and head,
what the engine's pages hold again.

Only token-aligned quantizers fit (TurboQuant, KIVI without position-tied knobs or reference queries): every
token keeps an entry of its own with no bias, so the rebuilt KV is a drop-in for the original pages. Eviction
(ragged heads), summaries (log-mass biases) and reconstruction (per-model calibration) do not (docs/serving.md).

Without a model there is no model fingerprint: the bytes carry a layout fingerprint instead (`layout`), the
model's name as the engine knows it and the KV shape, and `decode` refuses bytes made for another.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import persist
from ..budget import check_budget, check_storage, full_nbytes
from ..cache import Cache
from ..errors import KVSumError
from ..methods import LayerInput, make_method
from ..methods.quantizer import Quantizer
from ..state import ConcatState, EntryState

DEFAULT_METHOD = "turboquant:bits=4,key_shift=0"


def layout(model: str, n_layers: int, kv_heads: int, head_dim: int) -> dict:
    """The fingerprint of KV made without a kvsum model: the engine's model name and the KV shape."""
    return {"engine_model": str(model), "layers": int(n_layers), "kv_heads": int(kv_heads), "head_dim": int(head_dim)}


def codec_method(method) -> Quantizer:
    """The configured quantizer for `method` (a spec string such as "turboquant:bits=4", or a Method), or a
    KVSumError naming why it cannot code KV without a model."""
    m = make_method(method) if isinstance(method, str) else method
    name = getattr(m, "name", type(m).__name__)
    if not isinstance(m, Quantizer):
        raise KVSumError(f"method {name!r} cannot code paged KV: it does not keep one entry per token (eviction, "
                         "summaries) or needs the model (reconstruction); use a quantizer: turboquant, kivi")
    if m.prefill_options() or m.shifts_layers or getattr(m, "key_basis", "random") != "random":
        raise KVSumError(f"method {name!r} as configured reads reference queries or prefill signals (key_shift, "
                         "key_basis='pca'), which paged KV does not carry; set key_shift=0, key_basis='random'")
    if m.position_knob():
        raise KVSumError(f"method {name!r}: knob {m.position_knob()!r} ties the codes to prompt positions, which a "
                         "chunk of paged KV does not know; leave it off")
    return m


@torch.no_grad()
def compress_kv(keys: list[Tensor], values: list[Tensor], method=DEFAULT_METHOD, budget: float = 1.0, *,
                fingerprint: dict, storage_dtype: torch.dtype = torch.float16) -> Cache:
    """A kvsum.Cache of one sequence from per-layer keys and values (H, T, d), post-RoPE as the engine holds them.

    `method` must be a token-aligned quantizer (see `codec_method`); `budget` bounds its bytes as in
    kvsum.compress (with `bits` set, the quantizer's own width decides and the budget only has to admit it)."""
    m = codec_method(method)
    budget, storage_dtype = check_budget(budget), check_storage(storage_dtype)
    if not keys or len(keys) != len(values):
        raise KVSumError(f"compress_kv needs keys and values for each layer, got {len(keys)} and {len(values)}")
    H, T, d = keys[0].shape
    if T == 0:
        raise KVSumError("compress_kv: no tokens to compress")
    inputs = [LayerInput(keys=k.float(), values=v.float(), queries=None, query_pos=None, scale=d ** -0.5,
                         layer_idx=i, n_layers=len(keys), budget_bytes=budget * full_nbytes(1, H, d, T),
                         storage=storage_dtype) for i, (k, v) in enumerate(zip(keys, values))]
    if any(x.keys.shape != (H, T, d) or x.values.shape != (H, T, d) for x in inputs):
        raise KVSumError(f"compress_kv: every layer's keys and values must be (H, T, d) = {(H, T, d)}")
    plan = m.plan(inputs, budget)
    for x, f in zip(inputs, plan.fractions):
        x.budget_bytes = f * full_nbytes(1, H, d, T)
    states = m.compress_layers(inputs, plan)
    cache = Cache(len(keys))
    empty = keys[0].new_zeros(1, H, 0, d, dtype=storage_dtype)
    for layer, state in zip(cache.layers, states):
        layer.set_state(state, T, empty.clone())
    cache.reference_nbytes = cache.budget_reference_nbytes = full_nbytes(len(keys), H, d, T)
    cache.model_reference_nbytes = full_nbytes(len(keys), H, d, T, bits=8 * keys[0].element_size())
    cache.method, cache.budget, cache.config, cache.fingerprint = m.name, budget, m, dict(fingerprint)
    dense_kv(cache)  # fails here, not at load, if the method's states are not token-aligned after all
    return cache


def dense_kv(cache) -> list[tuple[Tensor, Tensor]]:
    """Per layer, the keys and values (H, T, d) fp32 that attention over the cache reads, one per token in token
    order: dequantized codes, exact tokens and the uncompressed tail. A KVSumError for a cache that holds anything
    else (a batch, ragged heads, biases, sliding windows): such a state has no per-token form."""
    out = []
    for i, layer in enumerate(cache.layers):
        state, tokens = getattr(layer, "state", None), layer.get_seq_length()
        if getattr(layer, "sliding_window", None) is not None or layer.keys.shape[0] != 1:
            raise KVSumError(f"layer {i}: a sliding-window layer or a batch has no single per-token form")
        k_tail, v_tail = layer.keys[0].float(), layer.values[0].float()
        if state is None:
            out.append((k_tail, v_tail))
            continue
        k, v = _dense(state, f"layer {i} (method {cache.method!r})")
        if set(state.lengths()) != {layer.offset} or k.shape[1] != layer.offset or v.shape != k.shape:
            raise KVSumError(f"layer {i}: the state holds {state.lengths()} entries per head for {layer.offset} "
                             "tokens; only one entry per token rebuilds into pages")
        out.append((torch.cat([k, k_tail], 1), torch.cat([v, v_tail], 1)))
        if out[-1][0].shape[1] != tokens:
            raise KVSumError(f"layer {i}: rebuilt {out[-1][0].shape[1]} tokens, the cache has seen {tokens}")
    return out


def _dense(state, where: str) -> tuple[Tensor, Tensor]:
    """A state's keys and values (H, n, d) fp32, one per entry in position order, or a KVSumError."""
    if isinstance(state, ConcatState):  # exact sinks / codes / exact window, in position order
        parts = [_dense(p, where) for p in state.parts]
        return torch.cat([k for k, _ in parts], 1), torch.cat([v for _, v in parts], 1)
    if isinstance(state, EntryState) and state.uniform and state.bias is None:  # exact tokens
        n = state.lengths()[0]
        return (state.keys.view(state.H, n, -1).float(), state.values.view(state.H, n, -1).float())
    if callable(getattr(state, "keys", None)) and callable(getattr(state, "values", None)):  # dequantized codes
        return state.keys().float(), state.values().float()
    raise KVSumError(f"{where}: a {type(state).__name__} holds no key and value per token (ragged heads or "
                     "biases); only token-aligned quantizers (turboquant, kivi) rebuild into pages")


def encode(cache) -> bytes:
    """The cache's .kvsum bytes (kvsum.persist.to_bytes)."""
    return persist.to_bytes(cache)


def decode(data: bytes, fingerprint: dict | None = None, device: str | torch.device = "cpu") -> Cache:
    """The kvsum.Cache of `encode`d bytes, after the checks `kvsum.load_cache` makes (format version, SHA-256,
    kvsum's own classes only), with the layout fingerprint in place of a model's. KVSumError on any mismatch."""
    cache = persist.from_bytes(data, fingerprint=fingerprint, device=device)
    if not isinstance(cache, Cache):
        raise KVSumError(f"kvsum bytes whose root is a {type(cache).__qualname__}, not a kvsum.Cache")
    return cache


def frame(payload: bytes) -> bytes:
    """`payload` behind its length (8 bytes, little-endian): for buffers larger than what they hold."""
    return len(payload).to_bytes(8, "little") + payload


def unframe(buffer: bytes | memoryview) -> bytes:
    """The payload `frame` wrote at the start of `buffer`, or a KVSumError for a buffer too short for it."""
    if len(buffer) < 8:
        raise KVSumError(f"a kvsum payload buffer of {len(buffer)} bytes: too short for its length field")
    n = int.from_bytes(bytes(buffer[:8]), "little")
    if n > len(buffer) - 8:
        raise KVSumError(f"a truncated kvsum payload: {n} bytes announced, {len(buffer) - 8} present")
    return bytes(buffer[8:8 + n])
