"""The calibration pass: run the model over calibration text and accumulate the moments of its keys and values.

Per layer, all KV heads as one vector of H*d channels: first and second moments and the cross-covariance with
the previous layer, for keys before RoPE (when the model's rotary embedding can be inverted, kvsum.rope), keys
as cached and values. These are sufficient statistics for every fit (kvsum.calibrate.fit). The first SKIP
positions of every pass are left out: the attention sinks, whose keys and values are outliers the methods
store exactly anyway.
"""

from __future__ import annotations

import time

import torch
from torch import Tensor

from ..errors import KVSumError
from ..extras import progress as progress_bar
from ..prefill import prefill
from ..rope import layer_rope, rope_of, rope_tables, unrotate
from ..shape import ModelShape, fingerprint
from .artifact import Artifact
from .fit import RIDGE
from .store import METHODS
from .text import calibration_ids

DEFAULT_TOKENS = 4096
SEQ_LEN = 2048  # tokens per forward pass: evaluation contexts are 1k-2k tokens, so positions are covered
SKIP = 4  # first positions of each pass left out of the moments: attention sinks, which the methods store exactly


class Moments:
    """Running float64 sums for the mean, covariance and previous-layer cross-covariance of every layer."""

    def __init__(self, L: int, n: int):
        self.N = 0
        self.s = torch.zeros(L, n, dtype=torch.float64)
        self.ss = torch.zeros(L, n, n, dtype=torch.float64)
        self.sx = torch.zeros(L, n, n, dtype=torch.float64)

    def add(self, i: int, x: Tensor, prev: Tensor | None) -> None:
        x = x.double()
        self.s[i] += x.sum(0)
        self.ss[i] += x.T @ x
        if prev is not None:
            self.sx[i] += x.T @ prev.double()

    def finish(self) -> dict[str, Tensor]:
        mean = self.s / self.N
        cov = self.ss / self.N - mean[:, :, None] * mean[:, None, :]
        cross = self.sx / self.N - mean[:, :, None] * torch.cat([mean[:1] * 0, mean[:-1]])[:, None, :]
        cross[0] = 0
        return {"mean": mean.float(), "cov": cov.float(), "cross": cross.float()}


@torch.no_grad()
def calibrate(model, tokenizer=None, text: str | None = None, method: str = "all", tokens: int = DEFAULT_TOKENS,
              progress: bool = True, *, ids: Tensor | None = None, seq_len: int = SEQ_LEN) -> Artifact:
    """Calibrate `method` ("echokv", "lowrank" or "all") for `model` on `tokens` tokens of `text` (default: stdlib
    source, kvsum.calibrate.text) or of token `ids`, in forward passes of `seq_len` tokens.

    Returns an Artifact (save it with `.save(path)`; `kvsum.calibrate.default_artifact_path` is where methods
    with `artifact=None` look). Its meta records the model fingerprint, the calibration time, the artifact's
    size in bytes and the calibration knobs.
    """
    if method not in METHODS:
        raise KVSumError(f"calibrate: method {method!r}; accepted: {', '.join(METHODS)}")
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 2:
        raise KVSumError(f"calibrate: tokens must be an integer >= 2, got {tokens!r}")
    start = time.perf_counter()
    ids, source = calibration_ids(tokenizer, text, ids, tokens)
    shape = ModelShape.of(model)
    windows = [w for w in shape.windows if w is not None]
    # sliding-window layers hold only their window: chunks no longer than it give every layer the same tokens
    # (only global layers are compressed; their moments are what the methods use)
    seq_len = max(2, min([seq_len, shape.max_len] + [w - 1 for w in windows]))
    L, H, d = shape.n_layers, shape.n_kv_heads, shape.head_dim
    rope = rope_of(model, d, L)
    kinds = (["k_pre"] if rope else []) + (["k_post"] if method != "echokv" or not rope else []) + ["v"]
    acc = {kind: Moments(L, H * d) for kind in kinds}
    device = next(model.parameters()).device
    chunks = [ids[i:i + seq_len] for i in range(0, len(ids), seq_len)]
    chunks = [c for c in chunks if len(c) >= 2]
    with progress_bar(f"calibrating {method} on {shape.n_layers} layers", sum(map(len, chunks)), enabled=progress,
                      unit="tokens", transient=True) as bar:
        for chunk in chunks:
            pre = prefill(model, chunk[None].to(device))
            skip = min(SKIP, len(chunk) // 2)
            last: dict[str, Tensor] = {}
            for i, layer in enumerate(pre.cache.layers):
                k, v = layer.keys[0, :, skip:].float(), layer.values[0, :, skip:].float()  # (H, T, d)
                xs = {"k_post": k, "v": v}
                if rope:
                    r = layer_rope(rope, i)
                    cos, sin = (t[skip:] for t in rope_tables(r["inv_freq"], r["scaling"], len(chunk), device))
                    xs["k_pre"] = unrotate(k, cos, sin)
                for kind in kinds:
                    x = xs[kind].transpose(0, 1).reshape(len(chunk) - skip, H * d).cpu()
                    acc[kind].add(i, x, last.get(kind))
                    last[kind] = x
                layer.reset()
            for a in acc.values():
                a.N += len(chunk) - skip
            bar.advance(steps=len(chunk))
    stats = {kind: a.finish() for kind, a in acc.items()}
    knobs = {"tokens": len(ids), "seq_len": seq_len, "ridge": RIDGE, "skip": SKIP, "text": source}
    meta = {"fingerprint": fingerprint(model), "methods": ["echokv", "lowrank"] if method == "all" else [method],
            "knobs": knobs, "n_knobs": len(knobs), "key_space": "k_pre" if rope else "k_post"}
    art = Artifact(meta, stats, rope)
    meta["seconds"] = round(time.perf_counter() - start, 2)
    meta["nbytes"] = art.nbytes()
    return art
