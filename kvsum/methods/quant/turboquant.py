"""TurboQuant (Zandieh et al., 2025): random rotation + per-coordinate Lloyd-Max codes + separate norms.

A random rotation makes every coordinate of a unit vector follow one known law, so one precomputed
codebook is near-optimal for any input (rotation.py); fractional rates give half of each head's rotated
channels one more bit (codes.py). With `qjl`, keys get one bit less of MSE codes plus a 1-bit QJL sketch of
the residual (qjl.py), which makes the attention logits unbiased (the MSE quantizer alone shrinks inner
products) but widens their error's spread; softmax attention minds the spread more than the bias, so it is
off by default (docs/results/quant.md). The state and its two attention paths are in state.py.

While decoding, generated tokens are coded `group` at a time into the same stores (QuantStream), with the
prompt's rotation, codebooks and outlier-channel split.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor

from ...errors import KVSumError
from ...rope import RopeFrame
from ...state import ConcatState
from ..base import LayerInput, Plan
from ..quantizer import KeyShiftPlan, Quantizer, key_shifts
from ..refusal import budget_hint
from ..registry import register
from .codes import coded_nbytes
from .packing import packed_nbytes, pick_bits
from .pca import KeyTransform
from .rotation import ROTATIONS, Rotation, gaussian, hadamard_fits
from .state import TurboQuantState
from .stream import QuantStream

SUPPORTED = (1, 1.5, 2, 2.5, 3, 3.5, 4)
PATHS = ("rotated", "dequant")
KEY_BASES = ("random", "pca")
UNBIASED = ("none", "values", "keys", "both")


@register
@dataclass(frozen=True)
class TurboQuant(Quantizer):
    """Rotated Lloyd-Max codes of keys and values, their fp16 norms counted in the budget.

    The rotation and the QJL matrix are seeded per layer and held in fp16 (or the rotation as d seeded signs
    with rotation="hadamard"), all counted in nbytes. Where a layer's budget cannot hold the dense rotation
    (few tokens beside a large head dim), the seeded-sign Hadamard rotation is used instead and the state's
    `note` says so.

    Attributes:
        bits: bits per coordinate on average over keys and values; None: the largest supported that fits.
        qjl: keys spend one of their bits on the QJL sketch of their residual (unbiased logits).
        seed: seeds every layer's rotation and QJL matrix (with the layer index).
        path: "rotated" (queries rotated once, codes read in place) or "dequant" (keys and values rebuilt).
        skew: bits moved from values to keys (both stay within 1..4): retrieval hinges on the keys' logits.
        group: decoding-time tokens are coded this many at a time.
        residual: decoding-time tokens kept in full precision before they are coded.
        sinks: the first prompt tokens kept exact (storage dtype, counted): attention sinks draw most mass.
        window: the last prompt tokens kept exact (storage dtype, counted).
        key_shift: key bits moved to the sharpest half of the layers from the most diffuse half (by entropy).
        key_basis: "random" (the rotation) or "pca": keys coded on each head's principal axes (pca.py).
        outliers: with pca, the share of each head's prompt tokens its codes serve worst, kept exact.
        center: keys coded less each head's prompt mean (fp16, counted), whose logit is exact, where that
            shortens them (the sign bit of each key's fp16 norm says which).
        rotation: "qr" (dense Haar-random, d*d*2 bytes a layer) or "hadamard" (seeded signs, d bytes).
        unbiased: sides ("values", "keys", "both") read with |x| / <y, y_hat>, undoing the codes' shrink.
        pre_rope: with pca, keys coded as before RoPE (un-rotated by position, the model's Llama-form RoPE).
    """

    name = "turboquant"
    summary = "random rotation + Lloyd-Max scalar codes, optional QJL residual (Zandieh et al., 2025)"
    needs_queries = True  # for key_shift (the layers' attention entropy) and key_basis="pca" (its weights)
    supported_bits = SUPPORTED
    default_bits = 3
    exact_knobs = ("sinks", "window")
    position_knobs = ("pre_rope",)
    composed_defaults = {"key_shift": 0}  # in a composition the key shift is off unless asked for

    bits: float | None = None
    qjl: bool = False
    seed: int = 0
    path: str = "rotated"
    skew: float = 0.5
    group: int = 32
    residual: int = 0
    sinks: int = 4
    window: int = 0
    key_shift: int = 1
    key_basis: str = "random"
    outliers: float = 0.0
    center: bool = False
    rotation: str = "qr"
    unbiased: str = "none"
    pre_rope: bool = False

    def __post_init__(self):
        if self.rotation not in ROTATIONS:
            raise KVSumError(f"turboquant: rotation={self.rotation!r}; accepted: {', '.join(ROTATIONS)}")
        if self.key_basis not in KEY_BASES:
            raise KVSumError(f"turboquant: key_basis={self.key_basis!r}; accepted: {', '.join(KEY_BASES)}")
        if self.key_basis == "pca" and self.qjl:
            raise KVSumError("turboquant: key_basis='pca' codes keys without QJL; pick one")
        if not 0 <= self.outliers < 1 or (self.outliers and self.key_basis != "pca"):
            raise KVSumError(f"turboquant: outliers={self.outliers} must be in [0, 1), with key_basis='pca' (the "
                             "tokens its transform codes serve worst are kept exact)")
        if self.pre_rope and self.key_basis != "pca":
            raise KVSumError("turboquant: pre_rope codes pca keys before RoPE; it needs key_basis='pca'")
        own_keys = self.qjl or self.key_basis == "pca"  # the keys' own unbiasing / coding
        if self.unbiased not in UNBIASED or (own_keys and self.unbiased in ("keys", "both")):
            raise KVSumError(f"turboquant: unbiased={self.unbiased!r}; accepted: {', '.join(UNBIASED)} (not the keys "
                             "with qjl, whose sketch unbiases them, or with key_basis='pca', which codes them itself)")
        if self.path not in PATHS:
            raise KVSumError(f"turboquant: path={self.path!r}; accepted: {', '.join(PATHS)}")
        if self.group < 1 or self.residual < 0:
            raise KVSumError(f"turboquant: need group >= 1 and residual >= 0, got group={self.group}, "
                             f"residual={self.residual}")

    # capabilities (kvsum/methods/quantizer.py)

    def supported(self) -> tuple:
        """The widths in SUPPORTED that leave the keys at least 1 bit of MSE codes (after skew and QJL)."""
        return tuple(b for b in SUPPORTED if self._key_bits(b) - self.qjl >= 1)

    @property
    def shifts_layers(self) -> bool:
        """Key bits move between layers by attention entropy; pca's allocation follows the queries within each
        layer instead."""
        return bool(self.key_shift) and self.key_basis == "random"

    def key_shifts(self, diffuseness: dict[int, float]) -> dict[int, int]:
        return key_shifts(diffuseness, self.key_shift) if self.shifts_layers else {}

    def lighter(self, d: int) -> TurboQuant | None:
        """The seeded-sign Hadamard rotation (d bytes) in place of the dense one, where d is a power of 2."""
        return dataclasses.replace(self, rotation="hadamard") if self.rotation == "qr" and hadamard_fits(d) else None

    def lighter_note(self) -> str:
        return "rotation='hadamard': the dense rotation did not fit the budget"

    def basis_queries(self, x: LayerInput) -> Tensor | None:
        """Each KV head's reference queries (H, n * G, d), which key_basis="pca" weights its axes by."""
        return x.queries.reshape(x.H, -1, x.d) if self.key_basis == "pca" and x.queries is not None else None

    def placed(self, x: LayerInput, first: int, last: int) -> dict:
        """With pre_rope, the frame of the coded tokens' positions (decoded keys: from the prompt's length on)."""
        if not self.pre_rope:
            return {}
        if x.rope is None:
            raise KVSumError("turboquant: pre_rope un-rotates keys by the model's RoPE, which kvsum reads only "
                             "in the Llama form (rotary_emb with inv_freq); this model's is not; drop pre_rope")
        return {"frame": RopeFrame(x.rope, first, x.T - first - last, x.T)}

    # widths and bytes

    def _key_bits(self, bits: float) -> float:
        """Keys get up to `skew` more than `bits`, as long as neither keys nor values leave 1..4 bits."""
        return max(bits, min(bits + self.skew, 4, 2 * bits - 1))

    def widths(self, bits: float, shift: int = 0) -> tuple[float, float]:
        """(keys' MSE code width, values' width), `bits` on average; with QJL one of the keys' bits goes to
        the sketch; `shift` more key bits in this layer (less where negative; 0 where either side would leave
        1..8 bits)."""
        k = self._key_bits(bits) - self.qjl
        if k < 1:
            raise KVSumError(f"turboquant: bits={bits} leaves the keys {k} bits of MSE codes with QJL")
        if not (1 <= k - abs(shift) and k + abs(shift) <= 8):
            shift = 0
        return k + shift, 2 * bits - k - self.qjl

    def nbytes(self, H: int, T: int, d: int, bits: float, *, shift: int = 0,
               storage: torch.dtype = torch.float16) -> int:
        """Exactly what a state of (H, T, d) keys and values at `bits` (keys shifted by `shift`) holds (at most
        that with key_basis="pca"); `storage` is not read (nothing is exact inside the state)."""
        n = sum(coded_nbytes(H, T, d, w) for w in self.widths(bits, shift))
        n += 2 * H * T * 2 + Rotation.planned_nbytes(d, self.rotation)  # fp16 norms
        if self.qjl:
            n += packed_nbytes(H * T * d, 1) + H * T * 2 + d * d * 2  # sign bits, fp16 |r|, fp16 S
        if self.center and self.key_basis == "random":
            n += H * d * 2 + H * 2  # fp16 mean keys and shrink a head (which keys were coded less the mean: the
            # sign bits of their fp16 norms)
        return n

    def charged_nbytes(self, H: int, T: int, d: int, bits: float, *, shift: int = 0,
                       storage: torch.dtype = torch.float16) -> int:
        """The mean of a widened and a narrowed layer's bytes, so that the layers' budgets add up while their
        states differ."""
        return (self.nbytes(H, T, d, bits, shift=abs(shift)) + self.nbytes(H, T, d, bits, shift=-abs(shift))) // 2

    def build(self, keys: Tensor, values: Tensor, bits: float, *, layer_idx: int = 0, shift: int = 0,
              storage: torch.dtype = torch.float16, decoded: bool = False, queries: Tensor | None = None,
              frame: RopeFrame | None = None, note: str = "") -> TurboQuantState:
        """The state of keys and values (H, T, d) fp32 at `bits` (keys shifted by `shift` bits), with layer
        `layer_idx`'s rotation (every token coded: `storage` and `decoded` change nothing); with
        key_basis="pca", keys get the bytes random-rotation keys and their norms would hold, as transform codes
        weighted by `queries` (H, M, d) (uniformly without), before RoPE at the keys' positions in `frame` with
        `pre_rope`."""
        if self.pre_rope and frame is None:
            raise KVSumError("turboquant: pre_rope needs the keys' positions and the model's RoPE (a RopeFrame)")
        seed = self.seed * 1_000_003 + 2 * layer_idx
        R = Rotation(keys.shape[-1], seed, self.rotation, keys.device)
        S = gaussian(keys.shape[-1], seed + 1).to(torch.float16).to(keys.device) if self.qjl else None
        widths, kt = self.widths(bits, shift), None
        if self.key_basis == "pca":
            H, T, d = keys.shape
            head_bytes = (coded_nbytes(H, T, d, widths[0]) + H * T * 2) // H  # what the codes and fp16 norms take
            kt = KeyTransform(keys, queries, head_bytes, self.outliers, frame)  # the state never sees the queries
        return TurboQuantState(keys, values, bits, self.qjl, R, S, self.path, widths, self.center, kt, self.unbiased,
                               note)

    # the method

    def _exact(self, T: int) -> tuple[int, int]:
        """(first, last) prompt tokens kept exact: the attention sinks and the newest window."""
        first = min(self.sinks, T)
        return first, min(self.window, T - first)

    def compress(self, x: LayerInput, plan: Plan | None = None) -> TurboQuantState | ConcatState:
        full = 2 * x.H * x.T * x.d * 2
        first, last = self._exact(x.T)
        n_q, exact = x.T - first - last, (first + last) * x.H * x.entry_bytes()
        shift = plan.shift(x.layer_idx) if isinstance(plan, KeyShiftPlan) else 0
        if n_q == 0:  # every prompt token is an exact sink or in the window: nothing to code
            if exact > x.budget_bytes:
                raise KVSumError(f"turboquant: the {x.T} prompt tokens are all kept exact (sinks={self.sinks}, "
                                 f"window={self.window}) and need {exact / full:.3f} of the full cache, more than "
                                 f"the budget {x.budget_bytes / full:.3f}; {budget_hint(exact, full)}")
            return x.keep([torch.arange(x.T, device=x.keys.device)] * x.H)
        quant, note = self._fitting(x, n_q, exact, shift)
        every = x.T * x.H * x.entry_bytes()  # all prompt tokens exact: what a layer whose codes do not fit can hold
        if not quant._fits(x, n_q, exact, shift) and every <= x.budget_bytes and quant.bits in (None, *SUPPORTED):
            state = x.keep([torch.arange(x.T, device=x.keys.device)] * x.H)
            state.note = "every prompt token exact: the codes' fixed costs do not fit the budget"
            return state
        name = "turboquant" + (" with qjl" if self.qjl else "")
        ceiling = every  # what the smallest budget that fits holds: all exact, or the lighter rotation's codes
        if quant is not self and not quant._fits(x, n_q, exact, shift):  # neither fits: say what the configured needs
            quant, light = self, quant
            low = self.bits if self.bits is not None else min(self.supported())
            ceiling = min(every, light.charged_nbytes(x.H, n_q, x.d, low, shift=shift) + exact)
        bits = pick_bits(name, quant.bits, quant.supported(),
                         lambda b: quant.charged_nbytes(x.H, n_q, x.d, b, shift=shift) + exact, x.budget_bytes, full,
                         quant._rotation_hint(x.d, full, self.lighter(x.d) is not None), ceiling=ceiling)
        coded = quant.build(x.keys[:, first:x.T - last], x.values[:, first:x.T - last], bits, layer_idx=x.layer_idx,
                            shift=shift, queries=quant.basis_queries(x), note=note, **quant.placed(x, first, last))
        if not first + last:
            return coded
        exact = [x.keep([torch.arange(a, b, device=x.keys.device)] * x.H) if b > a else None
                 for a, b in ((0, first), (x.T - last, x.T))]
        state = ConcatState([exact[0], coded, exact[1]])  # in position order
        state.note = note
        return state

    def _fits(self, x: LayerInput, n_q: int, exact: int, shift: int) -> bool:
        """Whether a width this configuration may pick fits the layer's budget."""
        widths = self.supported() if self.bits is None else [self.bits] if self.bits in self.supported() else []
        return any(self.charged_nbytes(x.H, n_q, x.d, b, shift=shift) + exact <= x.budget_bytes for b in widths)

    def _fitting(self, x: LayerInput, n_q: int, exact: int, shift: int) -> tuple[TurboQuant, str]:
        """This quantizer, or its lighter rotation where no width fits the budget with the dense one (with the
        note that says so)."""
        light = self.lighter(x.d)
        if light is None or self._fits(x, n_q, exact, shift):
            return self, ""
        return light, self.lighter_note()

    def _rotation_hint(self, d: int, full_bytes: float, light: bool) -> str:
        """For a refusal: what the dense rotation takes of the layer, where that is worth saying (>= 1%), and
        whether the lighter Hadamard rotation was tried (`light`)."""
        share = Rotation.planned_nbytes(d, self.rotation) / full_bytes
        if self.rotation != "qr" or share < 0.01:
            return ""
        why = "the Hadamard rotation does not fit either" if light else f"head dim {d} has no Hadamard rotation"
        return f"; its dense fp16 rotation alone takes {share:.3f} of the layer ({why})"

    def stream(self, layer_idx: int, state) -> QuantStream | None:
        if isinstance(state, ConcatState):  # exact sinks/window beside the codes: decoded tokens join the codes
            state = next((p for p in state.parts if isinstance(p, TurboQuantState)), None)
        return QuantStream(self.group, self.residual, live=state) if isinstance(state, TurboQuantState) else None
