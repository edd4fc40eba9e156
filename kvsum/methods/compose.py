"""Composition: `method="a+b"` keeps what method `a` (eviction or summary) selects and stores it with quantizer `b`.

One byte budget covers the total. Quantized entries are cheaper than 16-bit ones, so `a` is given the
budget of as many 16-bit entries (with a bias) as the quantized entries (+ their fp16 bias) fit in the
layer's bytes; the quantizer runs at a fixed bit width (its `bits`, else DEFAULT_BITS). Summary entries'
log-mass biases stay in fp16. Knobs go to the method that declares them; a knob both declare (`seed`,
`window` ...) must be prefixed with its method's name and an underscore (`snapkv_window=32`,
`kivi_residual=0`), which works for any knob. Tokens generated while decoding are quantized by `b`'s
stream into a second, extendable state beside the composed one.

The quantizer codes every entry `a` keeps: what stays exact is `a`'s choice, so the quantizer's own exact
prompt tokens (`sinks`, `window`) are refused here. TurboQuant's key shift (key bits moved from the most
diffuse half of the layers to the sharpest) is off in a composition unless `key_shift` is given; with it, each
layer's bytes follow its entries' cost, so every layer keeps about as many entries as without the shift.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor

from ..errors import KVSumError
from ..state import EntryState, tensor_bytes
from .base import REGISTRY, LayerInput, Method
from .quant.stream import QuantStream

QUANTIZERS = ("turboquant", "kivi")
DEFAULT_BITS = {"turboquant": 3, "kivi": 2}
EXACT_KNOBS = ("sinks", "window")  # a quantizer's exact prompt tokens: the first method decides what stays exact


class ComposedState:
    """Kept entries (all heads) quantized as one state, with fp16 biases. Equal lengths per head: the
    quantizer sees (H, n, d). Ragged lengths: it sees the packed entries as one head (1, N, d). Where it
    can read them in runs (TurboQuant through the kernel), head h's queries score its own run only,
    (1, H, M, longest run); otherwise every query is scored against all N entries and other heads' entries
    are masked, as EntryState does (H times the reads: at 4k tokens, 3.5x slower for SmolLM2)."""

    def __init__(self, inner, lengths: list[int], bias: Tensor | None, head_of: Tensor | None):
        self.inner, self._lengths, self.bias, self.head_of = inner, list(lengths), bias, head_of
        self._runs = torch.tensor([0, *lengths]).cumsum(0) if head_of is not None else None  # offsets, metadata

    def _by_run(self, rows: int) -> bool:
        return self._runs is not None and hasattr(self.inner, "serves_runs") and self.inner.serves_runs(rows)

    def lengths(self) -> list[int]:
        return list(self._lengths)

    def nbytes(self) -> int:
        return self.inner.nbytes() + tensor_bytes(self.bias, self.head_of)

    def scores(self, q: Tensor, scale: float) -> Tensor:
        _, H, M, d = q.shape
        if self.head_of is None:
            s = self.inner.scores(q, scale)
            return s if self.bias is None else s + self.bias.float().view(1, H, 1, -1)
        if self._by_run(M):
            return self.inner.run_scores(q, scale, self.bias, self._runs)
        s = self.inner.scores(q.reshape(1, 1, H * M, d), scale).view(1, H, M, -1)
        if self.bias is not None:
            s = s + self.bias.float()
        own = self.head_of.long().view(1, 1, 1, -1) == torch.arange(H, device=q.device).view(1, -1, 1, 1)
        return s.masked_fill(~own, float("-inf"))

    def mix(self, p: Tensor) -> Tensor:
        if self.head_of is None:
            return self.inner.mix(p)
        _, H, M, N = p.shape
        if self._by_run(M):
            return self.inner.run_mix(p, self._runs)
        return self.inner.mix(p.reshape(1, 1, H * M, N)).view(1, H, M, -1)


@dataclass
class Composed(Method):
    """`first` selects or fits entries, `quant` stores them; built by make_method("first+quant", ...)."""

    first: Method = None
    quant: Method = None

    def __post_init__(self):
        self.name = f"{self.first.name}+{self.quant.name}"
        self.summary = f"{self.first.name} entries stored by {self.quant.name}"
        self.needs_queries = self.first.needs_queries or self._shifts()  # the key shift ranks layers by queries
        self.bits = self.quant.bits if self.quant.bits is not None else DEFAULT_BITS[self.quant.name]
        supported = self.quant.supported() if hasattr(self.quant, "supported") else (2, 4)
        if self.bits not in supported:
            raise KVSumError(f"{self.name}: bits={self.bits!r} is not supported; accepted: "
                             f"{', '.join(map(str, supported))}")
        self._storage = {}
        self._ragged = False  # whether the first method kept ragged heads (EntryState's head index then costs)

    def prefill_options(self) -> dict:
        return self.first.prefill_options()

    def _shifts(self) -> bool:
        """Whether the quantizer moves key bits between layers (TurboQuant with `key_shift`)."""
        return bool(getattr(self.quant, "shifts_layers", lambda: False)())

    def _layer_shift(self, layer_idx: int) -> int:
        return self.quant.layer_shift(layer_idx) if self._shifts() else 0

    def layer_budgets(self, inputs: list[LayerInput], budget: float) -> list[float]:
        """The first method's shape over layers, in total bytes; with the key shift, each layer's share scaled by
        what its entries cost (a widened layer's more), the total unchanged."""
        self._ragged = False  # once per prompt: a prompt's result does not depend on the prompts before it
        budgets = self.first.layer_budgets(inputs, budget)
        if not self._shifts():
            return budgets
        self.quant.layer_budgets(inputs, budget)  # ranks the layers for quant.layer_shift
        x = inputs[0]
        cost = torch.tensor([float(self.quant.nbytes(x.H, x.T, x.d, self.bits, self._layer_shift(i.layer_idx)))
                             for i in inputs])
        scaled = torch.tensor(budgets) * cost
        return (scaled * (sum(budgets) / scaled.sum())).clamp(max=1.0).tolist()

    def _quant_nbytes(self, x: LayerInput, n: int, bias: bool) -> int:
        """Bytes of n quantized entries per head (with fp16 biases, and a head index per entry where the first
        method kept ragged heads in an earlier layer of this prompt: summary's entropy allocation does in every
        layer, so only the first layer is compressed twice)."""
        q = self.quant
        inner = (q.nbytes(x.H, n, x.d, self.bits, x.storage) if q.name == "kivi"
                 else q.nbytes(x.H, n, x.d, self.bits, self._layer_shift(x.layer_idx)))
        index = (1 if x.H <= 127 else 2) if self._ragged else 0
        return inner + (2 * bias + index) * x.H * n

    def _target(self, x: LayerInput, bias: bool) -> int:
        """The first method's budget: the 16-bit bytes of the most entries per head whose quantized bytes fit."""
        lo, hi = 0, x.T
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if self._quant_nbytes(x, mid, bias) <= x.budget_bytes else (lo, mid - 1)
        if lo == 0:
            full = 2 * x.H * x.T * x.d * 2
            raise KVSumError(f"{self.name}: the budget {x.budget_bytes / full:.4f} does not fit one entry per head "
                             f"at {self.bits} bits (fixed costs of {self.quant.name}); raise the budget or lower bits")
        return lo * x.H * x.entry_bytes(bias)

    def _build(self, keys: Tensor, values: Tensor, layer_idx: int, storage: torch.dtype, all_coded: bool = False):
        if self.quant.name == "kivi":
            if all_coded:  # decoded tokens: every one coded, none of them a sink
                return self.quant.build(keys, values, self.bits, storage, keys.shape[1], sinks=0)
            return self.quant.build(keys, values, self.bits, storage)
        return self.quant.build(keys, values, self.bits, layer_idx, self._layer_shift(layer_idx))

    def compress(self, x: LayerInput) -> ComposedState:
        bias = True  # assume fitted entries with biases; redo once without if the first method keeps plain ones
        target = self._target(x, bias)
        for _ in range(3):  # entry counts of ragged heads differ a little from the estimate: shrink if over
            kept = self.first.compress(dataclasses.replace(x, budget_bytes=target))
            if not isinstance(kept, EntryState):
                raise KVSumError(f"{self.name}: {self.first.name} returned a {type(kept).__name__}; only key/value "
                                 "entries can be quantized (for summary: lowrank_share=0)")
            state = self.quantize(kept, x)
            if not kept.uniform and not self._ragged:  # count the head index from now on (see _quant_nbytes)
                self._ragged = True
            if bias and kept.bias is None:
                bias, target = False, self._target(x, False)
                continue
            if state.nbytes() <= x.budget_bytes:
                break
            target = int(target * 0.98 * x.budget_bytes / state.nbytes())
        self._storage[x.layer_idx] = x.storage
        return state

    def quantize(self, kept: EntryState, x: LayerInput) -> ComposedState:
        k, v, lengths = kept.keys.float(), kept.values.float(), kept.lengths()
        if kept.uniform:
            inner = self._build(k.view(x.H, lengths[0], x.d), v.view(x.H, lengths[0], x.d), x.layer_idx, x.storage)
        else:
            inner = self._build(k[None], v[None], x.layer_idx, x.storage)
        bias = kept.bias.half() if kept.bias is not None else None
        return ComposedState(inner, lengths, bias, kept.head_of)

    def stream(self, layer_idx: int, state) -> QuantStream | None:
        storage = self._storage.get(layer_idx, torch.float16)
        return QuantStream(self.quant.group, self.quant.residual,
                           new=lambda k, v: self._build(k, v, layer_idx, storage, all_coded=True))


def compose(name: str, **knobs) -> Composed:
    """The Composed method of a name "first+quantizer", its knobs routed (see the module docstring)."""
    from .base import make_method

    parts = name.split("+")
    if len(parts) != 2 or not all(parts):
        raise KVSumError(f"a composed method is 'method+quantizer' (e.g. 'summary+turboquant'), got {name!r}")
    first, quant = parts
    for p in parts:
        if p not in REGISTRY:
            raise KVSumError(f"unknown method {p!r} in {name!r}; accepted: {', '.join(sorted(REGISTRY))}")
    if quant not in QUANTIZERS:
        raise KVSumError(f"{name!r}: the second method must be a quantizer; accepted: {', '.join(QUANTIZERS)}")
    if first in QUANTIZERS or first == "full":
        raise KVSumError(f"{name!r}: the first method must select or fit entries (eviction or summary), got {first!r}")
    own = {first: set(REGISTRY[first].knobs()), quant: set(REGISTRY[quant].knobs())}
    routed = {first: {}, quant: {}}
    for key, value in knobs.items():
        for m in parts:
            if key.startswith(m + "_") and key[len(m) + 1:] in own[m]:
                routed[m][key[len(m) + 1:]] = value
                break
        else:
            holders = [m for m in parts if key in own[m]]
            if len(holders) == 2:
                raise KVSumError(f"{name!r}: knob {key!r} belongs to both methods; "
                                 f"write {first}_{key} or {quant}_{key}")
            if not holders:
                accepted = sorted(f"{m}_{k}" if k in own[first] & own[quant] else k for m in parts for k in own[m])
                raise KVSumError(f"{name!r} has no knob {key!r}; accepted: {', '.join(dict.fromkeys(accepted))}")
            routed[holders[0]][key] = value
    exact = sorted(set(routed[quant]) & set(EXACT_KNOBS))
    if exact:
        raise KVSumError(f"{name!r}: {quant}'s exact prompt tokens ({', '.join(exact)}) do not apply in a composition: "
                         f"{quant} codes every entry {first} keeps, and {first} decides what stays exact")
    if routed[quant].get("pre_rope"):
        raise KVSumError(f"{name!r}: {quant}'s pre_rope un-rotates each key by its position, and {first} keeps "
                         "entries whose positions the codes do not get; drop pre_rope in a composition")
    if quant == "turboquant":
        routed[quant].setdefault("key_shift", 0)  # off unless asked for (see the module docstring)
    return Composed(first=make_method(first, **routed[first]), quant=make_method(quant, **routed[quant]))
