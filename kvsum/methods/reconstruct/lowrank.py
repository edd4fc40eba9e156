"""Low-rank projection on calibrated bases (Palu, xKV): store coefficients per token instead of H*d channels.

Per layer, a token's keys (and, separately, its values) of all KV heads form one vector of n = H*d channels;
it is stored as coefficients on the top PCA basis of calibration activations (kvsum.calibrate). One basis
over all heads rather than one per head, since heads are correlated. With `share_layers=2` (xKV), two
adjacent layers share one set of coefficients on a basis of their joint 2n channels, since adjacent layers
are correlated too; the layers of a group are compressed together in one `compress_layers` call.

Keys: `space="post"` projects the keys as cached (after RoPE); attention then never rebuilds them: the
query is projected once per head (q B_h) and dotted with the coefficients, exact for the projection.
`space="pre"` (default) projects the un-rotated keys, which are much closer to low rank, and rebuilds and
rotates the keys at each attention call. Values are mixed in the coefficient space and mapped back once.

Two choices (docs/results/reconstruct.md has the measurements): the first `sinks` tokens are stored exactly,
because the attention sink's value is far from the calibrated subspace and it takes much of the attention;
and keys get only `key_share` of the coefficients, because values are much less compressible.

Bytes: sink entries and coefficients, in the storage dtype. Bases and means are per-model constants in the
artifact (its size is in `artifact.meta["nbytes"]`), not per-request memory, so no cache is charged for them.
With shared coefficients, the first layer of a group counts them; the layers after it count nothing twice.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ...calibrate import Artifact, artifact_for
from ...errors import KVSumError
from ...rope import layer_rope, rope_tables, rotate, shared_tables, unrotate
from ...state import tensor_bytes
from ..base import LayerInput, Method, Plan
from ..registry import register

SPACES = ("pre", "post")


def split(total: int, share: float, width: int) -> tuple[int, int]:
    """Split `total` stored numbers per token into (keys, values), keys about `share`, neither above `width`."""
    k = min(width, round(total * share))
    v = min(width, total - k)
    return min(width, total - v), v


class Coefficients:
    """Coefficients of keys and values (tokens, r) shared by the layers of one group; filled by its last layer."""

    def __init__(self):
        self.k: Tensor | None = None
        self.v: Tensor | None = None


class LowRankState:
    """One layer: exact sink entries, shared coefficients of the other tokens, this layer's rows of the bases."""

    def __init__(self, x: LayerInput, sinks: int, coef: Coefficients, owner: bool, rope: dict | None):
        self.H, self.T, self.d, self.S, self.layer_idx = x.H, x.T, x.d, sinks, x.layer_idx
        self.sink_k = x.keys[:, :sinks].to(x.storage).contiguous()
        self.sink_v = x.values[:, :sinks].to(x.storage).contiguous()
        self.coef, self.owner, self.rope = coef, owner, rope
        self.basis: dict[str, tuple[Tensor, Tensor]] = {}  # "k"/"v" -> mean (n,), rows (n, r): set by the fit

    def lengths(self) -> list[int]:
        return [self.T] * self.H

    def nbytes(self) -> int:
        return tensor_bytes(self.sink_k, self.sink_v, *((self.coef.k, self.coef.v) if self.owner else ()))

    def _heads(self, w: str) -> tuple[Tensor, Tensor]:
        """Mean (H, 1, d) and basis rows (H, d, r) of each head."""
        mean, B = self.basis[w]
        return mean.view(self.H, 1, self.d), B.view(self.H, self.d, -1)

    def _rest(self, w: str) -> Tensor:
        """Keys (post-RoPE) or values of the tokens after the sinks, as the coefficients give them back."""
        mean, B = self.basis[w]
        c = self.coef.k if w == "k" else self.coef.v
        x = (c.float() @ B.t() + mean).view(self.T - self.S, self.H, self.d).transpose(0, 1)
        if w == "k" and self.rope is not None:
            tables = shared_tables(self.rope["inv_freq"], self.rope["scaling"], self.T, x.device)
            x = rotate(x, *(t[self.S:] for t in tables))
        return x

    def rebuilt(self, w: str) -> Tensor:
        """Keys ("k", post-RoPE) or values ("v") of every token, (H, T, d) fp32."""
        sink = self.sink_k if w == "k" else self.sink_v
        return torch.cat([sink.float(), self._rest(w)], 1).contiguous()

    def scores(self, q: Tensor, scale: float) -> Tensor:
        if self.rope is not None:
            return q @ self.rebuilt("k")[None].transpose(-1, -2) * scale
        mean, B = self._heads("k")
        rest = (q[0] @ B) @ self.coef.k.float().t() + (q[0] * mean).sum(-1, keepdim=True)
        return torch.cat([q @ self.sink_k.float()[None].transpose(-1, -2), rest[None]], -1) * scale

    def mix(self, p: Tensor) -> Tensor:
        mean, B = self._heads("v")
        pr = p[0, :, :, self.S:]
        rest = (pr @ self.coef.v.float()) @ B.transpose(-1, -2) + pr.sum(-1, keepdim=True) * mean
        return p[..., :self.S] @ self.sink_v.float()[None] + rest[None]


