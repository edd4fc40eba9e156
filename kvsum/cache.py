"""`kvsum.Cache`: a transformers Cache whose layers hold a compressed state plus a full-precision tail.

Logical length (tokens seen) drives RoPE positions and generate()'s input slicing; the attention
mask only covers the tail, placed at its absolute positions (kv_offset = tokens not in the tail),
and the compressed entries are always visible to the tokens that follow them.

Sliding-window layers (Gemma 3's local layers) are transformers' own `DynamicSlidingWindowLayer`:
already bounded by their window, they are never compressed and attend through transformers' code.

Batches: every sequence is compressed on its own (`BatchState` holds one state per sequence, ragged
lengths for real); the prompt length in the cache is the padded length for all of them, so positions,
masks and the tail of new tokens stay uniform across the batch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
import transformers
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from .attention import hand_over
from .budget import full_nbytes
from .errors import KVSumError
from .state import BatchState, LayerState, tensor_bytes

REFERENCES = ("reference_nbytes", "budget_reference_nbytes", "model_reference_nbytes")  # see Cache


class Stream(Protocol):
    """Decoding-time behaviour of one layer (streaming quantization, decoding-time eviction).

    `step(layer, fresh)` runs after every cache update and may replace `layer.state`, shorten the tail
    (`layer.keys`/`layer.values`, oldest tokens first) and raise `layer.offset` by the tokens it folded;
    the attention call that follows sees the result. The `fresh` newest tail tokens (this update's) must
    stay in the tail: state entries are visible to every query, so folding them would break causality.
    `observe(query)` receives that call's queries
    (1, Hq, q, d), for streams that score entries by recent attention. `attach` takes streams of one
    sequence; for a batch, kvsum.compress joins the quantizers' per-sequence streams (BatchQuantStream).
    """

    def step(self, layer: KVSumLayer, fresh: int) -> None: ...

    def observe(self, query: torch.Tensor) -> None: ...


def _check_batch(layer, key_states: torch.Tensor) -> None:
    if layer.is_initialized and layer.keys.dim() == 4 and layer.keys.shape[0] != key_states.shape[0]:
        raise KVSumError(f"the cache holds {layer.keys.shape[0]} sequence(s), the model input {key_states.shape[0]}; "
                         "compress the whole batch with kvsum.compress(model, ids, attention_mask=...)")


class KVSumLayer(DynamicLayer):
    """One layer: `state` (compressed prompt, or None) + `keys`/`values` (the tail, model dtype)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.state: LayerState | None = None
        self.offset = 0  # logical tokens that live in `state`, not in the tail
        self.stream = None  # optional Stream: runs after every update, may move tail tokens into the state

    def set_state(self, state: LayerState | None, offset: int, empty_tail: torch.Tensor) -> None:
        self.state, self.offset = state, offset
        self.keys, self.values = empty_tail, empty_tail.clone()
        self.device, self.is_initialized = empty_tail.device, True

    def update(self, key_states, value_states, *args, **kwargs):
        _check_batch(self, key_states)
        keys, values = super().update(key_states, value_states)
        if self.stream is not None:
            self.stream.step(self, key_states.shape[-2])  # may fold old tail tokens into the state
            keys, values = self.keys, self.values
        hand_over(self.state, self.stream)
        return keys, values

    def tail_length(self) -> int:
        return 0 if not self.is_initialized else self.keys.shape[-2]

    def get_seq_length(self) -> int:
        return self.offset + self.tail_length()

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.tail_length() + query_length, self.offset

    def nbytes(self) -> int:
        held = tensor_bytes(self.keys, self.values) if self.is_initialized else 0
        return held + (self.state.nbytes() if self.state is not None else 0)

    def lengths(self) -> list[int]:
        """Entries held per KV head (compressed entries + tail; summed over a batch's sequences)."""
        if not self.is_initialized:
            return []
        t = self.tail_length() * self.keys.shape[0]
        if self.state is None:
            return [t] * self.keys.shape[1]
        return [n + t for n in self.state.lengths()]

    def reset(self) -> None:
        self.state, self.offset = None, 0
        super().reset()

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove < 0 and -tokens_to_remove > self.tail_length():
            raise KVSumError("cannot crop into the compressed part of a kvsum cache")
        super().crop(tokens_to_remove)

    # beam search and num_return_sequences reorder, repeat and select sequences: the states follow. A stream
    # belongs to one sequence's state (copies share it), so it stops there: later tokens stay in the tail.
    def reorder_cache(self, beam_idx):
        super().reorder_cache(beam_idx)
        if self.state is not None:
            self.state, self.stream = BatchState.of(self.state).select(beam_idx.tolist()), None

    def batch_repeat_interleave(self, repeats: int):
        super().batch_repeat_interleave(repeats)
        if self.state is not None:
            self.state = BatchState([s for s in BatchState.of(self.state).states for _ in range(repeats)])
            self.stream = None

    def batch_select_indices(self, indices):
        super().batch_select_indices(indices)
        if self.state is not None:
            self.state, self.stream = BatchState.of(self.state).select(torch.as_tensor(indices).tolist()), None


class KVSumSlidingLayer(DynamicSlidingWindowLayer):
    """A sliding-window layer exactly as transformers holds it (the last window - 1 tokens); never
    compressed, so its attention is transformers' own. Bytes are counted like any other layer's."""

    state = None
    offset = 0
    stream = None

    def update(self, key_states, value_states, *args, **kwargs):
        _check_batch(self, key_states)
        out = super().update(key_states, value_states, *args, **kwargs)
        hand_over(None)
        return out

    def tail_length(self) -> int:
        return 0 if not self.is_initialized else self.keys.shape[-2]

    def nbytes(self) -> int:
        return tensor_bytes(self.keys, self.values) if self.is_initialized else 0

    def lengths(self) -> list[int]:
        if not self.is_initialized:
            return []
        return [self.tail_length() * self.keys.shape[0]] * self.keys.shape[1]


def _left_pad(t: torch.Tensor, length: int) -> torch.Tensor:
    """(1, H, n, d) -> (1, H, length, d), zeros first: the layout of a left-padded batch."""
    if t.shape[-2] == length:
        return t
    pad = t.new_zeros(*t.shape[:-2], length - t.shape[-2], t.shape[-1])
    return torch.cat([pad, t], dim=-2)


class Cache(transformers.Cache):
    """A transformers Cache of `KVSumLayer`s; pass it to `model.generate(..., past_key_values=cache)`.

    `windows[i]` is the sliding window of layer i, or None for a global layer (the only kind compressed).
    `nbytes()` counts every tensor held, sliding layers included; `budget_nbytes()` what the global layers
    hold. The references it is measured against (summed over a batch's sequences), all of the prompt's full
    cache as transformers would hold it, sliding layers at their window:

    Attributes:
        reference_nbytes: the full cache at 16 bits per element, whatever the model's dtype (the reference
            of every budget and `ratio()` in kvsum).
        budget_reference_nbytes: the same for the global layers alone (what `budget` is a fraction of;
            equal to `reference_nbytes` on models without sliding layers).
        model_reference_nbytes: the full cache in the model's own dtype (twice `reference_nbytes` for a
            float32 model): what the model would hold without kvsum.
        method: name of the method that compressed the cache ("full" if none).
        budget: the budget it was compressed at.
    """

    def __init__(self, num_layers: int, windows: list[int | None] | None = None):
        windows = windows or [None] * num_layers
        if len(windows) != num_layers:
            raise KVSumError(f"windows needs one entry per layer ({num_layers}), got {len(windows)}")
        super().__init__(layers=[KVSumLayer() if w is None else KVSumSlidingLayer(sliding_window=w)
                                 for w in windows])
        self.windows = list(windows)
        self.reference_nbytes = self.budget_reference_nbytes = self.model_reference_nbytes = 0
        self.method = "full"
        self.budget = 1.0

    def copy_references(self, other: Cache) -> None:
        """Take `other`'s reference byte counts (those of the same prompt)."""
        for name in REFERENCES:
            setattr(self, name, getattr(other, name))

    @property
    def batch_size(self) -> int:
        layer = self.layers[0]
        return layer.keys.shape[0] if layer.is_initialized else 1

    def attach(self, make_stream: Callable[[int], Stream | None]) -> Cache:
        """Give global layer i the decoding-time stream make_stream(i) (None leaves it alone); returns self.
        Sliding-window layers keep transformers' behaviour and get none."""
        if self.batch_size != 1:
            raise KVSumError(f"streams hold one sequence; this cache holds a batch of {self.batch_size}")
        for i, layer in enumerate(self.layers):
            if isinstance(layer, KVSumLayer):
                layer.stream = make_stream(i)
        return self

    def set_mode(self, mode: str) -> Cache:
        """Switch a reconstruction cache (echokv) between "compressed" (rebuild at every attention call, few
        bytes) and "full" (rebuilt once and held: full bytes, full-cache decoding speed), e.g. per request as
        memory allows. Lossless both ways: the stored part is never modified. Returns self."""
        held = [getattr(layer, "state", None) for layer in self.layers]
        states = [s for st in held for s in getattr(st, "states", [st]) if hasattr(s, "set_mode")]
        if not states:
            raise KVSumError(f"set_mode: a {self.method!r} cache has no full/compressed modes (echokv has)")
        for state in states:
            state.set_mode(mode)
        return self

    def nbytes(self) -> int:
        """Bytes of every tensor the cache holds (compressed states, tails, sliding windows)."""
        return sum(layer.nbytes() for layer in self.layers)

    def budget_nbytes(self) -> int:
        """Bytes held by the layers the budget governs (the global, non-sliding ones)."""
        return sum(layer.nbytes() for layer in self.layers if isinstance(layer, KVSumLayer))

    def window_nbytes(self) -> int:
        """Bytes held by the sliding-window layers (uncompressed, at most window - 1 tokens each)."""
        return self.nbytes() - self.budget_nbytes()

    def ratio(self) -> float:
        """nbytes() over `reference_nbytes`, the full cache of the prompt at 16 bits per element
        (nbytes() / model_reference_nbytes is the same against the model's own dtype)."""
        return self.nbytes() / self.reference_nbytes if self.reference_nbytes else float("nan")

    def stats(self) -> list[dict]:
        """Per layer and KV head: entries held, bytes, ratio to the full 16-bit cache of the tokens seen
        (summed over a batch's sequences; `sliding` marks transformers' window layers; `note` says what the
        method degraded to fit the budget, e.g. a lighter rotation, "" when nothing)."""
        rows = []
        for i, layer in enumerate(self.layers):
            lengths = layer.lengths()
            if not lengths:
                continue
            seen, d = layer.get_seq_length(), layer.keys.shape[-1]
            head_full = full_nbytes(1, layer.keys.shape[0], d, seen)  # one head, all sequences
            layer_bytes, note = layer.nbytes(), getattr(getattr(layer, "state", None), "note", "") or ""
            total = sum(lengths) or 1
            for h, n in enumerate(lengths):
                share = layer_bytes * n / total  # a layer's bytes split over its heads by entries held
                rows.append(dict(layer=i, head=h, entries=n, tokens_seen=seen, bytes=round(share),
                                 ratio=share / head_full if head_full else float("nan"),
                                 sliding=isinstance(layer, KVSumSlidingLayer), note=note))
        return rows

    @classmethod
    def stack(cls, caches: list[Cache], length: int) -> Cache:
        """One batch cache from per-sequence caches (batch 1 each, prompts of ragged lengths), laid out as
        a left-padded batch of prompt length `length`: compressed layers hold each sequence's state with
        the uniform offset `length`; uncompressed and sliding layers are left-padded with zeros, which the
        attention mask of the padded batch hides."""
        first = caches[0]
        out = cls(len(first.layers), first.windows)
        for i, dst in enumerate(out.layers):
            src = [c.layers[i] for c in caches]
            if isinstance(dst, KVSumSlidingLayer):
                keep = min(length, dst.sliding_window - 1)
                keys = torch.cat([_left_pad(s.keys, keep) for s in src])
                values = torch.cat([_left_pad(s.values, keep) for s in src])
                dst.lazy_initialization(keys, values)
                dst.keys, dst.values, dst.cumulative_length = keys, values, length
            elif all(s.state is None for s in src):
                keys = torch.cat([_left_pad(s.keys, length) for s in src])
                dst.set_state(None, 0, keys[:, :, :0])
                dst.keys, dst.values = keys, torch.cat([_left_pad(s.values, length) for s in src])
            else:
                if any(s.state is None or s.tail_length() for s in src):
                    raise KVSumError("Cache.stack needs every sequence compressed, with no tail yet")
                states = [s.state for s in src]
                state = states[0] if len(states) == 1 else BatchState(states)
                dst.set_state(state, length, torch.cat([s.keys for s in src]))
        for name in REFERENCES:
            setattr(out, name, sum(getattr(c, name) for c in caches))
        out.method, out.budget = first.method, first.budget
        return out
