"""Composition: `method="a+b"` keeps what method `a` (eviction or summary) selects and stores it with quantizer `b`.

One byte budget covers the total. Quantized entries are cheaper than 16-bit ones, so `a` is given the
budget of as many 16-bit entries as the quantized entries fit in the layer's bytes, each with an fp16
log-mass bias where `a`'s entries carry one (its `entry_bias`: summary's fitted summaries); the quantizer
runs at a fixed bit width (its `bits`, else its `default_bits`). Knobs are routed to the part that declares
them by make_method (kvsum/methods/registry.py). Decoded tokens are quantized by `b`'s stream beside it.

The quantizer codes every entry `a` keeps: what stays exact is `a`'s choice, so the quantizer's own exact
prompt tokens (its `exact_knobs`) are refused here. A quantizer's key shift (key bits moved from the most
diffuse half of the layers to the sharpest) is off in a composition unless asked for (its
`composed_defaults`); with it, each layer's bytes follow its entries' cost, so every layer keeps about as many
entries as without the shift. Any `Quantizer` composes: nothing here depends on which one.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor

from ..errors import KVSumError
from ..state import ConcatState, EntryState, tensor_bytes
from .base import LayerInput, Method, Plan
from .quant.stream import QuantStream
from .quantizer import KeyShiftPlan, Quantizer
from .refusal import budget_hint, least_budget
from .sinks import split_exact


@dataclass(frozen=True)
class DecodedCodes:
    """Builds the decoded tokens' state as the kept entries' was built (a value, so a cache holding it can save)."""

    quant: Quantizer
    bits: float
    layer_idx: int
    shift: int
    storage: torch.dtype

    def __call__(self, keys: Tensor, values: Tensor):
        return self.quant.build(keys, values, self.bits, layer_idx=self.layer_idx, shift=self.shift,
                                storage=self.storage, decoded=True)


class ComposedState:
    """Kept entries (all heads) quantized as one state, with fp16 biases. Equal lengths per head: the quantizer
    sees (H, n, d). Ragged lengths: the packed entries as one head (1, N, d); where it reads them in runs
    (TurboQuant through the kernels), head h's queries read its own run only, (1, H, M, longest run); otherwise
    every query is scored against all N entries, other heads' masked, as EntryState does (H times the reads).
    `quant`, `shift` and `storage` are what the inner state was built with (the quantizer, after any fallback,
    the layer's key shift, the storage dtype): decoded tokens are built the same way."""

    def __init__(self, inner, lengths: list[int], bias: Tensor | None, head_of: Tensor | None,
                 quant: Quantizer | None = None, shift: int = 0, storage: torch.dtype = torch.float16,
                 note: str = ""):
        self.inner, self._lengths, self.bias, self.head_of = inner, list(lengths), bias, head_of
        self.quant, self.shift, self.storage, self.note = quant, shift, storage, note
        self._runs = torch.tensor([0, *lengths]).cumsum(0) if head_of is not None else None  # offsets, metadata

    def _by_run(self, rows: int) -> bool:
        serves = getattr(self.inner, "serves_runs", None)  # a state's optional fast path (TurboQuantState's)
        return self._runs is not None and serves is not None and serves(rows)

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

    def online(self, q: Tensor, scale: float) -> list | None:
        """The inner state's fused decoding pass (TurboQuant's codes on CUDA: each head over its own run, with the
        biases); None where none serves (then `scores` and `mix` do)."""
        fused = getattr(self.inner, "online", None)
        if fused is None or (self.head_of is None and self.bias is None):
            return fused(q, scale) if fused is not None else None
        if not hasattr(self.inner, "serves_runs"):
            return None  # biases and runs: TurboQuant's pass only (it says itself where it serves)
        return fused(q, scale, bias=self.bias, runs=self._runs)

    def mix(self, p: Tensor) -> Tensor:
        if self.head_of is None:
            return self.inner.mix(p)
        _, H, M, N = p.shape
        if self._by_run(M):
            return self.inner.run_mix(p, self._runs)
        return self.inner.mix(p.reshape(1, 1, H * M, N)).view(1, H, M, -1)


@dataclass(frozen=True)
class ComposedPlan(KeyShiftPlan):
    """The composition's plan: its layers' fractions and key shifts, and the first method's own plan."""

    first: Plan | None = None
    plain: frozenset = frozenset()  # layers whose entries stay unquantized: the quantizer's fixed costs exceed them


@dataclass(frozen=True)
class Composed(Method):
    """`first` selects or fits entries, `quant` stores them; built by make_method("first+quant", ...).

    Attributes:
        first: the method that selects or fits the entries (eviction or summary).
        quant: the quantizer that stores them (any `Quantizer`), at a fixed width.
    """

    first: Method = None
    quant: Quantizer = None

    def __post_init__(self):
        if not isinstance(self.quant, Quantizer) or not isinstance(self.first, Method) or isinstance(self.first,
                                                                                                      Quantizer):
            raise KVSumError(f"a composition takes a method that selects or fits entries and a quantizer, got "
                             f"{type(self.first).__name__} and {type(self.quant).__name__}")
        supported = self.quant.supported()
        if self.bits not in supported:
            raise KVSumError(f"{self.name}: bits={self.bits!r} is not supported; accepted: "
                             f"{', '.join(map(str, supported))}")
        exact = self.quant.exact_set()
        if exact:
            raise KVSumError(f"{self.name!r}: {self.quant.name}'s exact prompt tokens ({', '.join(exact)}) do not "
                             f"apply in a composition: {self.quant.name} codes every entry {self.first.name} keeps, "
                             f"and {self.first.name} decides what stays exact")
        knob = self.quant.position_knob()
        if knob:
            raise KVSumError(f"{self.name!r}: {self.quant.name}'s {knob} un-rotates each key by its position, and "
                             f"{self.first.name} keeps entries whose positions the codes do not get; drop {knob} in "
                             "a composition")

    @property
    def name(self) -> str:
        return f"{self.first.name}+{self.quant.name}"

    @property
    def summary(self) -> str:
        return f"{self.first.name} entries stored by {self.quant.name}"

    @property
    def needs_queries(self) -> bool:
        return self.first.needs_queries or self.quant.shifts_layers  # the key shift ranks layers by queries

    @property
    def bits(self) -> float:
        """The quantizer's fixed width: its `bits`, else its default_bits."""
        return self.quant.fixed_bits()

    def prefill_options(self) -> dict:
        return self.first.prefill_options()

    def plan(self, inputs: list[LayerInput], budget: float) -> ComposedPlan:
        """The first method's shape over layers, in total bytes; with the key shift, each layer's share scaled by
        what its entries cost (a widened layer's more), the total unchanged. A budget that leaves some layer less
        than one quantized entry per head is refused here, naming the smallest that fits."""
        plan = self._plan(inputs, budget)
        need = [self._least(x, plan.shift(x.layer_idx)) for x in inputs]
        full = [2 * x.H * x.T * x.d * 2 for x in inputs]
        plain = frozenset(x.layer_idx for x, n, n_full in zip(inputs, need, full) if n > n_full)

        def fits(fractions) -> bool:
            return all(f * n_full >= n for x, f, n_full, n in zip(inputs, fractions, full, need)
                       if x.layer_idx not in plain)
        if not fits(plan.fractions):
            least = least_budget(lambda b: fits(self._plan(inputs, b).fractions), budget)
            if least is None:  # no budget pays for the codes in those layers: their entries stay unquantized
                plain |= {x.layer_idx for x, f, n_full, n in zip(inputs, plan.fractions, full, need) if f * n_full < n}
            else:
                raise KVSumError(f"{self.name}: the budget {budget:.4f} does not fit one entry per head in every "
                                 f"layer at {self.bits} bits (fixed costs of {self.quant.name}); the smallest budget "
                                 f"that fits: {least:.3f}")
        return dataclasses.replace(plan, plain=plain)

    def _plan(self, inputs: list[LayerInput], budget: float) -> ComposedPlan:
        first = self.first.plan(inputs, budget)
        budgets, shifts = list(first.fractions), {}
        if self.quant.shifts_layers:
            shifts = self.quant.plan(inputs, budget).shifts  # the layers ranked for the key shift
            x = inputs[0]
            cost = torch.tensor([float(self.quant.nbytes(x.H, x.T, x.d, self.bits, shift=shifts.get(i.layer_idx, 0)))
                                 for i in inputs])
            scaled = torch.tensor(budgets) * cost
            budgets = (scaled * (sum(budgets) / scaled.sum())).clamp(max=1.0).tolist()
        return ComposedPlan(tuple(budgets), shifts, first)

    def _least(self, x: LayerInput, shift: int) -> int:
        """The fewest bytes layer x can hold: one entry per head (its bias, if any), by the lighter quantizer if any."""
        quant = self.quant.lighter(x.d) or self.quant
        return min(self._quant_nbytes(x, 1, self.first.entry_bias, False, q, shift) for q in (self.quant, quant))

    def compress(self, x: LayerInput, plan: Plan | None = None) -> ComposedState:
        """One layer alone (no earlier layer of the prompt kept ragged heads)."""
        return self._compress(x, plan, False)[0]

    def compress_layers(self, inputs: list[LayerInput], plan: Plan) -> list[ComposedState]:
        """All layers in order: once a layer's first method keeps ragged heads, later layers count the head index
        in their entries' bytes (summary's entropy allocation does in every layer, so only the first layer is
        compressed twice)."""
        states, ragged = [], False
        for x in inputs:
            state, ragged = self._compress(x, plan, ragged)
            states.append(state)
        return states

    def _quant_nbytes(self, x: LayerInput, n: int, bias: bool, ragged: bool, quant: Quantizer, shift: int) -> int:
        """Bytes of n quantized entries per head (with fp16 biases, and a head index per entry where the first
        method kept ragged heads in an earlier layer of this prompt)."""
        inner = quant.nbytes(x.H, n, x.d, self.bits, shift=shift, storage=x.storage)
        index = (1 if x.H <= 127 else 2) if ragged else 0
        return inner + (2 * bias + index) * x.H * n

    def _exact(self, x: LayerInput) -> tuple[int, int]:
        """Prompt tokens kept exact beside the codes (split_exact): the first method's sinks and newest tokens."""
        return min(getattr(self.first, "sinks", 0), x.T), getattr(self.first, "recent_exact", 0)  # summary's

    def _target(self, x: LayerInput, bias: bool, ragged: bool, quant: Quantizer, shift: int) -> int:
        """The first method's budget: the 16-bit bytes of the most entries per head whose bytes fit, its sinks exact
        (see split_exact) and the rest quantized, so the first method runs once per layer, not again to shrink."""
        s = sum(self._exact(x))
        lo, hi = 0, x.T
        while lo < hi:
            mid = (lo + hi + 1) // 2
            exact = min(mid, s)
            coded = self._quant_nbytes(x, mid - exact, bias, ragged, quant, shift) if mid > exact else 0
            fits = exact * x.H * x.entry_bytes() + coded <= x.budget_bytes
            lo, hi = (mid, hi) if fits else (lo, mid - 1)
        if lo == 0:
            full = 2 * x.H * x.T * x.d * 2
            need = self._quant_nbytes(x, 1, bias, ragged, quant, shift)
            raise KVSumError(f"{self.name}: the budget {x.budget_bytes / full:.4f} of layer {x.layer_idx} does not fit "
                             f"one entry per head at {self.bits} bits (fixed costs of {quant.name}); raise the budget "
                             f"or lower bits ({budget_hint(need, full).replace('budget', 'layer budget')})")
        return lo * x.H * x.entry_bytes(bias)

    def _compress(self, x: LayerInput, plan: Plan | None, ragged: bool) -> tuple[ComposedState, bool]:
        """The layer's state, and whether this or an earlier layer kept ragged heads."""
        shift = plan.shift(x.layer_idx) if isinstance(plan, KeyShiftPlan) and self.quant.shifts_layers else 0
        first_plan = plan.first if isinstance(plan, ComposedPlan) else None
        if isinstance(plan, ComposedPlan) and x.layer_idx in plan.plain:  # too few tokens to pay for the codes
            state = self.first.compress(x, first_plan)
            state.note = f"entries kept unquantized: {self.quant.name}'s fixed costs exceed the layer's full bytes"
            return state, ragged
        quant, note = self.quant, ""
        bias = self.first.entry_bias  # fitted entries' biases (summary's), declared so that it selects once
        light = self.quant.lighter(x.d)
        if light is not None and self._quant_nbytes(x, 1, bias, ragged, quant, shift) > x.budget_bytes >= \
                self._quant_nbytes(x, 1, bias, ragged, light, shift):
            quant, note = light, self.quant.lighter_note()
        target = self._target(x, bias, ragged, quant, shift)
        for _ in range(3):  # entry counts of ragged heads differ a little from the estimate: shrink if over
            kept = self.first.compress(dataclasses.replace(x, budget_bytes=target), first_plan)
            if not isinstance(kept, EntryState) or (kept.bias is not None) != bias:
                raise KVSumError(f"{self.name}: {self.first.name} returned a {type(kept).__name__} (entry_bias="
                                 f"{bias}); only key/value entries, biased as declared, can be quantized (for summary: "
                                 "lowrank_share=0)")
            exact, kept = split_exact(kept, x.keys, x.values, *self._exact(x))
            state = self.quantize(kept, x, quant, shift, note)
            if exact is not None:
                state = ConcatState([exact, state])
                state.note = note
            ragged = ragged or not kept.uniform  # count the head index from now on (see _quant_nbytes)
            if state.nbytes() <= x.budget_bytes:
                break
            target = int(target * 0.98 * x.budget_bytes / state.nbytes())
        return state, ragged

    def quantize(self, kept: EntryState, x: LayerInput, quant: Quantizer | None = None, shift: int = 0,
                 note: str = "") -> ComposedState:
        """The kept entries of layer x coded by `quant` (default: the composition's) with key shift `shift`."""
        quant = quant or self.quant
        k, v, lengths = kept.keys.float(), kept.values.float(), kept.lengths()
        if kept.uniform:
            k, v = k.view(x.H, lengths[0], x.d), v.view(x.H, lengths[0], x.d)
        else:
            k, v = k[None], v[None]
        inner = quant.build(k, v, self.bits, layer_idx=x.layer_idx, shift=shift, storage=x.storage)
        bias = kept.bias.half() if kept.bias is not None else None
        return ComposedState(inner, lengths, bias, kept.head_of, quant, shift, x.storage, note)

    def stream(self, layer_idx: int, state) -> QuantStream | None:
        state = state.parts[-1] if isinstance(state, ConcatState) else state  # exact tokens, then the codes
        if not isinstance(state, ComposedState):
            return None
        return QuantStream(self.quant.group, self.quant.residual,
                           new=DecodedCodes(state.quant, self.bits, layer_idx, state.shift, state.storage))