@register
@dataclass(frozen=True)
class LowRank(Method):
    """Store each token's keys and values as coefficients on calibrated PCA bases.

    Attributes:
        artifact: a kvsum.calibrate.Artifact, its path, or None: the one `kvsum calibrate` saved for this model.
        rank: numbers stored per token for a layer group, keys and values together, all KV heads (None: the
            most the budget allows); full rank is 2 * share_layers * H * d.
        key_share: the part of the rank spent on keys.
        share_layers: 1, or 2 for coefficients shared by adjacent layers (a group takes its layers' budgets together).
        space: keys projected "pre" (un-rotated) or "post" RoPE.
        sinks: first tokens stored exactly.
    """

    name = "lowrank"
    summary = "calibrated PCA bases, coefficients per token, attention in the reduced space (Palu / xKV, 2024-25)"
    artifact: Any = None
    rank: int | None = None
    key_share: float = 0.25
    share_layers: int = 1
    space: str = "pre"
    sinks: int = 4

    def group(self, x: LayerInput) -> tuple[int, ...]:
        if self.share_layers not in (1, 2):
            raise KVSumError(f"lowrank: share_layers={self.share_layers!r}; accepted: 1, 2 (the artifact holds "
                             "moments of adjacent layers only)")
        first = x.layer_idx - x.layer_idx % self.share_layers
        return tuple(range(first, min(first + self.share_layers, x.n_layers)))

    def ranks(self, x: LayerInput, layers: int, S: int) -> tuple[int, int]:
        """(key, value) coefficients per token for a group of `layers` layers."""
        if not 0 <= self.key_share <= 1:
            raise KVSumError(f"lowrank: key_share must be in [0, 1], got {self.key_share!r}")
        width, elem, full = layers * x.H * x.d, x.storage.itemsize, 2 * x.H * x.d * x.T * 2
        spare = layers * (x.budget_bytes - 2 * x.H * S * x.d * elem)  # after the sinks
        fits = min(2 * width, max(0, math.floor(spare / (max(x.T - S, 1) * elem))))
        if self.rank is None:
            return split(fits, self.key_share, width)
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or not 0 <= self.rank <= 2 * width:
            raise KVSumError(f"lowrank: rank must be an integer in [0, {2 * width}] (keys + values, share_layers x "
                             f"KV heads x head dim each) or None, got {self.rank!r}")
        if self.rank > fits:
            need = (layers * 2 * x.H * S * x.d + (x.T - S) * self.rank) * elem / layers
            raise KVSumError(f"lowrank: rank={self.rank} needs {need / full:.3f} of the full cache, more than the "
                             f"budget {x.budget_bytes / full:.3f}; rank <= {fits} fits (rank=None picks it)")
        return split(self.rank, self.key_share, width)

    def compress(self, x: LayerInput, plan: Plan | None = None) -> LowRankState:
        """One layer alone: works when its group is the layer itself (share_layers=1)."""
        return self.compress_layers([x], plan)[0]

    def compress_layers(self, inputs: list[LayerInput], plan: Plan | None) -> list[LowRankState]:
        """Every layer in order; a group's shared coefficients are fitted when its last layer arrives."""
        if not inputs:
            return []
        art = artifact_for(inputs[0], "lowrank", self.artifact)
        out, pending = [], None
        for x in inputs:
            state, pending = self._layer(x, art, pending)
            out.append(state)
        if pending is not None:
            raise KVSumError(f"lowrank compresses layers in order (layers of a group share coefficients): layers "
                             f"{', '.join(map(str, pending[0]))} together, or share_layers=1")
        return out

    def _layer(self, x: LayerInput, art: Artifact, pending: tuple | None) -> tuple[LowRankState, tuple | None]:
        """This layer's state and the group still being filled (None once its coefficients are fitted)."""
        if self.space not in SPACES:
            raise KVSumError(f"lowrank: space={self.space!r}; accepted: {', '.join(SPACES)}")
        if isinstance(self.sinks, bool) or not isinstance(self.sinks, int) or self.sinks < 0:
            raise KVSumError(f"lowrank: sinks must be an integer >= 0, got {self.sinks!r}")
        kind = "k_pre" if self.space == "pre" else "k_post"
        if kind not in art.stats:
            raise KVSumError(f"lowrank: space={self.space!r} needs {kind} moments, which this artifact lacks "
                             f"(it has {', '.join(art.stats)}); use space='post'")
        rope = layer_rope(art.rope, x.layer_idx) if kind == "k_pre" else None
        S = min(self.sinks, x.T, int(x.budget_bytes // (2 * x.H * x.d * x.storage.itemsize)))
        group = self.group(x)
        if x.layer_idx == group[0]:
            pending = (group, Coefficients(), [], [], self.ranks(x, len(group), S))
        if pending is None or pending[0] != group or len(pending[2]) != x.layer_idx - group[0]:
            raise KVSumError("lowrank compresses layers in order (layers of a group share coefficients); "
                             "on models with sliding-window layers, use share_layers=1")
        _, coef, states, xs, ranks = pending
        keys = x.keys[:, S:]
        if rope is not None:
            keys = unrotate(keys, *(t[S:] for t in rope_tables(rope["inv_freq"], rope["scaling"], x.T, keys.device)))
        xs.append((keys.transpose(0, 1).reshape(x.T - S, -1), x.values[:, S:].transpose(0, 1).reshape(x.T - S, -1)))
        state = LowRankState(x, S, coef, x.layer_idx == group[0], rope)
        states.append(state)
        if x.layer_idx == group[-1]:
            n = x.H * x.d
            for i, (w, k) in enumerate((("k", kind), ("v", "v"))):
                mean, B = (t.to(x.keys.device) for t in art.lowrank_basis(k, group))
                B = B[:, :ranks[i]]
                c = (torch.cat([pair[i] for pair in xs], 1) - mean) @ B
                setattr(coef, w, c.to(x.storage).contiguous())
                for j, s in enumerate(states):
                    s.basis[w] = (mean[j * n:(j + 1) * n], B[j * n:(j + 1) * n].contiguous())
            pending = None
        return state, pending
