"""Diagnosis-only method variants, never registered with kvsum: `listed` makes them known to make_method for the
length of one benchmark run (the quantization "sides" rows), and `build` makes one directly.

`turboquant_one_side`: TurboQuant with one side's codes read and the other side exact (held beside the codes and
counted); decoded tokens stay in full precision. It tells how much of a bit width's loss each side's codes cause.
"""

from __future__ import annotations

from dataclasses import dataclass

import kvsum
from kvsum.methods import make_method
from kvsum.methods.quant.turboquant import TurboQuant
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


DIAGNOSES = {TurboQuantOneSide.name: TurboQuantOneSide}


def build(name: str, **knobs):
    """A method by name: a diagnosis variant here, else kvsum's make_method."""
    return DIAGNOSES[name](**knobs) if name in DIAGNOSES else make_method(name, **knobs)
