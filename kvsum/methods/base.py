"""The method protocol and the config base class.

A method is a frozen dataclass of knobs: a value, never anything about a prompt. For one prompt,
`kvsum.compress` asks it for a `Plan` over all layers (how the budget is spread, and whatever else it
decides across layers), then hands it one `LayerInput` per layer with that plan and stores the
`LayerState` it returns. The plan is passed on, never stored on the method, so one instance can
compress any number of prompts, interleaved or from several threads.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, NamedTuple

import torch
from torch import Tensor

from ..state import EntryState, LayerState

if TYPE_CHECKING:
    from ..shape import ModelShape


@dataclass
class LayerInput:
    """One layer of one prompt, as a method sees it. Tensors are float32 on the model's device."""

    keys: Tensor  # (H, T, d), post-RoPE
    values: Tensor  # (H, T, d)
    queries: Tensor | None  # (Hq, n, d) reference queries, post-RoPE (query head j uses KV head j // G)
    query_pos: Tensor | None  # (n,) prompt positions of the reference queries (each sees keys <= its position)
    scale: float
    layer_idx: int
    n_layers: int
    budget_bytes: float  # what this layer may hold
    storage: torch.dtype  # dtype of stored entries
    surprisal: Tensor | None = None  # (T,) -log p(token | prefix), +inf at position 0
    sentence_ends: Tensor | None = None  # (T,) bool, True at tokens that end a sentence (prefill(sentences=True))
    key_scores: Tensor | None = None  # (H, T) attention received while re-reading (prefill(repeat=True))
    rope: dict | None = None  # this layer's Llama-form RoPE {inv_freq, scaling}, for methods that un-rotate keys
    fingerprint: dict | None = None  # the model's kvsum.shape.fingerprint, for methods with per-model artifacts
    retrieval: Tensor | None = None  # (H,) each KV head's retrieval score (prefill(retrieval=True), kvsum.retrieval)

    @property
    def H(self) -> int:
        return self.keys.shape[0]

    @property
    def T(self) -> int:
        return self.keys.shape[1]

    @property
    def d(self) -> int:
        return self.keys.shape[2]

    def entry_bytes(self, bias: bool = False) -> int:
        """Bytes of one stored entry: key + value (+ a bias scalar)."""
        size = torch.empty(0, dtype=self.storage).element_size()
        return (2 * self.d + int(bias)) * size

    def entries_per_head(self, bias: bool = False) -> int:
        """Entries per head that fit the layer's budget, at most the prompt length."""
        return max(0, min(self.T, int(self.budget_bytes // (self.H * self.entry_bytes(bias)))))

    def keep(self, idx: list[Tensor], bias: list[Tensor] | None = None) -> EntryState:
        """An EntryState of the original entries at positions `idx[h]` for each head h."""
        keys = [self.keys[h, i] for h, i in enumerate(idx)]
        values = [self.values[h, i] for h, i in enumerate(idx)]
        return EntryState(keys, values, bias, dtype=self.storage)


@dataclass(frozen=True)
class Plan:
    """What a method decided across the layers of one prompt.

    `fractions[i]`: the share of input i's full 16-bit bytes that layer may hold (inputs in the order given
    to `Method.plan`). Methods that decide more across layers (bit shifts, head weights) subclass it with
    more fields, keyed by layer index."""

    fractions: tuple[float, ...]


class Choice(NamedTuple):
    """One configuration a method stands for: the built method, its name and knobs as a spec writes them, why."""

    method: Method
    name: str
    knobs: dict
    why: str


@dataclass(frozen=True)
class Method:
    """Base of every method config. Subclasses (frozen dataclasses too) set `name`, `summary` and implement
    `compress`; those that decide anything across layers override `plan`, and those whose layers depend on
    each other (a layer rebuilt from the previous one) override `compress_layers`."""

    name: ClassVar[str] = ""
    summary: ClassVar[str] = ""
    needs_queries: ClassVar[bool] = False  # whether compress reads LayerInput.queries
    composed_defaults: ClassVar[dict] = {}  # knob values a composition's part starts from unless given
    entry_bias: ClassVar[bool] = False  # compress's entries carry a log-mass bias (a composition codes them beside)

    def plan(self, inputs: list[LayerInput], budget: float) -> Plan:
        """This prompt's plan over its layers: the same fraction of every layer's bytes by default."""
        return Plan(tuple([budget] * len(inputs)))

    def compress(self, x: LayerInput, plan: Plan | None = None) -> LayerState:
        """The state of one layer within `x.budget_bytes`. Without a plan (a layer compressed alone) the
        method decides nothing across layers."""
        raise NotImplementedError

    def compress_layers(self, inputs: list[LayerInput], plan: Plan) -> list[LayerState]:
        """The states of all layers of one prompt, in order (budget_bytes already set from the plan)."""
        return [self.compress(x, plan) for x in inputs]

    def prefill_options(self) -> dict:
        """Extra signals this method needs from kvsum.prefill (e.g. {"repeat": True})."""
        return {}

    def choices(self, budget: float, tokens: int, sentences: bool, shape: ModelShape | None = None) -> list[Choice]:
        """The configurations this method stands for at `budget` on a `tokens`-token prompt (`sentences`: the
        prefill marks sentence ends; `shape`: the model's, None where unknown), best first; kvsum.compress takes
        the first that fits. A configured method stands for itself; `summary` with no knobs is configured by budget
        (summary/default.py)."""
        return [Choice(self, self.name, {}, "")]

    def stream(self, layer_idx: int, state: LayerState):
        """The decoding-time Stream (kvsum.cache.Stream) of layer `layer_idx` given its compressed state, or
        None (the default: generated tokens stay in the full-precision tail). kvsum.compress attaches it."""
        return None

    @classmethod
    def knobs(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]
