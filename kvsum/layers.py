"""The layers of a `kvsum.Cache`: a compressed state plus a full-precision tail, or transformers' own sliding window.

Logical length (tokens seen) drives RoPE positions and generate()'s input slicing; the attention
mask only covers the tail, placed at its absolute positions (kv_offset = tokens not in the tail),
and the compressed entries are always visible to the tokens that follow them.

Sliding-window layers (Gemma 3's local layers) are transformers' own `DynamicSlidingWindowLayer`:
already bounded by their window, they are never compressed and attend through transformers' code.
"""

from __future__ import annotations

from typing import Protocol

import torch
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from .attention import hand_over
from .errors import KVSumError
from .state import BatchState, LayerState, tensor_bytes


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
