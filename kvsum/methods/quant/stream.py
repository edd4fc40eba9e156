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

    def step(self, layer, fresh: int) -> None:
        pending = self.live.pending() if self.live is not None else 0
        tail = layer.tail_length()
        g = self.group
        # the oldest whole groups beyond the window, never including this update's own tokens
        n = min((pending + tail - self.residual) // g, (pending + tail - fresh) // g) * g
        if n <= 0:
            return
        take = max(0, n - pending)  # tokens that leave the tail
        k, v = layer.keys[0, :, :take].float(), layer.values[0, :, :take].float()
        if self.live is None:
            self.live = self.new(k, v)
            layer.state = ConcatState([layer.state, self.live])
        else:
            self.live.extend(k, v, n)
        layer.offset += take
        layer.keys, layer.values = layer.keys[:, :, take:], layer.values[:, :, take:]
