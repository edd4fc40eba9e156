"""Calibration for the reconstruction methods (`echokv`, `lowrank`): one plain pass over text, closed-form fits.

`calibrate` runs the model over calibration text and accumulates, per layer, the first and second moments
of its keys and values (all KV heads of a layer as one vector of H*d channels) and their cross-covariance
with the previous layer. These moments are sufficient statistics for every fit the methods need, so one
`Artifact` serves every budget, keep fraction and rank:
- `lowrank` bases are the eigenvectors of a layer's covariance (PCA), or of two adjacent layers' joint
  covariance for `share_layers=2` (torch.linalg.eigh, sorted: any rank is a slice);
- `echokv` chooses which channels to store greedily (the channel that explains the most remaining
  variance of the others, given the previous layer's stored channels) and rebuilds the others by ridge
  regression from the stored channels of this layer and the previous one (torch.linalg.solve).
Both fits take milliseconds per layer (the greedy selection a little more); they run on first use and
are cached in the Artifact. The first SKIP positions of every pass are left out of the moments: the
attention sinks, whose keys and values are outliers the methods store exactly anyway.

RoPE: keys are cached after the rotation, which turns a fixed linear relation between channels into a
position-dependent one. We un-rotate the keys (RoPE at position t is a known rotation of channel pairs
(j, j + d/2); we rebuild it per layer from the model's rotary embedding, with Gemma 3's per-layer-type
bases, and check it against the model's own cos/sin) and fit keys before RoPE ("k_pre"); the methods
rotate what they rebuild back at attention time. Measured on SmolLM2-135M (4096 calibration tokens,
2048 held-out prose tokens, mean over 30 layers): per-head PCA at rank 16 of 64 leaves 0.25 relative
error on pre-RoPE keys against 0.43 on post-RoPE keys; echokv at keep 0.5 leaves 0.11 against 0.22.
Post-RoPE key moments ("k_post") are kept too, for lowrank's space="post" (scoring in the reduced space
without rebuilding keys) and for models whose rotary embedding we cannot invert.

Cost on SmolLM2-135M (this 2-core CPU, shared): about 50 s for the default 4096 tokens; the artifact
holds 26.6 MB of fp32 moments (k_pre, k_post and v: mean, covariance and previous-layer cross-covariance
of 192 channels for each of 30 layers).

Default calibration text: a deterministic slice of the Python standard library's own source files
(the first characters of each public top-level module, in name order). It is disjoint from the
evaluation haystack, which uses the documentation prose of `pydoc_data.topics` (tests check that no
paragraph is shared).
"""

from __future__ import annotations

import glob
import hashlib
import os
import platform
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from .errors import KVSumError

FORMAT = "kvsum.reconstruct/2"
METHODS = ("echokv", "lowrank", "all")
DEFAULT_TOKENS = 4096
SEQ_LEN = 2048  # tokens per forward pass: evaluation contexts are 1k-2k tokens, so positions are covered
RIDGE = 1e-3  # ridge strength, relative to each predictor's variance (scale-free: key channels differ 100x)
MODULE_CHARS = 3000  # characters taken from each stdlib module: many modules, varied code and docstrings
SKIP = 4  # first positions of each pass left out of the moments: attention sinks, which the methods store exactly


# --- calibration text ---------------------------------------------------------------------------------

def stdlib_modules() -> list[Path]:
    """Public top-level modules of the standard library, in name order."""
    root = sysconfig.get_paths()["stdlib"]
    return [Path(f) for f in sorted(glob.glob(os.path.join(root, "*.py"))) if not Path(f).name.startswith("_")]


def calibration_text(chars: int = 60_000, start: int = 0) -> str:
    """About `chars` characters of stdlib source: the first MODULE_CHARS of each module from index `start`."""
    parts, total = [], 0
    for path in stdlib_modules()[start:]:
        text = path.read_text(encoding="utf-8", errors="replace")[:MODULE_CHARS]
        parts.append(text)
        total += len(text)
        if total >= chars:
            break
    return "\n\n".join(parts)


# --- RoPE ---------------------------------------------------------------------------------------------

def rope_tables(inv_freq: Tensor, scaling: float, T: int, device=None) -> tuple[Tensor, Tensor]:
    """cos, sin of shape (T, d) for positions 0..T-1, as Llama-style rotary embeddings compute them."""
    freqs = torch.arange(T, device=device, dtype=torch.float32)[:, None] * inv_freq.to(device).float()[None]
    emb = torch.cat([freqs, freqs], -1)
    return emb.cos() * scaling, emb.sin() * scaling


