"""Decoding-time eviction: hold every layer of a kvsum.Cache at a target size while the model generates.

`DecodingEviction(model, method, max_tokens, every)` is attached to a cache (`cache.attach(ev)`): each
global layer gets an `EvictionStream` that remembers the queries of its last `observe` tokens and, once
`every` new tokens have arrived and a head holds more than its target (compressed entries + tail),
re-selects the layer's entries with an eviction method's own scoring and budget allocation:

- candidates are the entries the layer holds, per head in position order (the compressed state, then
  the tail), except the current step's tokens, which must stay in the tail;
- the observed queries play the method's reference queries, placed at the end (`query_pos`), and
  causality is exact: a query never votes for an entry newer than itself (the stream keeps every kept
  entry's position, since EntryState does not);
- the first `keep_first` tokens (attention sinks) and the newest `keep_last` candidates are always
  kept, besides what the method itself protects (SnapKV's and ReST-KV's windows, H2O's recent share);
- the kept entries become a new EntryState in `storage_dtype` and the tail shrinks to the current
  step's tokens, so between compressions a head holds at most `max_tokens + every` entries.

It works on a full cache (`method="full"` prefill: evict only while generating), on a cache compressed
by any entry-selecting method (entries of unknown positions count as older than every query), and on
an empty cache filled by chunked prefill. Until the layer holds more than its target nothing changes:
the outputs are those of the full cache, bit for bit. The observed queries are the stream's only
extra memory (`query_nbytes()`, model dtype), not part of `cache.nbytes()`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .budget import check_storage
from .cache import KVSumLayer
from .errors import KVSumError
from .methods import REGISTRY, LayerInput, make_method
from .methods.evict.allocation import pyramid_budgets, select
from .methods.evict.scoring import Eviction
from .shape import ModelShape
from .state import EntryState

_PAD = torch.iinfo(torch.int64).max  # position of a padding slot: newer than every query, so never seen
_SELECTING = ("random", "streaming_llm")  # entry-selecting methods outside the eviction family


def selecting_methods() -> list[str]:
    """Methods that keep a subset of the entries, the ones decoding-time eviction can run."""
    return sorted([n for n, c in REGISTRY.items() if issubclass(c, Eviction)] + list(_SELECTING))


@dataclass
class DecodeInput(LayerInput):
    """A LayerInput over a layer's held entries: `hidden` (H, n, T) marks, per KV head, the entries each
    observed query must not see (newer than the query, or padding of a head holding fewer entries)."""

    hidden: Tensor | None = None
    kept: list[Tensor] | None = None  # filled by keep(): the positions a method chose

    def keep(self, idx, bias=None):
        self.kept = idx
        return super().keep(idx, bias)


class EvictionStream:
    """One layer's decoding-time eviction (see the module docstring); built by DecodingEviction."""

    def __init__(self, owner: DecodingEviction, layer_idx: int, target: int):
        self.owner, self.layer_idx, self.target = owner, layer_idx, target
        self.since = owner.every  # tokens since the last compression: the first step over target compresses
        self.queries: Tensor | None = None  # (Hq, <= observe, d), model dtype
        self.query_pos: Tensor | None = None  # (<= observe,) absolute positions
        self.positions: list[Tensor] | None = None  # per head: absolute positions of `state`'s entries
        self.state = None  # the state this stream built (positions are known only for it)
        self.layer: KVSumLayer | None = None
        self.compressions = 0

    def observe(self, query: Tensor) -> None:
        if query.shape[0] != 1:
            raise KVSumError(f"decoding-time eviction holds one sequence; got a batch of {query.shape[0]}")
        if not self.owner.method.needs_queries:
            return
        q = query[0].detach()
        end = self.layer.get_seq_length()
        pos = torch.arange(end - q.shape[1], end, device=q.device)
        if self.queries is not None:
            q, pos = torch.cat([self.queries, q], 1), torch.cat([self.query_pos, pos])
        w = self.owner.observe
        self.queries, self.query_pos = q[:, -w:].contiguous(), pos[-w:]

    def nbytes(self) -> int:
        return 0 if self.queries is None else self.queries.numel() * self.queries.element_size()

    def step(self, layer: KVSumLayer, fresh: int) -> None:
        self.layer = layer
        self.since += fresh
        lengths = layer.lengths()
        if self.owner.adaptive:  # heads share the layer's entries
            over = sum(lengths) > self.target * len(lengths)
        else:
            over = max(lengths) > self.target
        if self.since < self.owner.every or not over:
            return
        if self.owner.method.needs_queries and self.queries is None:
            return  # nothing observed yet (a stream attached after the prefill): wait one step
        movable = layer.tail_length() - fresh
        if self._evict(layer, movable, self.target - fresh):
            self.since = 0

    def _held(self, layer: KVSumLayer):
        """Per head: keys, values (float32) and absolute positions of the compressed entries."""
        state = layer.state
        H, d = layer.keys.shape[1], layer.keys.shape[-1]
        if state is None:
            empty = layer.keys.new_zeros(0, d, dtype=torch.float32)
            return [empty] * H, [empty] * H, [torch.zeros(0, dtype=torch.long, device=layer.keys.device)] * H
        if not isinstance(state, EntryState) or state.bias is not None:
            raise KVSumError(f"decoding-time eviction re-selects plain entries; layer {self.layer_idx} holds a "
                             f"{type(state).__name__}{' with biases' if isinstance(state, EntryState) else ''} "
                             f"(start from method='full' or one of: {', '.join(selecting_methods())})")
        lengths = state.lengths()
        keys, values = state.keys.float().split(lengths), state.values.float().split(lengths)
        if state is self.state:
            pos = self.positions
        else:  # compressed before this stream: stored in position order, all older than the tail and queries
            pos = [torch.arange(n, device=state.keys.device) for n in lengths]
        return list(keys), list(values), pos

    @torch.no_grad()
    def _evict(self, layer: KVSumLayer, movable: int, n_keep: int) -> bool:
        """Re-select the compressed entries + the oldest `movable` tail tokens down to n_keep per head."""
        ev = self.owner
        keys, values, pos = self._held(layer)
        H, d = len(keys), layer.keys.shape[-1]
        lengths = [len(p) for p in pos]
        S = max(lengths)
        T = S + movable
        if n_keep <= 0 or movable < 0 or n_keep >= T:
            return False
        device = layer.keys.device
        # layout per head: [its entries | padding up to the longest head | the movable tail, shared]
        K = torch.zeros(H, T, d, device=device)
        V = torch.zeros(H, T, d, device=device)
        P = torch.full((H, T), _PAD, dtype=torch.long, device=device)
        for h in range(H):
            n = lengths[h]
            K[h, :n], V[h, :n], P[h, :n] = keys[h], values[h], pos[h]
        K[:, S:] = layer.keys[0, :, :movable].float()
        V[:, S:] = layer.values[0, :, :movable].float()
        P[:, S:] = layer.offset + torch.arange(movable, device=device)
        queries = hidden = qpos = None
        if self.queries is not None:
            queries = self.queries.float()
            m = queries.shape[1]
            qpos = torch.arange(T - m, T, device=device)  # at the end, in time order
            hidden = P[:, None, :] > self.query_pos.to(device)[None, :, None]  # (H, m, T)
        entry = torch.empty(0, dtype=ev.storage).element_size() * 2 * d
        x = DecodeInput(keys=K, values=V, queries=queries, query_pos=qpos, scale=ev.scales[self.layer_idx],
                        layer_idx=self.layer_idx, n_layers=ev.n_layers, budget_bytes=float(H * n_keep * entry),
                        storage=ev.storage, hidden=hidden)
        pad = P == _PAD
        if isinstance(ev.method, Eviction):
            scores = ev.method.score(x).float().masked_fill(pad, float("-inf"))

            def protect(n):
                first, last = ev.method.protect(n)
                return max(first, ev.keep_first), max(last, ev.keep_last)

            idx = select(x, scores, ev.method.allocation, protect)
        else:
            ev.method.compress(x)
            idx = x.kept
        idx = [i[~pad[h, i]] for h, i in enumerate(idx)]  # a head shorter than the longest keeps no padding
        layer.state = EntryState([K[h, i] for h, i in enumerate(idx)], [V[h, i] for h, i in enumerate(idx)],
                                 dtype=ev.storage)
        self.state, self.positions = layer.state, [P[h, i] for h, i in enumerate(idx)]
        layer.offset += movable
        layer.keys, layer.values = layer.keys[:, :, movable:], layer.values[:, :, movable:]
        self.compressions += 1
        return True


