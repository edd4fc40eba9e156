"""`kvsum.Cache`: a transformers Cache whose layers hold a compressed state plus a full-precision tail.

Logical length (tokens seen) drives RoPE positions and generate()'s input slicing; the attention
mask only covers the tail, placed at its absolute positions (kv_offset = tokens not in the tail),
and the compressed entries are always visible to the tokens that follow them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
import transformers
from transformers.cache_utils import DynamicLayer

from .attention import hand_over
from .errors import KVSumError
from .state import LayerState, tensor_bytes


class Stream(Protocol):
    """Decoding-time behaviour of one layer (streaming quantization, decoding-time eviction).

    `step(layer, fresh)` runs after every cache update and may replace `layer.state`, shorten the tail
    (`layer.keys`/`layer.values`, oldest tokens first) and raise `layer.offset` by the tokens it folded;
    the attention call that follows sees the result. The `fresh` newest tail tokens (this update's) must
    stay in the tail: state entries are visible to every query, so folding them would break causality.
    `observe(query)` receives that call's queries
    (1, Hq, q, d), for streams that score entries by recent attention.
    """

    def step(self, layer: KVSumLayer, fresh: int) -> None: ...

    def observe(self, query: torch.Tensor) -> None: ...


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
        """Entries held per KV head (compressed entries + tail)."""
        if not self.is_initialized:
            return []
        t = self.tail_length()
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

    def _batch_op(self, name, *args):
        if self.state is not None:
            raise KVSumError(f"{name} is not supported on a compressed cache (it holds one sequence)")
        getattr(super(), name)(*args)

    def reorder_cache(self, beam_idx):
        self._batch_op("reorder_cache", beam_idx)

    def batch_repeat_interleave(self, repeats: int):
        self._batch_op("batch_repeat_interleave", repeats)

    def batch_select_indices(self, indices):
        self._batch_op("batch_select_indices", indices)


class Cache(transformers.Cache):
    """A transformers Cache of `KVSumLayer`s; pass it to `model.generate(..., past_key_values=cache)`.

    `reference_nbytes` is the size of the full cache for the compressed prompt at 16 bits per
    element, the unit in which budgets are expressed.
    """

    def __init__(self, num_layers: int):
        super().__init__(layers=[KVSumLayer() for _ in range(num_layers)])
        self.reference_nbytes = 0
        self.method = "full"
        self.budget = 1.0

    def attach(self, make_stream: Callable[[int], Stream | None]) -> Cache:
        """Give layer i the decoding-time stream make_stream(i) (None leaves it alone); returns self."""
        for i, layer in enumerate(self.layers):
            layer.stream = make_stream(i)
        return self

    def nbytes(self) -> int:
        """Bytes of every tensor the cache holds (compressed states and tails)."""
        return sum(layer.nbytes() for layer in self.layers)

    def ratio(self) -> float:
        """nbytes() over the full 16-bit cache of the compressed prompt."""
        return self.nbytes() / self.reference_nbytes if self.reference_nbytes else float("nan")

    def stats(self) -> list[dict]:
        """Per layer and KV head: entries held, bytes, ratio to the full fp16 cache of the tokens seen."""
        rows = []
        for i, layer in enumerate(self.layers):
            lengths = layer.lengths()
            if not lengths:
                continue
            seen, d = layer.get_seq_length(), layer.keys.shape[-1]
            head_full = 2 * seen * d * 2
            layer_bytes = layer.nbytes()
            total = sum(lengths) or 1
            for h, n in enumerate(lengths):
                share = layer_bytes * n / total  # a layer's bytes split over its heads by entries held
                rows.append(dict(layer=i, head=h, entries=n, tokens_seen=seen, bytes=round(share),
                                 ratio=share / head_full if head_full else float("nan")))
        return rows
