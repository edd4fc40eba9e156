"""EchoKV-style reconstruction: store a calibrated subset of each layer's KV channels, rebuild the rest.

Per layer and token, keys and values are n = H*d channels (all KV heads together). The state stores some of
them exactly and rebuilds the others when attention reads them, by ridge maps from its own stored channels
and from the previous layer's (EchoKV's observation: heads and adjacent layers are strongly correlated).
Channel level, not head level: with SmolLM2's 3 KV heads, heads would only allow 1/3 steps. Keys are
stored and chosen in RoPE pairs (j, j + d/2), so the stored ones can be un-rotated: the maps are fitted
before RoPE and the rebuilt channels are rotated at their positions (kvsum.calibrate says why). As in
lowrank, the first `sinks` tokens are stored whole and keys get `key_share` of the stored channels when the
budget decides.

Bytes: sink entries, the stored channels and their int16 channel indices. The ridge maps are per-model
constants in the calibration artifact (its size is in `artifact.meta["nbytes"]`), not per-request memory,
so no cache is charged for them. The state of layer i refers to layer i-1's state for its stored channels;
those bytes are counted once, in layer i-1. That link is made within one `compress_layers` call (the method
holds nothing between calls); a layer compressed alone rebuilds from its own channels only. Cost: every
attention call rebuilds the layer's keys, O(T n k) multiply-adds, so decoding is slower than with a plain cache
(no rebuilt tensor is kept); values are mixed from the stored channels and mapped after (`EchoState.mix`).

Modes: `mode="compressed"` (default) fits `keep` or the budget; `mode="full"` stores every channel (no
rebuild, needs budget 1.0). To switch per request, as EchoKV does for short contexts, compress short
prompts with method="full" (transformers' own attention path) and long ones with echokv: both give a
kvsum.Cache, so the same serving code handles either.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ...calibrate import Artifact, EchoPlan, artifact_for
from ...errors import KVSumError
from ...rope import layer_rope, rotate, shared_tables, unrotate
from ...state import tensor_bytes
from ..base import LayerInput, Method, Plan
from ..registry import register
from .lowrank import split

MODES = ("compressed", "full")


class EchoState:
    """Exact sink entries, stored channels (tokens after the sinks, k) of keys and values, and what rebuilds the
    rest: the plans, RoPE, the previous layer's state."""

    def __init__(self, x: LayerInput, sinks: int, plans: dict[str, EchoPlan], prev: EchoState | None,
                 rope: dict | None):
        self.H, self.T, self.d, self.S, self.layer_idx = x.H, x.T, x.d, sinks, x.layer_idx
        self.prev, self.rope = prev, rope
        self.expanded: dict[str, Tensor] | None = None  # set_mode("full"): every channel, rebuilt once
        dev = x.keys.device
        self.plans = {w: EchoPlan(**{k: t.to(dev) for k, t in vars(p).items()}) for w, p in plans.items()}
        self.sink = {"k": x.keys[:, :sinks].to(x.storage).contiguous(),
                     "v": x.values[:, :sinks].to(x.storage).contiguous()}
        flat = {"k": self._flat(x.keys[:, sinks:]), "v": self._flat(x.values[:, sinks:])}
        self.stored = {w: flat[w][:, self.plans[w].sel].to(x.storage).contiguous() for w in "kv"}
        partial = any(len(p.rest) for p in self.plans.values())
        # the channel indices (int16) a real deployment would keep per layer; counted in nbytes.
        self.index = [p.sel.to(torch.int16) for p in self.plans.values()] if partial else []

    def _flat(self, x: Tensor) -> Tensor:
        return x.transpose(0, 1).reshape(x.shape[1], self.H * self.d)

    def lengths(self) -> list[int]:
        return [self.T] * self.H

    def nbytes(self) -> int:
        held = tensor_bytes(*self.expanded.values()) if self.expanded else 0
        return held + tensor_bytes(*self.sink.values(), *self.stored.values(), *self.index)

    def set_mode(self, mode: str) -> None:
        """"full": rebuild every channel once and hold it (full bytes, decoding at full-cache speed);
        "compressed": drop what was rebuilt (the stored channels were never touched, so this is lossless)."""
        if mode not in MODES:
            raise KVSumError(f"mode={mode!r}; accepted: {', '.join(MODES)}")
        dtype = self.stored["k"].dtype
        self.expanded = {w: self._rebuild(w).to(dtype) for w in "kv"} if mode == "full" else None

    def _tables(self):
        """RoPE tables (tokens after the sinks, 1, d), to broadcast over heads."""
        tables = shared_tables(self.rope["inv_freq"], self.rope["scaling"], self.T, self.stored["k"].device)
        return [t[self.S:, None] for t in tables]

    def _placed(self, w: str, own: Tensor, rest: Tensor | None = None) -> Tensor:
        """A (tokens, n) tensor with `own` in the stored channels and `rest` (or zeros) in the others."""
        p = self.plans[w]
        out = own.new_zeros(own.shape[0], self.H * self.d)
        out[:, p.sel] = own
        if rest is not None:
            out[:, p.rest] = rest
        return out

    def fit_space(self, w: str) -> Tensor:
        """This layer's stored channels as the maps read them: keys un-rotated (with this layer's RoPE, which may
        differ from the next layer's) when the fit was before RoPE."""
        own = self.stored[w].float()
        if w == "v" or self.rope is None:
            return own
        full = unrotate(self._placed("k", own).view(-1, self.H, self.d), *self._tables())
        return full.reshape(own.shape[0], -1)[:, self.plans["k"].sel]

    def rebuilt(self, w: str) -> Tensor:
        """Keys ("k", post-RoPE) or values ("v") of every token and channel, (H, T, d) fp32."""
        if self.expanded:
            return self.expanded[w].float()
        return self._rebuild(w)

    def _predictors(self, w: str) -> Tensor:
        """What the ridge map reads, (tokens after the sinks, k + k'): this layer's stored channels in the map's
        space, then the previous layer's it uses."""
        own = self.fit_space(w)
        return torch.cat([own, self.prev.fit_space(w)], 1) if len(self.plans[w].prev) else own

    def _rebuild(self, w: str) -> Tensor:
        p, own = self.plans[w], self.stored[w].float()
        if len(p.rest):
            tables = self._tables() if (w == "k" and self.rope is not None) else None
            pred = self._predictors(w)
            rest = p.mean_out + (pred - p.mean_in) @ p.W
            if tables is not None:
                full = rotate(self._placed(w, pred[:, :own.shape[1]], rest).view(-1, self.H, self.d), *tables)
                full = full.reshape(own.shape[0], -1)
                full[:, p.sel] = own  # the stored channels exactly, not through the round trip
            else:
                full = self._placed(w, own, rest)
        else:
            full = own
        rest_tokens = full.view(-1, self.H, self.d).transpose(0, 1)
        return torch.cat([self.sink[w].float(), rest_tokens], 1).contiguous()

    def scores(self, q: Tensor, scale: float) -> Tensor:
        return q @ self.rebuilt("k")[None].transpose(-1, -2) * scale

    def mix(self, p: Tensor) -> Tensor:
        """p (B, H, M, T) @ values. Rebuilt values are an affine map of the predictors, so the weights are applied to
        the stored channels first and the map after: sum_t p_t (m + (x_t - mu) W) = (sum_t p_t)(m - mu W) +
        (sum_t p_t x_t) W, H*M rows through the map instead of T tokens (keys cannot: their map acts before RoPE)."""
        pl = self.plans["v"]
        if self.expanded or not len(pl.rest):
            return p @ self.rebuilt("v")[None]
        S = self.S
        w = p[..., S:].float()
        px = w @ self._predictors("v")  # (B, H, M, k + k'): own channels first
        flat = px.new_empty(*px.shape[:-1], self.H * self.d)
        flat[..., pl.sel] = px[..., :len(pl.sel)]
        flat[..., pl.rest] = w.sum(-1, keepdim=True) * (pl.mean_out - pl.mean_in @ pl.W) + px @ pl.W
        heads = torch.arange(self.H, device=p.device)
        mine = flat.view(*flat.shape[:-1], self.H, self.d)[:, heads, :, heads]  # (H, B, M, d): head h's channels
        return p[..., :S].float() @ self.sink["v"].float()[None] + mine.permute(1, 0, 2, 3)


