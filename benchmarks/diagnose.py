"""Diagnosis-only method variants, never registered with kvsum: `build` makes one by name (else kvsum's
make_method), for the benchmarks that run them (quant's "sides" rows, long_suite).

`turboquant_one_side`: TurboQuant with one side's codes read and the other side exact (held beside the codes and
counted); decoded tokens stay in full precision. It tells how much of a bit width's loss each side's codes cause.

`turboquant_rope_centered`: TurboQuant's rotated codes of each key less its head's pre-RoPE mean key turned to the
key's position (k - R_p mu), the mean's logit added back exactly when read. A key bias before RoPE (Qwen's k_proj
bias) turns with the position, so the post-RoPE mean (`center=True`) cannot remove it and the codes spend their
precision on it. The turned means are materialized and not counted, and decoded tokens stay in full precision: it
measures what the codes would copy, not what such a cache would cost. `shorter=True` takes the mean out only of the
keys it shortens, as `center=True` does after RoPE.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

import kvsum
from kvsum.methods import make_method
from kvsum.methods.quant.turboquant import TurboQuant
from kvsum.rope import RopeFrame
from kvsum.state import tensor_bytes


class OneSide:
    """A TurboQuant state attended with one side replaced by the exact tensor: `coded` names the side whose codes
    are read."""

    def __init__(self, state, exact, coded: str):
        self.state, self.exact, self.coded = state, exact, coded

    def lengths(self):
        return self.state.lengths()

    def nbytes(self):
        return self.state.nbytes() + tensor_bytes(self.exact)

    def scores(self, q, scale):
        return self.state.scores(q, scale) if self.coded == "keys" else q @ self.exact[None].transpose(-1, -2) * scale

    def mix(self, p):
        return self.state.mix(p) if self.coded == "values" else p @ self.exact[None]


@dataclass(frozen=True)
class TurboQuantOneSide(TurboQuant):
    """TurboQuant with one side's codes read, the other exact.

    Attributes:
        coded: the side whose codes are read ("keys" or "values"); the other side is kept exact.
    """

    name = "turboquant_one_side"
    coded: str = "keys"

    def __post_init__(self):
        super().__post_init__()
        if self.coded not in ("keys", "values"):
            raise kvsum.KVSumError(f"coded must be 'keys' or 'values', got {self.coded!r}")

    def build(self, keys, values, *args, **kwargs):
        state = super().build(keys, values, *args, **kwargs)
        return OneSide(state, values if self.coded == "keys" else keys, self.coded)

    def stream(self, *args, **kwargs):
        return None


class RopeCentered:
    """A layer's state of keys less `turned` (H, T, d), the pre-RoPE mean key at each coded key's position (zero at
    the exact ones), added back when read."""

    def __init__(self, state, turned, mean):
        self.state, self.turned, self.mean = state, turned, mean

    def lengths(self):
        return self.state.lengths()

    def nbytes(self):
        return self.state.nbytes() + tensor_bytes(self.mean.half())  # the fp16 pre-RoPE mean a head

    def scores(self, q, scale):
        return self.state.scores(q, scale) + q @ self.turned[None].transpose(-1, -2) * scale

    def mix(self, p):
        return self.state.mix(p)


@dataclass(frozen=True)
class TurboQuantRopeCentered(TurboQuant):
    """TurboQuant with each coded key's head mean taken out before RoPE (see the module docstring)."""

    name = "turboquant_rope_centered"
    shorter: bool = False  # take the mean out only of the keys it shortens (as center=True does after RoPE)

    def compress(self, x, plan=None):
        if x.rope is None:
            raise kvsum.KVSumError("turboquant_rope_centered needs the model's RoPE in the Llama form")
        first, last = self._exact(x.T)
        pos = torch.arange(x.T, device=x.keys.device)
        coded = ((pos >= first) & (pos < x.T - last))[None, :, None]  # the sinks and the window stay exact
        frame = RopeFrame(x.rope, 0, x.T, x.T)
        mean = frame.undo(x.keys, 0)[:, coded[0, :, 0]].mean(1, keepdim=True)  # (H, 1, d) before RoPE
        turned = frame.apply(mean.expand_as(x.keys)) * coded
        if self.shorter:
            turned = turned * ((x.keys - turned).norm(dim=-1, keepdim=True) < x.keys.norm(dim=-1, keepdim=True))
        return RopeCentered(super().compress(replace(x, keys=x.keys - turned), plan), turned, mean)

    def stream(self, *args, **kwargs):
        return None  # decoded tokens stay in the layer's exact tail


DIAGNOSES = {m.name: m for m in (TurboQuantOneSide, TurboQuantRopeCentered)}


def build(name: str, **knobs):
    """A method by name: a diagnosis variant here, else kvsum's make_method."""
    return DIAGNOSES[name](**knobs) if name in DIAGNOSES else make_method(name, **knobs)