class DecodingEviction:
    """Bounded-memory generation: `cache.attach(DecodingEviction(model, "snapkv", max_tokens=1024, every=64))`.

    `max_tokens`: entries each KV head may hold (compressed + tail) right after a compression; between
    compressions it grows by at most `every`. With `allocation="pyramid"` the layers' targets follow
    PyramidKV's shape (mean max_tokens); with `"adaptive"` the heads of a layer share H * max_tokens
    entries (ragged, stored packed). `observe`: queries of the newest tokens kept per layer (the scoring's
    reference queries). `keep_first` / `keep_last`: the first tokens (attention sinks) and the newest entries always
    kept, besides what the method itself protects. Method knobs as keywords (`allocation=`, `window=`...).
    """

    def __init__(self, model, method: str = "snapkv", max_tokens: int = 1024, every: int = 64, *, observe: int = 32,
                 keep_first: int = 4, keep_last: int = 0, storage_dtype: torch.dtype = torch.float16, **knobs):
        if method not in REGISTRY:
            raise KVSumError(f"unknown method {method!r}; decoding-time eviction accepts: "
                             f"{', '.join(selecting_methods())}")
        if method not in selecting_methods():
            raise KVSumError(f"method {method!r} does not select entries; decoding-time eviction accepts: "
                             f"{', '.join(selecting_methods())}")
        for name, value, low in (("max_tokens", max_tokens, 1), ("every", every, 1), ("observe", observe, 1),
                                 ("keep_first", keep_first, 0), ("keep_last", keep_last, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise KVSumError(f"{name} must be an integer >= {low}, got {value!r}")
        if keep_first + keep_last >= max_tokens:
            raise KVSumError(f"max_tokens ({max_tokens}) must exceed keep_first + keep_last ({keep_first + keep_last})")
        self.method = make_method(method, **knobs)
        self.max_tokens, self.every, self.observe = max_tokens, every, observe
        self.keep_first, self.keep_last = keep_first, keep_last
        self.storage = check_storage(storage_dtype)
        shape = ModelShape.of(model)
        self.n_layers, self.scales = shape.n_layers, shape.scales
        self.adaptive = getattr(self.method, "allocation", "uniform") == "adaptive"
        if getattr(self.method, "allocation", "uniform") == "pyramid":
            weights = [f / 0.5 for f in pyramid_budgets(shape.n_layers, 0.5)]  # mean 1, uncapped at 0.5
            self.targets = [max(keep_first + keep_last + 1, round(max_tokens * w)) for w in weights]
        else:
            self.targets = [max_tokens] * shape.n_layers
        self.streams: dict[int, EvictionStream] = {}

    def __call__(self, layer_idx: int) -> EvictionStream:
        self.streams[layer_idx] = EvictionStream(self, layer_idx, self.targets[layer_idx])
        return self.streams[layer_idx]

    def compressions(self) -> int:
        """Compressions run so far, summed over layers."""
        return sum(s.compressions for s in self.streams.values())

    def query_nbytes(self) -> int:
        """Bytes of the observed queries the streams keep (outside cache.nbytes())."""
        return sum(s.nbytes() for s in self.streams.values())