@register
@dataclass(frozen=True)
class EchoKV(Method):
    """Store a calibrated subset of each layer's channels, rebuild the rest from this and the previous layer.

    Attributes:
        artifact: a kvsum.calibrate.Artifact, its path (checked against the layer shapes; `Artifact.load(path,
            model)` also checks the weights), or None: the one `kvsum calibrate` saved for this model.
        keep: fraction of the H*d channels stored, for keys and values alike (None: as many as the budget allows).
        mode: "compressed" (fit `keep` or the budget) or "full" (store every channel, needs budget 1).
        key_share: with keep=None, the part of the stored channels spent on keys.
        sinks: first tokens stored whole.
    """

    name = "echokv"
    summary = "store calibrated KV channels, rebuild the rest by ridge from this and the previous layer (EchoKV, 2026)"
    artifact: Any = None
    keep: float | None = None
    mode: str = "compressed"
    key_share: float = 0.25
    sinks: int = 4

    def layout(self, x: LayerInput) -> tuple[int, int, int]:
        """(sink tokens, stored key channels, stored value channels): from `mode`/`keep`, else the budget."""
        n, elem = x.H * x.d, x.storage.itemsize
        if self.mode not in MODES:
            raise KVSumError(f"echokv: mode={self.mode!r}; accepted: {', '.join(MODES)}")
        if isinstance(self.sinks, bool) or not isinstance(self.sinks, int) or self.sinks < 0:
            raise KVSumError(f"echokv: sinks must be an integer >= 0, got {self.sinks!r}")
        if not 0 <= self.key_share <= 1:
            raise KVSumError(f"echokv: key_share must be in [0, 1], got {self.key_share!r}")
        S = min(self.sinks, x.T, int(x.budget_bytes // (2 * n * elem)))

        def need(kk: int, kv: int) -> int:
            return 2 * S * n * elem + (x.T - S) * (kk + kv) * elem + (0 if kk == kv == n else 2 * (kk + kv))

        if self.mode == "full" or self.keep == 1:
            kk = kv = n
        elif self.keep is not None:
            if isinstance(self.keep, bool) or not isinstance(self.keep, (int, float)) or not 0 <= self.keep <= 1:
                raise KVSumError(f"echokv: keep must be a fraction in [0, 1] or None, got {self.keep!r}")
            kk, kv = 2 * round(self.keep * n / 2), round(self.keep * n)
        elif need(n, n) <= x.budget_bytes:
            kk = kv = n
        else:
            spare = x.budget_bytes - 2 * S * n * elem - 4 * n  # after the sinks and the indices
            kk, kv = split(max(0, math.floor(spare / (max(x.T - S, 1) * elem))), self.key_share, n)
            kk -= kk % 2  # whole RoPE pairs
        full = 2 * n * x.T * 2
        if need(kk, kv) > x.budget_bytes:
            raise KVSumError(f"echokv: {'mode=full' if kk == kv == n else f'keep={self.keep}'} needs "
                             f"{need(kk, kv) / full:.3f} of the full cache, more than the budget "
                             f"{x.budget_bytes / full:.3f} (keep=None fits the budget)")
        return S, kk, kv

    def compress(self, x: LayerInput, plan: Plan | None = None) -> EchoState:
        """One layer alone: rebuilt from its own stored channels (no previous layer to read)."""
        return self.compress_layers([x], plan)[0]

    def compress_layers(self, inputs: list[LayerInput], plan: Plan | None) -> list[EchoState]:
        """Every layer in order, each rebuilt from its own channels and those of the layer just before it."""
        if not inputs:
            return []
        art = artifact_for(inputs[0], "echokv", self.artifact)
        states, prev = [], None
        for x in inputs:
            prev = self._layer(x, art, prev)
            states.append(prev)
        return states

    def _layer(self, x: LayerInput, art: Artifact, prev: EchoState | None) -> EchoState:
        S, kk, kv = self.layout(x)
        # the previous layer's stored channels help when that layer was compressed just before this one; after
        # an uncompressed (sliding-window) layer, a global layer is rebuilt from its own channels alone
        if prev is not None and (x.layer_idx == 0 or prev.layer_idx != x.layer_idx - 1 or prev.S != S):
            prev = None
        kind = art.key_space()
        none = torch.empty(0, dtype=torch.long)
        plans = {w: art.echo_plan(kind if w == "k" else "v", x.layer_idx, k, prev.plans[w].sel.cpu() if prev else none)
                 for w, k in (("k", kk), ("v", kv))}
        return EchoState(x, S, plans, prev, layer_rope(art.rope, x.layer_idx) if kind == "k_pre" else None)