def _rotate_half(x: Tensor) -> Tensor:
    h = x.shape[-1] // 2
    return torch.cat([-x[..., h:], x[..., :h]], -1)


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Apply RoPE to x (..., T, d) with tables (T, d)."""
    return x * cos + _rotate_half(x) * sin


def unrotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Invert `rotate` (the rotation is orthogonal up to the scaling factor cos^2 + sin^2)."""
    return (x * cos - _rotate_half(x) * sin) / (cos * cos + sin * sin)


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
            pos = torch.arange(SEQ_LEN, device=f.device)[None]
            x = torch.zeros(1, device=f.device)
            cos, sin = rot(x, pos, lt) if own else rot(x, pos)
        except Exception:  # a rotary embedding with another signature: not ours to invert
            return None
        mine = rope_tables(f, s, SEQ_LEN, f.device)
        if cos.shape[-2:] != mine[0].shape or not all(torch.allclose(a[0].float(), b, atol=1e-4)
                                                      for a, b in zip((cos, sin), mine)):
            return None
        inv.append(f.detach().float().cpu())
        scale.append(s)
    return {"inv_freq": torch.stack(inv), "scaling": torch.tensor(scale)}


def layer_rope(rope: dict | None, layer: int) -> dict | None:
    """One layer's RoPE parameters from an artifact's per-layer table."""
    if rope is None:
        return None
    return {"inv_freq": rope["inv_freq"][layer], "scaling": float(rope["scaling"][layer])}


# --- fingerprint --------------------------------------------------------------------------------------

def fingerprint(model) -> dict:
    """What identifies a model: its shape and a hash of some of its weights (rounded to bf16, so the same
    weights loaded in fp32 or bf16 match)."""
    from .compress import ModelShape

    s = ModelShape.of(model)
    cfg = model.config.get_text_config()
    k_proj = next((p for n, p in model.named_parameters() if n.endswith("k_proj.weight")), None)
    if k_proj is None:
        raise KVSumError(f"unsupported architecture {cfg.model_type!r}: no k_proj weight to fingerprint")
    h = hashlib.sha256()
    for t in (k_proj, model.get_input_embeddings().weight[:8]):
        h.update(t.detach().to(torch.bfloat16).view(torch.int16).cpu().numpy().tobytes())
    return {"model_type": cfg.model_type, "layers": s.n_layers, "kv_heads": s.n_kv_heads,
            "head_dim": s.head_dim, "weights_sha256": h.hexdigest()[:16]}


def _fp(f: dict) -> str:
    return (f"{f['model_type']} ({f['layers']} layers, {f['kv_heads']} KV heads, head dim {f['head_dim']}, "
            f"weights {f['weights_sha256']})")


# --- fits ---------------------------------------------------------------------------------------------

@dataclass
class EchoPlan:
    """Which channels of a layer to store (`sel`), which to rebuild (`rest`), and the ridge map."""

    sel: Tensor  # (k,) long, sorted: stored channels of this layer
    rest: Tensor  # (n - k,) long: rebuilt channels
    prev: Tensor  # (k',) long: the previous layer's stored channels, used as predictors too
    mean_in: Tensor  # (k + k',) mean of the predictors [this layer's sel, previous layer's prev]
    mean_out: Tensor  # (n - k,)
    W: Tensor  # (k + k', n - k): rest = mean_out + (predictors - mean_in) @ W


