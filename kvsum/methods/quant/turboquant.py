"""TurboQuant (Zandieh et al., 2025): random rotation + per-coordinate Lloyd-Max codes + separate norms.

A random rotation makes every coordinate of a unit vector follow one known law, so one precomputed
codebook is near-optimal for any input. Fractional rates (2.5, 3.5 bits) give half of each head's
rotated channels one more bit: those with the largest RMS in this layer's own data. With `qjl`, keys get
one bit less of MSE codes plus a 1-bit QJL sketch of the residual, which makes the attention logits
unbiased (the MSE quantizer alone shrinks inner products) but about doubles their error's spread; softmax
attention minds the spread more than the bias, so it is off by default (see the README's quantization results).

Two attention paths hold the same codes and give the same numbers: `dequant` rebuilds keys and values
in the original basis; `rotated` rotates the queries once, scores them against codebook lookups in the
rotated basis and rotates the mixed values back once.

While decoding, generated tokens are coded `group` at a time into the same stores (QuantStream), with the
prompt's rotation, codebooks and outlier-channel split.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
import scipy.linalg
import torch
from torch import Tensor

from ...errors import KVSumError
from ...state import ConcatState, tensor_bytes
from ..base import LayerInput, Method, register
from ..summary.fit import head_diffuseness
from . import native
from .codebook import codebook, encode
from .packing import Packed, packed_nbytes, pick_bits
from .pca import KeyTransform, RopeFrame
from .stream import QuantStream

SUPPORTED = (1, 2, 2.5, 3, 3.5, 4)
PATHS = ("rotated", "dequant")
KEY_BASES = ("random", "pca")
ROTATIONS = ("qr", "hadamard")
UNBIASED = ("none", "values", "keys", "both")


def gaussian(d: int, seed: int) -> Tensor:
    return torch.randn(d, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def rotation(d: int, seed: int) -> Tensor:
    """A Haar-random orthogonal (d, d) matrix (float64): QR of a Gaussian, signs fixed by R's diagonal.
    (numpy's QR: torch.linalg.qr takes milliseconds even on tiny CPU matrices.)"""
    q, r = np.linalg.qr(gaussian(d, seed).numpy())
    return torch.from_numpy(q * np.sign(np.diagonal(r)))


@functools.lru_cache(maxsize=8)
def _hadamard(d: int, device: str) -> Tensor:
    """The Sylvester Hadamard matrix over sqrt(d) (orthogonal, symmetric), one per head dim per process."""
    return torch.from_numpy(scipy.linalg.hadamard(d) / math.sqrt(d)).float().to(device)


class Rotation:
    """x -> x R^T (`apply`) and back (`undo`), R orthogonal and seeded. "qr": Haar-random R held in fp16 (d*d*2
    bytes per layer). "hadamard": R = H diag(s) / sqrt(d), the Sylvester Hadamard matrix H shared by every layer
    (a constant, like the codebooks) and d seeded signs s per layer (d bytes): at head dim 256 with one KV head
    (Gemma 3) a dense R costs 6% of a 2k-token layer's 16-bit bytes, the signs 0.01%. Needs d a power of 2."""

    def __init__(self, d: int, seed: int, kind: str, device):
        self.R = self.signs = None
        if kind == "qr":
            self.R = rotation(d, seed).to(torch.float16).to(device)
        elif d & (d - 1):
            raise KVSumError(f"turboquant: rotation='hadamard' needs a power-of-2 head dim, got {d}; use 'qr'")
        else:
            g = torch.Generator().manual_seed(seed)
            self.signs = (torch.randint(0, 2, (d,), generator=g) * 2 - 1).to(torch.int8).to(device)

    def apply(self, x: Tensor) -> Tensor:
        if self.R is not None:
            return x @ self.R.float().t()
        return (x * self.signs) @ _hadamard(x.shape[-1], str(x.device))  # H symmetric: H^T = H

    def undo(self, y: Tensor) -> Tensor:
        if self.R is not None:
            return y @ self.R.float()
        return (y @ _hadamard(y.shape[-1], str(y.device))) * self.signs

    def nbytes(self) -> int:
        return tensor_bytes(self.R, self.signs)

    @staticmethod
    def planned_nbytes(d: int, kind: str) -> int:
        """What `nbytes` will be, before the rotation is built (for budget planning)."""
        return d * d * 2 if kind == "qr" else d


def _split(bits: float, d: int) -> tuple[int, int]:
    """(low bit width, channels at low + 1 bits) so that the average over d channels is exactly `bits`."""
    lo = math.floor(bits)
    n_hi = (bits - lo) * d
    if n_hi != int(n_hi):
        raise KVSumError(f"turboquant: {bits} bits cannot be split exactly over head dim {d}")
    return lo, int(n_hi)


def _idx_dtype(d: int) -> torch.dtype:
    return torch.uint8 if d <= 256 else torch.int16


class Coded:
    """Lloyd-Max codes of rotated unit directions (H, T, d): channels `idx_hi` of each head at lo + 1 bits
    (the largest RMS in `y`, the data it is built for), the others at lo bits. It holds no tokens until
    `extend` codes them. Codes are held token-major (T, H, c), so decoding-time tokens append to the same packed
    store with the same channel split."""

    def __init__(self, y: Tensor, bits: float):
        H, T, d = y.shape
        lo, n_hi = _split(bits, d)
        self.H, self.T, self.d = H, 0, d
        if n_hi:
            order = y.pow(2).mean(1).argsort(-1, descending=True)  # (H, d): channels by RMS
            idx = [order[:, :n_hi].sort(-1).values.to(_idx_dtype(d)), order[:, n_hi:].sort(-1).values.to(_idx_dtype(d))]
            widths = [lo + 1, lo]
        else:
            idx, widths = [None], [lo]
        self.parts = [[ix, codebook(width, d, y.device), width, None] for ix, width in zip(idx, widths)]

    def extend(self, y: Tensor) -> Tensor:
        """Encode directions y (H, n, d) after the current ones; returns their reconstruction (H, n, d)."""
        H, n, d = y.shape
        out = torch.empty_like(y) if self.parts[0][0] is not None else None
        for part in self.parts:
            ix, levels, width, codes = part
            sub = y if ix is None else y.gather(2, ix.long()[:, None, :].expand(H, n, -1))
            c = encode(sub, levels)
            if codes is None:
                part[3] = Packed(c.transpose(0, 1), width, tuple(levels.tolist()))
            else:
                codes.append(c.transpose(0, 1))
            if ix is None:
                out = levels[c.long()]
            else:
                out.scatter_(2, ix.long()[:, None, :].expand(H, n, -1), levels[c.long()])
        self.T += n
        return out

    @staticmethod
    def _levels(levels: Tensor, codes: Packed) -> Tensor:
        return codes.lookup().transpose(0, 1)  # (T, H, c) -> (H, T, c)

    def lookup(self) -> Tensor:
        """Reconstructed rotated unit directions (H, T, d)."""
        ix, levels, _, codes = self.parts[0]
        if ix is None:
            return self._levels(levels, codes)
        out = torch.empty(self.H, self.T, self.d, device=levels.device)
        for ix, levels, _, codes in self.parts:
            out.scatter_(2, ix.long()[:, None, :].expand(self.H, self.T, -1), self._levels(levels, codes))
        return out

    def _native(self, rows: int) -> list | None:
        """The parts as native.py takes them, where its kernel serves them."""
        parts = [(codes, ix, levels) for ix, levels, _, codes in self.parts]
        return parts if native.usable(parts, rows) else None

    def dot(self, qr: Tensor, norm: Tensor, scale: float, add: Tensor | None = None,
            runs: Tensor | None = None) -> Tensor:
        """Rotated queries qr (1, H, M, d) against the reconstructed directions times `norm` (H, T) and `scale`
        -> (1, H, M, T); read from the packed codes by native.py's kernel where it serves. `add` and `runs`
        (kernel only, see native.score): one head's tokens read in runs, one per query head, plus `add`."""
        parts = self._native(qr.shape[2])
        if parts is not None:
            return native.score(parts, qr[0], norm, scale, add, runs)[None]
        if runs is not None:
            raise KVSumError("turboquant: codes are read in runs only through the packed-code kernel")
        s = 0
        for ix, levels, _, codes in self.parts:
            part = qr if ix is None else qr.gather(3, ix.long()[None, :, None, :].expand(*qr.shape[:3], -1))
            s = s + part @ self._levels(levels, codes).transpose(-1, -2)
        return s * (norm.float()[None, :, None, :] * scale)

    def mix(self, pw: Tensor, norm: Tensor, runs: Tensor | None = None) -> Tensor:
        """Weights pw (1, H, M, T) over the reconstructed directions times `norm` (H, T) -> (1, H, M, d), one
        channel part at a time (the split is undone on the small output, never on an (H, T, d) tensor)."""
        parts = self._native(pw.shape[2])
        if parts is not None:
            return native.mix(parts, pw[0], norm, self.d, runs)[None]
        if runs is not None:
            raise KVSumError("turboquant: codes are read in runs only through the packed-code kernel")
        pw = pw * norm.float()[None, :, None, :]
        if self.parts[0][0] is None:
            _, levels, _, codes = self.parts[0]
            return pw @ self._levels(levels, codes)
        out = pw.new_empty(*pw.shape[:3], self.d)
        for ix, levels, _, codes in self.parts:
            out.scatter_(3, ix.long()[None, :, None, :].expand(*pw.shape[:3], -1), pw @ self._levels(levels, codes))
        return out

    def nbytes(self) -> int:
        return sum(tensor_bytes(ix, levels) + codes.nbytes() for ix, levels, _, codes in self.parts)


def coded_nbytes(H: int, T: int, d: int, bits: float) -> int:
    lo, n_hi = _split(bits, d)
    n = packed_nbytes(H * T * (d - n_hi), lo) + 4 * 2 ** lo
    if n_hi:
        n += packed_nbytes(H * T * n_hi, lo + 1) + 4 * 2 ** (lo + 1) + H * d * _idx_dtype(d).itemsize
    return n


def _after(held: Tensor | None, new: Tensor) -> Tensor:
    """Per-token side data (H, n) appended after what a state holds (H, T), or `new` where it holds none yet."""
    return new if held is None else torch.cat([held, new], 1)


def qjl_encode(r: Tensor, S: Tensor) -> tuple[Tensor, Tensor]:
    """1-bit sketch of residuals r (..., d): sign(S r) as bools and |r|."""
    return (r @ S.t()) >= 0, r.norm(dim=-1)


def qjl_estimate(q: Tensor, signs: Tensor, r_norm: Tensor, S: Tensor) -> Tensor:
    """Unbiased estimate of <q, r> from the sketch: sqrt(pi/2) / m |r| <S q, sign(S r)>; q (..., M, d),
    signs (..., T, m) -> (..., M, T)."""
    pm = signs.float() * 2 - 1
    return math.sqrt(math.pi / 2) / S.shape[0] * (q @ S.t()) @ pm.transpose(-1, -2) * r_norm.unsqueeze(-2)


def key_shifts(diffuseness: dict[int, float], shift: int) -> dict[int, int]:
    """Layer index -> key bits moved to it: +shift for the sharpest half of the layers (lowest attention
    entropy), -shift for the most diffuse half; with an odd count the median layer keeps its width."""
    order = sorted(diffuseness, key=diffuseness.get)
    n = len(order) // 2
    return {i: shift * ((rank < n) - (rank >= len(order) - n)) for rank, i in enumerate(order)}


class TurboQuantState:
    """A layer's keys and values as rotated Lloyd-Max codes, fp16 norms (and a QJL sketch of the key residuals).

    With `center`, each head's mean prompt key (fp16) is subtracted before coding and its logit added back
    exactly: the mean holds about half of a key's energy in SmolLM2 and a code's error scales with the norm it
    codes, so the logit error halves. (Values are not centered: their mean is pulled by a few large tokens, and
    centering them made attention outputs worse in a third of SmolLM2's layers.) A prebuilt `key_codes` (pca's
    KeyTransform, centered itself) replaces the key codes. `extend` quantizes decoding-time tokens into the
    same stores (same rotation, codebooks, channel split, mean)."""

    def __init__(self, keys: Tensor, values: Tensor, bits: float, qjl: bool, R: Rotation, S: Tensor | None,
                 path: str, widths: tuple[float, float], center: bool = False, key_codes: KeyTransform | None = None,
                 unbiased: str = "none"):
        self.H, _, self.d = keys.shape
        self.unbiased = unbiased
        self.bits, self.qjl, self.path, self.R, self.S = bits, qjl, path, R, S
        self.widths = widths  # (keys' MSE code width, values'), TurboQuant.widths(bits)
        self.T = 0
        self.k = key_codes
        self.v = self.k_norm = self.v_norm = self.signs = self.r_norm = None
        self.k_mean = keys.mean(1, keepdim=True).half() if center and key_codes is None else None  # (H, 1, d)
        self.extend(keys, values)

    def pending(self) -> int:
        """Tokens held in full precision, waiting for a group (none: every token is coded at once)."""
        return 0

    def extend(self, keys: Tensor, values: Tensor, quantize: int | None = None) -> None:
        """Append keys and values (H, n, d), all quantized (`quantize`, if given, must be n)."""
        n = keys.shape[1]
        if quantize is not None and quantize != n:
            raise ValueError("turboquant quantizes every appended token")
        yv, v_norm = self._directions(values)
        self.T += n
        first = self.v is None
        if first:
            self.v = Coded(yv, self.widths[1])
        v_norm = self._gain(v_norm, yv, self.v.extend(yv), "values")
        self.v_norm = _after(self.v_norm, v_norm)
        if isinstance(self.k, KeyTransform):
            if not first:  # the prompt's keys were coded when the transform was built
                self.k.extend(keys)
            return
        if self.k_mean is not None:
            keys = keys - self.k_mean.float()
        yk, k_norm = self._directions(keys)
        if first:
            self.k = Coded(yk, self.widths[0])
        k_hat = self.k.extend(yk)
        k_norm = self._gain(k_norm, yk, k_hat, "keys")
        self.k_norm = _after(self.k_norm, k_norm)
        if self.qjl:
            resid = self.R.apply(keys) - k_norm.float()[..., None] * k_hat  # in the rotated basis
            signs, r_norm = qjl_encode(resid, self.S.float())
            signs = signs.transpose(0, 1)  # token-major, as the codes
            if self.signs is None:
                self.signs = Packed(signs, 1)
            else:
                self.signs.append(signs)
            self.r_norm = _after(self.r_norm, r_norm.half())

    def _directions(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Rotated unit directions and fp32 norms of x (H, n, d)."""
        norm = x.norm(dim=-1)
        return self.R.apply(x / norm.clamp_min(1e-30)[..., None]), norm

    def _gain(self, norm: Tensor, y: Tensor, y_hat: Tensor, side: str) -> Tensor:
        """The fp16 scale a side's codes are read with: the norm, or with `unbiased` naming this side the norm
        over <y, y_hat>, which makes the reconstruction's projection on the true direction exact."""
        if self.unbiased in ("both", side):
            norm = norm / (y * y_hat).sum(-1).clamp_min(0.05)
        return norm.half()

    def lengths(self) -> list[int]:
        return [self.T] * self.H

    def nbytes(self) -> int:
        n = self.k.nbytes() + self.v.nbytes() + self.R.nbytes() + tensor_bytes(self.k_norm, self.v_norm, self.S,
                                                                               self.r_norm, self.k_mean)
        return n + (self.signs.nbytes() if self.signs is not None else 0)

    def _signs(self) -> Tensor:
        return self.signs.codes().transpose(0, 1)  # (H, T, m)

    def _qjl_keys(self) -> Tensor:
        """The QJL correction of the keys in the rotated basis: sqrt(pi/2) / m |r| S^T sign(S r)."""
        pm = self._signs().float() * 2 - 1
        return math.sqrt(math.pi / 2) / self.S.shape[0] * self.r_norm.float()[..., None] * (pm @ self.S.float())

    def keys(self) -> Tensor:
        """Dequantized keys (H, T, d) in the original basis."""
        if isinstance(self.k, KeyTransform):
            return self.k.keys()
        k = self.k_norm.float()[..., None] * self.k.lookup()
        if self.signs is not None:
            k = k + self._qjl_keys()
        k = self.R.undo(k)
        return k if self.k_mean is None else k + self.k_mean.float()

    def values(self) -> Tensor:
        return self.R.undo(self.v_norm.float()[..., None] * self.v.lookup())

    def scores(self, q: Tensor, scale: float) -> Tensor:
        if self.path == "dequant":
            return q @ self.keys().transpose(-1, -2) * scale
        if isinstance(self.k, KeyTransform):
            return self.k.scores(q) * scale
        if self.signs is None:  # the scale inside the codes' pass (the kernel's, where it serves)
            return self._code_logits(q, scale)
        qr = self.R.apply(q)
        s = self.k.dot(qr, self.k_norm, 1.0) + qjl_estimate(qr, self._signs().bool(), self.r_norm.float(),
                                                             self.S.float())
        if self.k_mean is not None:
            s = s + q @ self.k_mean.float().transpose(1, 2)
        return s * scale

    def mix(self, p: Tensor) -> Tensor:
        if self.path == "dequant":
            return p @ self.values()
        return self.R.undo(self.v.mix(p, self.v_norm))

    def serves_runs(self, rows: int) -> bool:
        """Whether `run_scores` and `run_mix` serve `rows` query rows per head: the rotated path, MSE codes only
        (no QJL sketch, no pca keys), both sides through the packed-code kernel."""
        return (self.path == "rotated" and self.signs is None and isinstance(self.k, Coded)
                and self.k._native(rows) is not None and self.v._native(rows) is not None)

    def run_scores(self, q: Tensor, scale: float, bias: Tensor | None, runs: Tensor) -> Tensor:
        """A store of one head holding H heads' entries one run after another (composition's ragged heads):
        queries q (1, H, M, d) of head h against run h only, (1, H, M, longest run), -inf past each run's end;
        `bias` (T,) is added to each entry's logit. Each code is decoded once, for its own head's M rows."""
        return self._code_logits(q, scale, add=bias, runs=runs)

    def _code_logits(self, q: Tensor, scale: float, **read) -> Tensor:
        """Queries q (1, H, M, d) against the MSE key codes, times `scale`, read as Coded.dot's `read` keywords
        say; plus the centered keys' mean logit, exact and the same for every token (-inf stays -inf)."""
        s = self.k.dot(self.R.apply(q), self.k_norm, scale, **read)
        if self.k_mean is not None:
            s += q @ self.k_mean.float().transpose(1, 2) * scale
        return s

    def run_mix(self, p: Tensor, runs: Tensor) -> Tensor:
        """Weights p (1, H, M, longest run) over each head's run -> (1, H, M, d), as `run_scores` reads them."""
        return self.R.undo(self.v.mix(p, self.v_norm, runs))


@register
@dataclass
class TurboQuant(Method):
    """`bits` per coordinate on average over keys and values (None: the largest in SUPPORTED that fits the
    budget); with `qjl` keys spend one of them on the QJL sketch. The rotation and the QJL matrix are held in
    fp16 and counted in nbytes. `skew` moves bits from values to keys (3.5 bits, skew 0.5: keys at 4, values
    at 3; both stay within 1..4): retrieval hinges on the keys' logits. During decoding, generated tokens are
    quantized `group` at a time once more than `residual` + `group` of them are held in full precision. The
    first `sinks` and the last `window` prompt tokens stay exact (in the storage dtype, counted in the budget):
    attention sinks draw most of the mass, so their code error moves every logit. `key_shift` moves key bits
    between layers by attention entropy (the prompt's reference queries): the sharpest half of the layers gets
    keys `key_shift` bits wider, the most diffuse half as much narrower, so the average is unchanged. A sharp
    head picks one key among thousands, and code noise on every distractor's logit is what flips it.
    `key_basis="pca"` codes keys on each head's own principal axes instead, with bits spread over the axes
    by the reference queries (pca.py), in the bytes the random-rotation keys and their norms would take;
    values keep the rotation. Its allocation follows the queries within each layer, so the key shift is off.
    `outliers` (pca only): that fraction of each head's prompt tokens, the ones its codes serve worst, is kept
    exact inside the same key bytes. `pre_rope` (pca only) codes the keys as they were before RoPE, un-rotated
    by position (the model's own RoPE, Llama form), where a head's keys keep the correlations RoPE smears out.
    `center` codes each head's keys less their prompt mean (fp16, counted),
    whose logit is exact (pca keys are centered anyway). `rotation="hadamard"` replaces each layer's dense
    random rotation (fp16, d*d*2 bytes) by a seeded-sign Hadamard transform (d bytes): the better choice where
    the head dim is large beside the KV heads' tokens (see Rotation). `unbiased` names the sides ("values",
    "keys", "both") whose codes are read with |x| / <y, y_hat> instead of |x| (the same fp16 scale): Lloyd-Max
    codes shrink each vector by about their distortion (12% at 2 bits), an attention average keeps that shrink
    while part of the code noise averages out, so unbiased values cut the output error; unbiased keys undo the
    logits' shrink at the price of more noise (at 2.5 bits on SmolLM2: a little better retrieval, higher KL)."""

    name = "turboquant"
    summary = "random rotation + Lloyd-Max scalar codes, optional QJL residual (Zandieh et al., 2025)"
    needs_queries = True  # for key_shift (the layers' attention entropy) and key_basis="pca" (its weights)
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
        self._shift = {}  # layer index -> key bits moved to it (layer_budgets fills it per prompt)
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

    def _exact(self, T: int) -> tuple[int, int]:
        """(first, last) prompt tokens kept exact: the attention sinks and the newest window."""
        first = min(self.sinks, T)
        return first, min(self.window, T - first)

    def supported(self) -> list:
        """The widths in SUPPORTED that leave the keys at least 1 bit of MSE codes (after skew and QJL)."""
        return [b for b in SUPPORTED if self._key_bits(b) - self.qjl >= 1]

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

    def rotation_hint(self, d: int, full_bytes: float, knob: str = "rotation") -> str:
        """For a refusal: what the dense rotation takes of the layer, where that is worth saying (>= 1%)."""
        share = Rotation.planned_nbytes(d, self.rotation) / full_bytes
        if self.rotation != "qr" or share < 0.01:
            return ""
        return f"; its dense fp16 rotation alone takes {share:.3f} of the layer, {knob}='hadamard' holds it in d bytes"

    def shifts_layers(self) -> bool:
        """Whether key bits move between layers by attention entropy: pca's allocation follows the queries
        within each layer instead."""
        return bool(self.key_shift) and self.key_basis == "random"

    def layer_shift(self, layer_idx: int) -> int:
        """Key bits moved to this layer by the last `layer_budgets` (0 without the key shift)."""
        return self._shift.get(layer_idx, 0)

    def layer_budgets(self, inputs: list[LayerInput], budget: float) -> list[float]:
        """Equal bytes per layer; ranks the layers by attention entropy for `key_shift` (see the class)."""
        self._shift = {}
        if self.shifts_layers() and all(x.queries is not None for x in inputs):
            self._shift = key_shifts({x.layer_idx: float(head_diffuseness(x).mean()) for x in inputs}, self.key_shift)
        return [budget] * len(inputs)

    def shifted_nbytes(self, H: int, T: int, d: int, bits: float, shift: int) -> int:
        """What a layer shifted by +-`shift` is charged: the mean of a widened and a narrowed layer's bytes, so
        that the layers' budgets add up while their states differ."""
        return (self.nbytes(H, T, d, bits, abs(shift)) + self.nbytes(H, T, d, bits, -abs(shift))) // 2

    def nbytes(self, H: int, T: int, d: int, bits: float, shift: int = 0) -> int:
        """Exactly what a state of (H, T, d) keys and values at `bits` (keys shifted by `shift`) holds (at most
        that with key_basis="pca")."""
        n = sum(coded_nbytes(H, T, d, w) for w in self.widths(bits, shift))
        n += 2 * H * T * 2 + Rotation.planned_nbytes(d, self.rotation)  # fp16 norms
        if self.qjl:
            n += packed_nbytes(H * T * d, 1) + H * T * 2 + d * d * 2  # sign bits, fp16 |r|, fp16 S
        if self.center:
            n += H * d * 2 * (self.key_basis == "random")  # fp16 mean keys
        return n

    def build(self, keys: Tensor, values: Tensor, bits: float, layer_idx: int, shift: int = 0,
              queries: Tensor | None = None, frame: RopeFrame | None = None) -> TurboQuantState:
        """The state of keys and values (H, T, d) fp32 at `bits` (keys shifted by `shift` bits), with layer
        `layer_idx`'s rotation; with key_basis="pca", keys get the bytes random-rotation keys and their norms
        would hold, as transform codes weighted by `queries` (H, M, d) (uniformly without), before RoPE at the
        keys' positions in `frame` with `pre_rope`."""
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
        return TurboQuantState(keys, values, bits, self.qjl, R, S, self.path, widths, self.center, kt, self.unbiased)

    def basis_queries(self, x: LayerInput) -> Tensor | None:
        """Each KV head's reference queries (H, n * G, d), which key_basis="pca" weights its axes by."""
        return x.queries.reshape(x.H, -1, x.d) if self.key_basis == "pca" and x.queries is not None else None

    def compress(self, x: LayerInput) -> TurboQuantState | ConcatState:
        full = 2 * x.H * x.T * x.d * 2
        first, last = self._exact(x.T)
        n_q, exact = x.T - first - last, (first + last) * x.H * x.entry_bytes()
        shift = self.layer_shift(x.layer_idx)
        bits = pick_bits("turboquant" + (" with qjl" if self.qjl else ""), self.bits, self.supported(),
                         lambda b: self.shifted_nbytes(x.H, n_q, x.d, b, shift) + exact, x.budget_bytes, full,
                         self.rotation_hint(x.d, full))
        q, frame = self.basis_queries(x), None
        if self.pre_rope:
            if x.rope is None:
                raise KVSumError("turboquant: pre_rope un-rotates keys by the model's RoPE, which kvsum reads only "
                                 "in the Llama form (rotary_emb with inv_freq); this model's is not; drop pre_rope")
            frame = RopeFrame(x.rope, first, x.T - first - last, x.T)  # decoded keys: from the prompt's length on
        if not first + last:
            return self.build(x.keys, x.values, bits, x.layer_idx, shift, q, frame)
        coded = self.build(x.keys[:, first:x.T - last], x.values[:, first:x.T - last], bits, x.layer_idx, shift, q,
                           frame)
        exact = [x.keep([torch.arange(a, b, device=x.keys.device)] * x.H) if b > a else None
                 for a, b in ((0, first), (x.T - last, x.T))]
        return ConcatState([exact[0], coded, exact[1]])  # in position order

    def stream(self, layer_idx: int, state) -> QuantStream | None:
        if isinstance(state, ConcatState):  # exact sinks/window beside the codes: decoded tokens join the codes
            state = next((p for p in state.parts if isinstance(p, TurboQuantState)), None)
        return QuantStream(self.group, self.residual, live=state) if isinstance(state, TurboQuantState) else None
