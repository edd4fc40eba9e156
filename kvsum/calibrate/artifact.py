"""`Artifact`: one model's calibrated moments, saved to one file, with the fits derived from them on demand.

`stats[kind]` for kind in k_pre (keys before RoPE), k_post (keys as cached), v: `mean` (L, n), `cov` (L, n, n)
and `cross` (L, n, n) with cross[i] = Cov(x_i, x_{i-1}) (cross[0] is zero), n = KV heads x head dim. These are
per-model constants, not per-request memory: the methods do not charge them to a cache. `meta` records the
model fingerprint (kvsum.shape.fingerprint), the methods calibrated, the calibration knobs, time and size.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from ..errors import KVSumError
from ..shape import fingerprint
from .fit import EchoPlan, echo_plan, lowrank_basis

FORMAT = "kvsum.reconstruct/2"


def describe(f: dict) -> str:
    """A fingerprint in words, for error messages."""
    return (f"{f['model_type']} ({f['layers']} layers, {f['kv_heads']} KV heads, head dim {f['head_dim']}, "
            f"weights {f['weights_sha256']})")


class Artifact:
    """Calibrated moments of one model's keys and values (see the module docstring), fits derived on demand.

    The fits are pure functions of the moments, memoized on the artifact (not on any method), so every method
    instance and prompt that uses one loaded artifact shares them."""

    def __init__(self, meta: dict, stats: dict[str, dict[str, Tensor]], rope: dict | None):
        self.meta, self.stats, self.rope = meta, stats, rope
        self._fits: dict = {}

    @property
    def fingerprint(self) -> dict:
        return self.meta["fingerprint"]

    def nbytes(self) -> int:
        """Bytes of the tensors the artifact holds (its file is this plus a little metadata)."""
        t = [x for s in self.stats.values() for x in s.values()] + (list(self.rope.values()) if self.rope else [])
        return sum(x.numel() * x.element_size() for x in t)

    def key_space(self) -> str:
        """k_pre when the model's RoPE could be inverted at calibration, else k_post."""
        return "k_pre" if "k_pre" in self.stats else "k_post"

    def save(self, path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        torch.save({"format": FORMAT, "meta": self.meta, "stats": self.stats, "rope": self.rope}, tmp)
        tmp.replace(path)
        return path

    @classmethod
    def load(cls, path, model=None) -> Artifact:
        """Read an artifact; with `model`, fail unless it was calibrated on that model."""
        path = Path(path)
        if not path.is_file():
            raise KVSumError(f"calibration artifact {str(path)!r} does not exist; create it with kvsum.calibrate")
        try:
            d = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:
            raise KVSumError(f"{str(path)!r} is not a kvsum calibration artifact ({type(e).__name__}: "
                             f"{str(e).strip().splitlines()[0][:120] if str(e).strip() else ''})") from None
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise KVSumError(f"{str(path)!r} is not a kvsum calibration artifact (format {FORMAT})")
        art = cls(d["meta"], d["stats"], d["rope"])
        if model is not None:
            art.check(model)
        return art

    def check(self, model) -> None:
        mine, theirs = self.fingerprint, fingerprint(model)
        if mine != theirs:
            raise KVSumError(f"calibration artifact is for {describe(mine)}, but the model is {describe(theirs)}; "
                             "calibrate this model with kvsum.calibrate")

    def check_shape(self, method: str, n_layers: int, H: int, d: int) -> None:
        """What a method can check without the model: the layer shapes."""
        f = self.fingerprint
        if (f["layers"], f["kv_heads"], f["head_dim"]) != (n_layers, H, d):
            raise KVSumError(f"{method}: calibration artifact is for {describe(f)}, but the cache has {n_layers} "
                             f"layers, {H} KV heads, head dim {d}")
        if method not in self.meta["methods"]:
            raise KVSumError(f"{method}: this artifact was calibrated for {', '.join(self.meta['methods'])}; "
                             f"run kvsum.calibrate(..., method={method!r})")

    def echo_plan(self, kind: str, layer: int, k: int, prev: Tensor) -> EchoPlan:
        """Store `k` channels of `layer`, rebuild the rest from them and the previous layer's `prev` channels."""
        key = (kind, layer, k, tuple(prev.tolist()))
        if key not in self._fits:
            self._fits[key] = echo_plan(self.stats[kind], self.fingerprint["head_dim"], kind.startswith("k"),
                                        layer, k, prev)
        return self._fits[key]

    def lowrank_basis(self, kind: str, layers: tuple[int, ...]) -> tuple[Tensor, Tensor]:
        """PCA basis of `layers` (kvsum.calibrate.fit.lowrank_basis): mean (g*n,), sorted columns (g*n, g*n)."""
        key = ("lowrank", kind, layers)
        if key not in self._fits:
            self._fits[key] = lowrank_basis(self.stats[kind], layers)
        return self._fits[key]
