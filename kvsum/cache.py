"""`kvsum.Cache`: a transformers Cache of kvsum layers (kvsum.layers), with its byte accounting, and the ways a
compressed prefix outlives one request: `fork()` for another question, `save()` / `kvsum.load_cache` for another
process (kvsum.persist).

Batches: every sequence is compressed on its own (`BatchState` holds one state per sequence, ragged
lengths for real); the prompt length in the cache is the padded length for all of them, so positions,
masks and the tail of new tokens stay uniform across the batch.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
import transformers

from . import persist
from .budget import full_nbytes
from .errors import KVSumError
from .layers import KVSumLayer, KVSumSlidingLayer, Stream
from .state import BatchState

__all__ = ["Cache", "KVSumLayer", "KVSumSlidingLayer", "Stream"]

REFERENCES = ("reference_nbytes", "budget_reference_nbytes", "model_reference_nbytes")  # see Cache


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
        config: the configured method (a kvsum.Method, knobs included), None for a cache built by hand.
        fingerprint: the model's kvsum.shape.fingerprint, what `kvsum.load_cache` checks a model against.
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
        self.config = self.fingerprint = None

    def copy_references(self, other: Cache) -> None:
        """Take `other`'s reference byte counts (those of the same prompt) and its model's fingerprint."""
        for name in REFERENCES:
            setattr(self, name, getattr(other, name))
        self.fingerprint = other.fingerprint

    def fork(self) -> Cache:
        """An independent cache over the same compressed prefix, to answer another question: the compressed
        state's tensors are shared (none is ever written in place), only what follows is the fork's own. Cheap:
        no tensor is copied. `copy.deepcopy(cache)` gives the same behaviour at the cost of a full copy."""
        return persist.fork(self)

    def save(self, path) -> Path:
        """Write the cache to one safetensors file (packed codes stay packed; atomic: a reader never sees a
        partial file); `kvsum.load_cache(path, model)` loads it in any process. Returns the path."""
        return persist.save(self, path)

    def to_bytes(self) -> bytes:
        """The bytes `save` writes (for stores that take bytes, such as LMCache's)."""
        return persist.to_bytes(self)

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
        out.method, out.budget, out.config = first.method, first.budget, first.config
        out.fingerprint = first.fingerprint
        return out
