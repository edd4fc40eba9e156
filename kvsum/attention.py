"""kvsum's attention functions, registered with transformers' AttentionInterface.

`kvsum_sdpa` and `kvsum_eager` wrap transformers' own sdpa and eager attention. A layer with no
compressed state is passed straight to the wrapped function, so the uncompressed path is
transformers' own computation, bit for bit. A layer with a compressed state is attended in one
softmax over [compressed entries (with their additive biases) | full-precision tail].

The cache layer hands its compressed state to the attention call that follows its `update`
through a thread-local slot (update and attention of one layer run back to back), and
`kvsum.compress` captures reference queries through another.
"""

from __future__ import annotations

import sys
import threading

import torch
from torch import Tensor
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask

from .errors import KVSumError
from .kernels import online

_local = threading.local()


def hand_over(state, observer=None) -> None:
    """Called by a cache layer's update: the next attention call attends over `state` too, and shows its
    queries to `observer.observe(query)` (a decoding-time stream that scores entries by them) if given."""
    _local.state, _local.observer = state, observer


def _take():
    state, observer = getattr(_local, "state", None), getattr(_local, "observer", None)
    _local.state = _local.observer = None
    return state, observer


class Capture:
    """Base of what the attention function feeds during a kvsum prefill: `add(layer, query, key, scale)`."""

    def __enter__(self):
        _local.capture = self
        return self

    def __exit__(self, *exc):
        _local.capture = None


class QueryCapture(Capture):
    """Collects, per layer, the post-RoPE queries at chosen prompt positions during a prefill, which may run
    in chunks: a call's queries are the last positions of its keys, and each chunk keeps its share."""

    def __init__(self, positions: Tensor):
        self.positions = positions
        self.parts: dict[int, list[Tensor]] = {}

    def add(self, layer_idx: int, query: Tensor, key: Tensor, scale: float) -> None:
        start = key.shape[2] - query.shape[2]
        pos = self.positions.to(query.device)
        pos = pos[(pos >= start) & (pos < key.shape[2])] - start
        if pos.numel():
            self.parts.setdefault(layer_idx, []).append(query[0, :, pos, :].float())

    @property
    def queries(self) -> dict[int, Tensor]:
        """Per layer, the (Hq, n, d) queries at `positions` seen so far, in position order."""
        got = {i: p[0] if len(p) == 1 else torch.cat(p, 1) for i, p in self.parts.items()}
        if any(q.shape[1] != self.positions.numel() for q in got.values()):
            raise KVSumError("query capture saw only part of the prompt: run the whole prompt, chunk after chunk")
        return got


