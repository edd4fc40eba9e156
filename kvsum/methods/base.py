"""The method protocol, the config base class and the registry.

A method is a small dataclass of knobs. `kvsum.compress` hands it one `LayerInput` per layer (the
prompt's keys and values, reference queries, a byte budget) and stores the `LayerState` it returns.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from ..errors import KVSumError
from ..state import EntryState, LayerState


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


REGISTRY: dict[str, type[Method]] = {}


def register(cls):
    """Class decorator: make a method available to kvsum.compress by its `name`."""
    if not (isinstance(cls, type) and issubclass(cls, Method)) or not isinstance(cls.name, str) or not cls.name:
        raise KVSumError(f"register takes a kvsum.Method subclass with a non-empty `name`, got {cls!r}")
    REGISTRY[cls.name] = cls
    return cls


@dataclass
class Method:
    """Base of every method config. Subclasses set `name`, `summary` and implement `compress`."""

    name: ClassVar[str] = ""
    summary: ClassVar[str] = ""
    needs_queries: ClassVar[bool] = False  # whether compress reads LayerInput.queries

    def compress(self, x: LayerInput) -> LayerState:
        raise NotImplementedError

    def prefill_options(self) -> dict:
        """Extra signals this method needs from kvsum.prefill (e.g. {"repeat": True})."""
        return {}

    def layer_budgets(self, inputs: list[LayerInput], budget: float) -> list[float]:
        """Fraction of each layer's full bytes it may hold; uniform by default."""
        return [budget] * len(inputs)

    def stream(self, layer_idx: int, state: LayerState):
        """The decoding-time Stream (kvsum.cache.Stream) of layer `layer_idx` given its compressed state, or
        None (the default: generated tokens stay in the full-precision tail). kvsum.compress attaches it."""
        return None

    @classmethod
    def knobs(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]


def prefill_needs(methods) -> dict:
    """The kvsum.prefill extras any of `methods` asks for (the union of their prefill_options), as keywords."""
    return {k: True for m in methods for k, v in m.prefill_options().items() if v}


def make_method(name: str, **knobs) -> Method:
    """Build a registered method from its name and keyword knobs, with clear errors for either.
    "a+b" composes a method with a quantizer (kvsum/methods/compose.py says how knobs are routed)."""
    if isinstance(name, str) and "+" in name:
        from .compose import compose

        return compose(name, **knobs)
    if name not in REGISTRY:
        raise KVSumError(f"unknown method {name!r}; accepted: {', '.join(sorted(REGISTRY))}")
    cls = REGISTRY[name]
    unknown = set(knobs) - set(cls.knobs())
    if unknown:
        raise KVSumError(f"method {name!r} has no knob {', '.join(sorted(unknown))}; "
                         f"accepted: {', '.join(cls.knobs()) or 'none'}")
    defaults = {f.name: f.default for f in dataclasses.fields(cls)}
    for knob, value in knobs.items():
        _check_knob(name, knob, value, defaults[knob])
    return cls(**knobs)


def _check_knob(method: str, knob: str, value, default) -> None:
    """A knob takes the type of its default (bool, int >= 0, float >= 0 and finite, str); None defaults take
    anything (the method checks them)."""
    if default is None or default is dataclasses.MISSING:
        return
    if isinstance(default, bool):
        ok, want = isinstance(value, bool), "True or False"
    elif isinstance(default, int):
        ok, want = isinstance(value, int) and not isinstance(value, bool) and value >= 0, "an integer >= 0"
    elif isinstance(default, float):
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value < float("inf")
        want = "a finite number >= 0"
    elif isinstance(default, str):
        ok, want = isinstance(value, str), "a string"
    else:
        return
    if not ok:
        raise KVSumError(f"{method}: {knob} must be {want}, got {value!r}")
