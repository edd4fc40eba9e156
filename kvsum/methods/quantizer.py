"""The quantizer base: what every quantizer declares and offers, so compositions and covers use any of them alike.

It sits beside the method protocol (base.py), outside the quant family, because other families hold a quantizer
as a knob (summary's cover) and families do not import each other.

Like a template (transformers' QuantizedLayer), a `Quantizer` has one `build` signature (keys and values of
any token count -> an extendable state) and one `nbytes` signature (the bytes that state will hold), with
keywords for what only some quantizers read (the layer index that seeds a rotation, the key bits shifted to a
layer, the storage dtype of exact tokens, whether the tokens were decoded). What differs between quantizers
is declared, not probed: the supported widths, the width used where `bits` is None in a composition, the
knobs that keep prompt tokens exact, whether key bits move between layers, and a lighter variant for
layers whose budget the fixed costs do not fit.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import Tensor

from .attention_stats import head_diffuseness
from .base import LayerInput, Method, Plan


@dataclass(frozen=True)
class KeyShiftPlan(Plan):
    """A plan with the key bits moved to each layer (layer index -> +-bits; absent: 0)."""

    shifts: dict[int, int] = field(default_factory=dict)

    def shift(self, layer_idx: int) -> int:
        return self.shifts.get(layer_idx, 0)


def key_shifts(diffuseness: dict[int, float], shift: int) -> dict[int, int]:
    """Layer index -> key bits moved to it: +shift for the sharpest half of the layers (lowest attention
    entropy), -shift for the most diffuse half; with an odd count the median layer keeps its width."""
    order = sorted(diffuseness, key=diffuseness.get)
    n = len(order) // 2
    return {i: shift * ((rank < n) - (rank >= len(order) - n)) for rank, i in enumerate(order)}


@dataclass(frozen=True)
class Quantizer(Method):
    """Base of the quantizer configs (TurboQuant, KIVI). Subclasses have the knobs `bits` (None: the largest
    supported width that fits), `group` and `residual` (decoding-time folding, see stream.py)."""

    supported_bits: ClassVar[tuple[float, ...]] = ()  # the widths `bits` may take
    default_bits: ClassVar[float] = 0  # the width of a composition or a cover whose quantizer has bits=None
    exact_knobs: ClassVar[tuple[str, ...]] = ()  # knobs keeping prompt tokens exact (refused in a composition)
    position_knobs: ClassVar[tuple[str, ...]] = ()  # knobs tying the codes to prompt positions (refused composed)

    bits = None  # overridden by each subclass's field

    def supported(self) -> tuple[float, ...]:
        """The widths this configuration can run at (a subclass may narrow supported_bits by its knobs)."""
        return self.supported_bits

    def fixed_bits(self) -> float:
        """The width of a composition or a cover: `bits`, else default_bits."""
        return self.bits if self.bits is not None else self.default_bits

    @property
    def shifts_layers(self) -> bool:
        """Whether key bits move between layers by attention entropy (see `key_shifts`)."""
        return False

    def key_shifts(self, diffuseness: dict[int, float]) -> dict[int, int]:
        """Layer index -> key bits moved to it, from each layer's mean head diffuseness ({} without a shift)."""
        return {}

    def exact_set(self) -> list[str]:
        """The exact-token knobs set to other than their defaults (what a cover or composition cannot honour)."""
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        return [k for k in self.exact_knobs if getattr(self, k) != defaults[k]]

    def position_knob(self) -> str | None:
        """The knob, if set, that ties the codes to the keys' prompt positions (entries kept out of order by
        another method cannot take it): the first of `position_knobs` that is set."""
        return next((k for k in self.position_knobs if getattr(self, k)), None)

    def lighter(self, d: int) -> Quantizer | None:
        """This quantizer with a smaller fixed cost at head dim d, for a layer whose budget its fixed costs do
        not fit; None where there is none."""
        return None

    def lighter_note(self) -> str:
        """What `lighter` changed, for the state's note (cache.stats())."""
        return ""

    def basis_queries(self, x: LayerInput) -> Tensor | None:
        """The reference queries `build` weights its codes by, (H, M, d), or None if it reads none."""
        return None

    def placed(self, x: LayerInput, first: int, last: int) -> dict:
        """The `build` keywords that give codes tied to positions (position_knobs) those of layer x's tokens
        first .. T - last - 1; none for codes that need no positions."""
        return {}

    def plan(self, inputs: list[LayerInput], budget: float) -> KeyShiftPlan:
        """Equal bytes per layer; the layers ranked by attention entropy where key bits move between them."""
        shifts = {}
        if self.shifts_layers and all(x.queries is not None for x in inputs):
            shifts = self.key_shifts({x.layer_idx: float(head_diffuseness(x).mean()) for x in inputs})
        return KeyShiftPlan(tuple([budget] * len(inputs)), shifts)

    def build(self, keys: Tensor, values: Tensor, bits: float, *, layer_idx: int = 0, shift: int = 0,
              storage: torch.dtype = torch.float16, decoded: bool = False, queries: Tensor | None = None):
        """The extendable state of keys and values (H, T, d) fp32 at `bits`: layer `layer_idx`'s seeds, keys
        `shift` bits wider, exact tokens in `storage`; `decoded` tokens are all coded (none exact);
        `queries` as `basis_queries` gives them."""
        raise NotImplementedError

    def nbytes(self, H: int, T: int, d: int, bits: float, *, shift: int = 0,
               storage: torch.dtype = torch.float16) -> int:
        """Exactly what `build` of (H, T, d) keys and values holds (at most that where codes follow queries)."""
        raise NotImplementedError

    def charged_nbytes(self, H: int, T: int, d: int, bits: float, *, shift: int = 0,
                       storage: torch.dtype = torch.float16) -> int:
        """What a layer shifted by +-`shift` is charged when budgets are planned (default: its nbytes)."""
        return self.nbytes(H, T, d, bits, shift=shift, storage=storage)
