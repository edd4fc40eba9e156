"""Llama-form rotary position embeddings: the tables, rotate / unrotate, and reading them off a model.

RoPE at position t is a known rotation of each head's channel pairs (j, j + d/2). Methods that fit or
store keys before the rotation (the reconstruction fits, PCA quantization, summary's cover) un-rotate
cached keys with these tables and rotate what they rebuild back. `rope_of` rebuilds the tables per layer
from the model's rotary embedding (Gemma 3's per-layer-type bases included) and checks them against the
model's own cos/sin, so a rotary embedding of another form is never inverted by mistake.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

CHECK_LEN = 2048  # positions at which rope_of compares its tables with the model's own cos/sin
BLOCK = 4096  # positions the shared tables grow by


def rope_tables(inv_freq: Tensor, scaling: float, T: int, device=None) -> tuple[Tensor, Tensor]:
    """cos, sin of shape (T, d) for positions 0..T-1, as Llama-style rotary embeddings compute them."""
    freqs = torch.arange(T, device=device, dtype=torch.float32)[:, None] * inv_freq.to(device).float()[None]
    emb = torch.cat([freqs, freqs], -1)
    return emb.cos() * scaling, emb.sin() * scaling


def shared_tables(inv_freq: Tensor, scaling: float, T: int, device=None) -> tuple[Tensor, Tensor]:
    """`rope_tables` for positions 0..T-1 as slices of one table per RoPE, grown BLOCK positions at a time and
    shared by every layer and cache with that RoPE: states that turn keys at each decoding step would otherwise
    compute T x d cosines per layer per step. The rows are the ones rope_tables computes (same arithmetic)."""
    cos, sin = _block_tables(tuple(inv_freq.tolist()), float(scaling), -(-T // BLOCK) * BLOCK, str(device or "cpu"))
    return cos[:T], sin[:T]


@functools.lru_cache(maxsize=4)
def _block_tables(inv_freq: tuple, scaling: float, n: int, device: str) -> tuple[Tensor, Tensor]:
    return rope_tables(torch.tensor(inv_freq, dtype=torch.float32), scaling, n, device)


def rotate_half(x: Tensor) -> Tensor:
    h = x.shape[-1] // 2
    return torch.cat([-x[..., h:], x[..., :h]], -1)


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Apply RoPE to x (..., T, d) with tables (T, d)."""
    return x * cos + rotate_half(x) * sin


def unrotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Invert `rotate` (the rotation is orthogonal up to the scaling factor cos^2 + sin^2)."""
    return (x * cos - rotate_half(x) * sin) / (cos * cos + sin * sin)


def rope_of(model, head_dim: int, n_layers: int) -> dict | None:
    """Per layer, inv_freq and scaling of the model's rotary embedding when it has the Llama form (checked
    against the model's own cos/sin; layer types with their own RoPE, as in Gemma 3, included); else None."""
    rot = getattr(getattr(model, "model", model), "rotary_emb", None)
    if rot is None:
        return None
    types = getattr(model.config.get_text_config(), "layer_types", None) or [None] * n_layers
    inv, scale = [], []
    for lt in types[:n_layers]:
        own = lt is not None and hasattr(rot, f"{lt}_inv_freq")
        f = getattr(rot, f"{lt}_inv_freq" if own else "inv_freq", None)
        if f is None or f.numel() * 2 != head_dim:
            return None
        s = float(getattr(rot, f"{lt}_attention_scaling" if own else "attention_scaling", 1.0))
        try:
            pos = torch.arange(CHECK_LEN, device=f.device)[None]
            x = torch.zeros(1, device=f.device)
            cos, sin = rot(x, pos, lt) if own else rot(x, pos)
        except Exception:  # a rotary embedding with another signature: not ours to invert
            return None
        mine = rope_tables(f, s, CHECK_LEN, f.device)
        if cos.shape[-2:] != mine[0].shape or not all(torch.allclose(a[0].float(), b, atol=1e-4)
                                                      for a, b in zip((cos, sin), mine)):
            return None
        inv.append(f.detach().float().cpu())
        scale.append(s)
    return {"inv_freq": torch.stack(inv), "scaling": torch.tensor(scale)}


def layer_rope(rope: dict | None, layer: int) -> dict | None:
    """One layer's RoPE parameters {inv_freq, scaling} from a per-layer table (rope_of's)."""
    if rope is None:
        return None
    return {"inv_freq": rope["inv_freq"][layer], "scaling": float(rope["scaling"][layer])}


class RopeFrame:
    """Positions of a layer's coded keys, for coding them before RoPE: the prompt's `n` keys from `start`, then
    decoded keys from `resume` (the prompt's length: the positions the model gives them). The tables are
    recomputed from the model's own `rope` (kvsum.rope.layer_rope), not held."""

    def __init__(self, rope: dict, start: int, n: int, resume: int):
        self.rope, self.start, self.n, self.resume = rope, start, n, resume

    def positions(self, first: int, n: int) -> Tensor:
        """Positions of held keys first..first + n - 1 (the prompt's run, then the decoded one)."""
        i = torch.arange(first, first + n)
        return torch.where(i < self.n, self.start + i, self.resume + i - self.n)

    def tables(self, first: int, n: int, device) -> tuple[Tensor, Tensor]:
        """cos, sin (n, d) at the positions of held keys first..first + n - 1: a slice of the shared tables where
        the decoded run follows the prompt's (every position is then start + index), else their rows gathered."""
        if self.resume == self.start + self.n:
            a = self.start + first
            cos, sin = shared_tables(self.rope["inv_freq"], self.rope["scaling"], a + n, device)
            return cos[a:], sin[a:]
        return self._at(self.positions(first, n), device)

    def _at(self, pos: Tensor, device) -> tuple[Tensor, Tensor]:
        pos = pos.to(device)
        cos, sin = shared_tables(self.rope["inv_freq"], self.rope["scaling"], int(pos.max()) + 1, device)
        return cos[pos], sin[pos]

    def undo(self, keys: Tensor, first: int) -> Tensor:
        """Post-RoPE keys (H, n, d), held from index `first`, turned back to before RoPE."""
        return unrotate(keys, *self.tables(first, keys.shape[1], keys.device))

    def apply(self, keys: Tensor) -> Tensor:
        """Pre-RoPE keys (H, T, d), all that is held, turned to their positions."""
        return rotate(keys, *self.tables(0, keys.shape[1], keys.device))

    def queries(self, q: Tensor, n_pos: int = 64) -> Tensor:
        """Reference queries (H, M, d) as pre-RoPE keys at `n_pos` prompt positions see them: (H, M * n_pos, d)."""
        pos = self.positions(0, self.n)[torch.linspace(0, self.n - 1, min(n_pos, self.n)).long().unique()]
        cos, sin = self._at(pos, q.device)
        return unrotate(q[:, :, None, :], cos, sin).flatten(1, 2)