class RepeatScorer(Capture):
    """While the model re-reads its context, the attention each context key receives (max over the
    re-reading queries and the query heads of its group), per layer: (H, T). Computed in query chunks,
    so no attention matrix larger than (heads, chunk, keys) exists at once."""

    def __init__(self, context_len: int, chunk: int = 256):
        self.T, self.chunk = context_len, chunk
        self.scores: dict[int, Tensor] = {}

    def add(self, layer_idx: int, query: Tensor, key: Tensor, scale: float) -> None:
        _, Hq, n, d = query.shape
        H = key.shape[1]
        k = key[0].float()  # (H, T + n, d): the context then the re-read so far
        best = torch.zeros(H, self.T, device=key.device)
        for a in range(0, n, self.chunk):
            q = query[0, :, a:a + self.chunk].float().reshape(H, -1, d)  # grouped by KV head
            m = q.shape[1] // (Hq // H)
            logits = q @ k.transpose(-1, -2) * scale  # (H, G*m, T + n)
            rows = torch.arange(a, a + m, device=key.device).repeat(Hq // H)
            future = torch.arange(k.shape[1], device=key.device)[None, :] > (self.T + rows)[:, None]
            p = torch.softmax(logits.masked_fill(future, float("-inf")), -1)
            best = torch.maximum(best, p[..., : self.T].amax(1))
        self.scores[layer_idx] = best


def _eager_of(module):
    """The model's own eager attention function (each modeling file defines one)."""
    fn = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    if fn is None:
        raise KVSumError(f"{type(module).__name__} has no eager_attention_forward; use attn='sdpa'")
    return fn


def _tail_mask(mask: Tensor | None, q_len: int, t: int, device) -> Tensor | None:
    """The additive (q, t) float mask over the tail's t tokens, or None where every query sees all of them."""
    if mask is None:
        if q_len == 1:  # transformers drops the mask only when a plain causal mask over the tail is meant
            return None
        mask = torch.ones(q_len, t, dtype=torch.bool, device=device).tril(t - q_len)
    m = mask[0, 0] if mask.dim() == 4 else mask  # (q, t): one mask for all heads
    # a stream may have folded the oldest tail tokens into the state after the mask was built: the mask's last t
    # columns are the tail's.
    m = m[..., m.shape[-1] - t:]
    if m.dtype == torch.bool:
        return torch.zeros(m.shape, device=m.device).masked_fill(~m, float("-inf"))
    return m.float()


def joint_attention(state, query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None,
                    scaling: float) -> Tensor:
    """softmax over [state entries | tail] for queries (B=1, Hq, q, d); returns (1, q, Hq, d)."""
    _, Hq, q_len, d = query.shape
    H, t = key.shape[1], key.shape[2]
    G = Hq // H
    qg = query.float().reshape(1, H, G * q_len, d)
    add = _tail_mask(mask, q_len, t, query.device)
    fused = getattr(state, "online", None)  # a state whose kernel joins the softmax in one pass (CUDA, kvsum.kernels)
    parts = fused(qg, scaling) if fused is not None else None
    if parts is not None:  # stacked partials, and exact entries read with the tail in one product
        exact = [p for p in parts if isinstance(p, online.Exact)]
        k = torch.cat([*(e.keys for e in exact), key[0]], 1).float() if exact else key[0].float()
        v = torch.cat([*(e.values for e in exact), value[0]], 1).float() if exact else value[0].float()
        s = torch.bmm(qg[0], k.transpose(1, 2)).mul_(scaling)  # (H, G*q, exact + t): bmm, fewest operations
        if add is not None:
            s.view(H, G, q_len, -1)[..., s.shape[-1] - t:] += add
        joined = online.join([p for p in parts if not isinstance(p, online.Exact)] +
                             [online.from_scores(s, lambda w: torch.bmm(w, v))])
        return online.output(joined).view(1, H * G, q_len, d).transpose(1, 2).to(query.dtype)
    s_state = state.scores(qg, scaling)  # (1, H, G*q, N)
    s_tail = qg @ key.float().transpose(-1, -2) * scaling  # (1, H, G*q, t)
    if add is not None:
        s_tail = (s_tail.view(1, H, G, q_len, -1) + add).view(1, H, G * q_len, -1)
    n = s_state.shape[-1]
    # nan_to_num: a row with nothing to attend (a padding query over an empty state) gives zeros, not NaN
    p = torch.softmax(torch.cat([s_state, s_tail], dim=-1), dim=-1).nan_to_num_(0.0)
    out = state.mix(p[..., :n]) + p[..., n:] @ value.float()
    return out.view(1, H * G, q_len, d).transpose(1, 2).to(query.dtype)


def batch_attention(states: list, query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None,
                    scaling: float) -> Tensor:
    """joint_attention per sequence: sequence b's queries over its own state and its row of the tail
    (the tail is uniform across the batch; its mask row hides any padding in it)."""
    if len(states) != query.shape[0]:
        raise KVSumError(f"the cache holds {len(states)} sequences, the model input {query.shape[0]}")
    outs = []
    for b, state in enumerate(states):
        m = None if mask is None else mask[b:b + 1] if mask.shape[0] > 1 else mask
        outs.append(joint_attention(state, query[b:b + 1], key[b:b + 1], value[b:b + 1], m, scaling))
    return torch.cat(outs)


def _make(base: str):
    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        state, observer = _take()
        if observer is not None:
            observer.observe(query)
        capture = getattr(_local, "capture", None)
        if capture is not None and getattr(module, "sliding_window", None) is None:  # window layers: never compressed
            capture.add(module.layer_idx, query, key, scaling if scaling is not None else query.shape[-1] ** -0.5)
        if state is None:
            fn = sdpa_attention_forward if base == "sdpa" else _eager_of(module)
            return fn(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        if getattr(state, "per_sequence", False):  # a batch: every sequence attends over its own state
            return batch_attention(state.states, query, key, value, attention_mask, scale), None
        if query.shape[0] != 1:
            raise KVSumError(f"this compressed cache holds one sequence; got a batch of {query.shape[0]}")
        return joint_attention(state, query, key, value, attention_mask, scale), None

    attention.__name__ = f"kvsum_{base}"
    return attention


AttentionInterface.register("kvsum_sdpa", _make("sdpa"))
AttentionInterface.register("kvsum_eager", _make("eager"))
AttentionMaskInterface.register("kvsum_sdpa", sdpa_mask)
AttentionMaskInterface.register("kvsum_eager", eager_mask)


def use_kvsum_attention(model) -> None:
    """Switch a model to kvsum's wrapper of its current attention (sdpa or eager); idempotent."""
    impl = model.config._attn_implementation
    if impl.startswith("kvsum_"):
        return
    if impl not in ("sdpa", "eager"):
        raise KVSumError(f"attention implementation {impl!r} is not supported; accepted: 'sdpa', 'eager'")
    model.set_attn_implementation(f"kvsum_{impl}")