def _groups(n: int, d: int, pairs: bool) -> Tensor:
    """Selection units: single channels, or RoPE pairs (j, j + d/2) of one head, so kept keys can be un-rotated."""
    if not pairs:
        return torch.arange(n)[:, None]
    first = torch.tensor([i for i in range(n) if i % d < d // 2])
    return torch.stack([first, first + d // 2], 1)


def greedy_channels(C: Tensor, k: int, groups: Tensor) -> Tensor:
    """Greedy column-subset selection: repeatedly store the unit whose exact value explains the most remaining
    variance of all channels, sum_i C_ig C_gg^-1 C_gi, then condition on it (Schur complement, one rank-1 update
    per channel). Units are single channels or pairs. In float64 numpy: a few small vector operations a step."""
    C = C.double().cpu().numpy().copy()
    g = groups.cpu().numpy()
    a, b = g[:, 0], g[:, -1]
    free = np.ones(len(g), dtype=bool)
    tiny = 1e-12 * max(float(np.mean(np.diag(C))), 1e-30)
    chosen: list[int] = []
    while len(chosen) * g.shape[1] < k:
        sq = (C * C).sum(0)  # sum_i C_ij^2 (C is symmetric)
        diag = np.diag(C)
        caa, cbb = diag[a], diag[b]
        if g.shape[1] == 2:
            cab = C[a, b]
            explained = (cbb * sq[a] - 2 * cab * np.einsum("ij,ij->j", C[:, a], C[:, b]) + caa * sq[b]) / \
                np.maximum(caa * cbb - cab * cab, tiny * tiny)
        else:
            explained = sq[a] / np.maximum(caa, tiny)
        explained[~free] = -1.0
        best = int(np.argmax(explained))
        free[best] = False
        chosen.append(best)
        for j in g[best]:
            col = C[:, j].copy()
            C -= np.outer(col, col) / max(col[j], tiny)
    return torch.from_numpy(g[chosen].flatten()).sort().values


class Artifact:
    """Calibrated moments of one model's keys and values, saved to one file, fits derived on demand.

    `stats[kind]` for kind in k_pre (keys before RoPE), k_post (keys as cached), v: `mean` (L, n), `cov` (L, n, n)
    and `cross` (L, n, n) with cross[i] = Cov(x_i, x_{i-1}) (cross[0] is zero), n = KV heads x head dim.
    These are per-model constants, not per-request memory: the methods do not charge them to a cache.
    """

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
            raise KVSumError(f"calibration artifact is for {_fp(mine)}, but the model is {_fp(theirs)}; "
                             "calibrate this model with kvsum.calibrate")

    def check_shape(self, method: str, n_layers: int, H: int, d: int) -> None:
        """What a method can check without the model: the layer shapes."""
        f = self.fingerprint
        if (f["layers"], f["kv_heads"], f["head_dim"]) != (n_layers, H, d):
            raise KVSumError(f"{method}: calibration artifact is for {_fp(f)}, but the cache has {n_layers} layers, "
                             f"{H} KV heads, head dim {d}")
        if method not in self.meta["methods"]:
            raise KVSumError(f"{method}: this artifact was calibrated for {', '.join(self.meta['methods'])}; "
                             f"run kvsum.calibrate(..., method={method!r})")

    def echo_plan(self, kind: str, layer: int, k: int, prev: Tensor) -> EchoPlan:
        """Store `k` channels of `layer`, rebuild the rest from them and the previous layer's `prev` channels."""
        key = (kind, layer, k, tuple(prev.tolist()))
        if key not in self._fits:
            self._fits[key] = self._echo_plan(kind, layer, k, prev)
        return self._fits[key]

    def _echo_plan(self, kind: str, layer: int, k: int, prev: Tensor) -> EchoPlan:
        s = self.stats[kind]
        d = self.fingerprint["head_dim"]
        mean, C = s["mean"][layer].double(), s["cov"][layer].double()
        n = C.shape[0]
        if layer > 0 and len(prev):
            Cpp = self.stats[kind]["cov"][layer - 1].double()[prev][:, prev]
            Cxp = s["cross"][layer].double()[:, prev]
            m_prev = s["mean"][layer - 1].double()[prev]
        else:
            prev = prev[:0]
            Cpp, Cxp, m_prev = C[:0, :0], C[:, :0], mean[:0]
        if k >= n:
            sel = torch.arange(n)
        else:
            # choose this layer's channels on the variance the previous layer's stored channels leave unexplained.
            ridge_p = Cpp + RIDGE * torch.diag(Cpp.diagonal())
            Cres = C - Cxp @ torch.linalg.solve(ridge_p, Cxp.T) if len(prev) else C
            sel = greedy_channels(Cres, k, _groups(n, d, pairs=kind.startswith("k")))
        keep = torch.zeros(n, dtype=torch.bool)
        keep[sel] = True
        rest = torch.arange(n)[~keep]
        # ridge regression of rest on [sel, prev], in closed form from the moments.
        Cin = torch.cat([torch.cat([C[sel][:, sel], Cxp[sel]], 1),
                         torch.cat([Cxp[sel].T, Cpp], 1)], 0)
        Cout = torch.cat([C[sel][:, rest], Cxp[rest].T], 0)
        W = torch.linalg.solve(Cin + RIDGE * torch.diag(Cin.diagonal()), Cout)
        return EchoPlan(sel, rest, prev, torch.cat([mean[sel], m_prev]).float(), mean[rest].float(), W.float())

    def lowrank_basis(self, kind: str, layers: tuple[int, ...]) -> tuple[Tensor, Tensor]:
        """PCA of the joint channels of `layers` (one, or two adjacent): mean (g*n,), basis (g*n, g*n) whose
        columns are sorted by explained variance, so the first r columns are the best rank-r basis."""
        key = ("lowrank", kind, layers)
        if key not in self._fits:
            s = self.stats[kind]
            if len(layers) == 1:
                C = s["cov"][layers[0]].double()
            elif len(layers) == 2 and layers[1] == layers[0] + 1:
                a, b = layers
                X = s["cross"][b].double()  # Cov(x_b, x_a)
                C = torch.cat([torch.cat([s["cov"][a].double(), X.T], 1),
                               torch.cat([X, s["cov"][b].double()], 1)], 0)
            else:
                raise KVSumError(f"lowrank: the artifact holds moments of adjacent layers only, not of {layers}")
            vals, vecs = torch.linalg.eigh(C)
            mean = torch.cat([s["mean"][i] for i in layers]).float()
            self._fits[key] = (mean, vecs.flip(-1).float().contiguous())
        return self._fits[key]


def artifact_of(method, name: str, n_layers: int, H: int, d: int) -> Artifact:
    """The Artifact behind a method instance's `artifact` knob, read once per instance and shape-checked."""
    knob, art = getattr(method, "_art", (None, None))
    if art is None or knob is not method.artifact:
        art = resolve(method.artifact, name)
        method._art = (method.artifact, art)
    art.check_shape(name, n_layers, H, d)
    return art


def resolve(artifact, method: str) -> Artifact:
    """An Artifact from a method's `artifact` knob (an Artifact, or a path to one)."""
    if isinstance(artifact, Artifact):
        return artifact
    if isinstance(artifact, (str, os.PathLike)):
        return Artifact.load(artifact)
    raise KVSumError(f"{method} needs artifact=<path or kvsum.calibrate.Artifact>; create one with "
                     f"kvsum.calibrate.calibrate(model, tokenizer, method={method!r}).save(path)")


# --- calibration --------------------------------------------------------------------------------------

class _Moments:
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


def _calibration_ids(tokenizer, text: str | None, ids: Tensor | None, tokens: int) -> tuple[Tensor, str]:
    if ids is not None:
        ids = ids.reshape(-1)
        source = f"token ids given ({ids.numel()})"
    else:
        if tokenizer is None:
            raise KVSumError("calibrate needs a tokenizer to encode calibration text (or ids=...)")
        if text is None:
            text = calibration_text(chars=tokens * 6)
            source = f"python {platform.python_version()} stdlib source"
        else:
            source = f"text sha256 {hashlib.sha256(text.encode()).hexdigest()[:16]}"
        ids = torch.tensor(tokenizer(text, add_special_tokens=False).input_ids)
    if ids.numel() < tokens:
        raise KVSumError(f"calibration needs tokens={tokens} tokens but the text has {ids.numel()}; "
                         "give more text or fewer tokens")
    return ids[:tokens], source


@torch.no_grad()
def calibrate(model, tokenizer=None, text: str | None = None, method: str = "all", tokens: int = DEFAULT_TOKENS,
              progress: bool = True, *, ids: Tensor | None = None, seq_len: int = SEQ_LEN) -> Artifact:
    """Calibrate `method` ("echokv", "lowrank" or "all") for `model` on `tokens` tokens of `text` (default: stdlib
    source, see the module docstring) or of token `ids`, in forward passes of `seq_len` tokens.

    Returns an Artifact (save it with `.save(path)`). Its meta records the model fingerprint, the calibration
    time, the artifact's size in bytes and the calibration knobs.
    """
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from .compress import ModelShape, prefill

    if method not in METHODS:
        raise KVSumError(f"calibrate: method {method!r}; accepted: {', '.join(METHODS)}")
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 2:
        raise KVSumError(f"calibrate: tokens must be an integer >= 2, got {tokens!r}")
    start = time.perf_counter()
    ids, source = _calibration_ids(tokenizer, text, ids, tokens)
    shape = ModelShape.of(model)
    windows = [w for w in shape.windows if w is not None]
    # sliding-window layers hold only their window: chunks no longer than it give every layer the same tokens
    # (only global layers are compressed; their moments are what the methods use)
    seq_len = max(2, min([seq_len, shape.max_len] + [w - 1 for w in windows]))
    L, H, d = shape.n_layers, shape.n_kv_heads, shape.head_dim
    rope = rope_of(model, d, L)
    kinds = (["k_pre"] if rope else []) + (["k_post"] if method != "echokv" or not rope else []) + ["v"]
    acc = {kind: _Moments(L, H * d) for kind in kinds}
    device = next(model.parameters()).device
    chunks = [ids[i:i + seq_len] for i in range(0, len(ids), seq_len)]
    chunks = [c for c in chunks if len(c) >= 2]
    columns = (TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total} tokens"),
               TimeElapsedColumn())
    with Progress(*columns, disable=not progress, transient=True) as bar:
        task = bar.add_task(f"calibrating {method} on {shape.n_layers} layers", total=sum(map(len, chunks)))
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
            bar.advance(task, len(chunk))
    stats = {kind: a.finish() for kind, a in acc.items()}
    knobs = {"tokens": len(ids), "seq_len": seq_len, "ridge": RIDGE, "skip": SKIP, "text": source}
    meta = {"fingerprint": fingerprint(model), "methods": ["echokv", "lowrank"] if method == "all" else [method],
            "knobs": knobs, "n_knobs": len(knobs), "key_space": "k_pre" if rope else "k_post"}
    art = Artifact(meta, stats, rope)
    meta["seconds"] = round(time.perf_counter() - start, 2)
    meta["nbytes"] = art.nbytes()
    return art
