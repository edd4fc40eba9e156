"""Decoding-time quantization: the tokens a model generates are quantized in groups as they arrive.

A `QuantStream` runs after every cache update of one layer. It counts the full-precision tokens the
layer holds (the quantized state's own pending ones, e.g. KIVI's recent window, plus the tail) and, once
they exceed `residual + group`, quantizes the oldest whole groups with the layer's own quantizer:
same rotation, codebooks and channel split (TurboQuant), same group layout (KIVI). The codes are
appended to one packed store, so decoding never walks a growing list of states.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

from ...state import ConcatState


class QuantStream:
    """Folds the oldest full-precision tokens of a layer into an extendable quantized state.

    `live` is that state (it has `pending()` and `extend(keys, values, quantize)`); when the layer's state
    cannot be extended (a composed state of kept entries), `new(keys, values)` builds one for the decoded
    tokens on the first fold and the layer attends to both (a two-part ConcatState).
    """

    def __init__(self, group: int, residual: int, live=None, new: Callable[[Tensor, Tensor], object] | None = None):
        self.group, self.residual, self.live, self.new = group, residual, live, new

    def observe(self, query: Tensor) -> None:
        pass

    def pending(self) -> int:
        return self.live.pending() if self.live is not None else 0

    def plan(self, tail: int, fresh: int) -> tuple[int, int]:
        """(tokens to quantize, tokens that leave the tail): the oldest whole groups beyond the window, never
        including this update's own `fresh` tokens."""
        pending, g = self.pending(), self.group
        n = min((pending + tail - self.residual) // g, (pending + tail - fresh) // g) * g
        return (n, max(0, n - pending)) if n > 0 else (0, 0)

    def fold(self, keys: Tensor, values: Tensor, n: int, state):
        """Append keys/values (H, take, d) and quantize the `n` oldest full-precision tokens; returns the
        layer's state (a new ConcatState the first time a composed layer folds)."""
        if self.live is None:
            self.live = self.new(keys, values)
            return ConcatState([state, self.live])
        self.live.extend(keys, values, n)
        return state

    def step(self, layer, fresh: int) -> None:
        n, take = self.plan(layer.tail_length(), fresh)
        if n <= 0:
            return
        layer.state = self.fold(layer.keys[0, :, :take].float(), layer.values[0, :, :take].float(), n, layer.state)
        trim(layer, take)


def trim(layer, take: int) -> None:
    """Move the `take` oldest tail tokens' accounting into the state."""
    layer.offset += take
    layer.keys, layer.values = layer.keys[:, :, take:], layer.values[:, :, take:]


class BatchQuantStream:
    """The QuantStreams of a batch's sequences, one per sequence, over one dense tail.

    The tail is shared, so every sequence folds the same number of tokens: the fewest any sequence's own
    plan takes (sequences whose windows differ, as KIVI's do with ragged prompts, quantize what whole groups
    that allows and keep the rest pending)."""

    def __init__(self, streams: list[QuantStream]):
        self.streams = streams

    def observe(self, query: Tensor) -> None:
        pass

    def step(self, layer, fresh: int) -> None:
        plans = [s.plan(layer.tail_length(), fresh) for s in self.streams]
        take = min(t for _, t in plans)
        if take <= 0:
            return
        states = layer.state.states
        for b, (s, (n, _)) in enumerate(zip(self.streams, plans)):
            n = min(n, (s.pending() + take) // s.group * s.group)
            states[b] = s.fold(layer.keys[b, :, :take].float(), layer.values[b, :, :take].float(), n, states[b])
        trim(layer, take)
