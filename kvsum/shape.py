"""`ModelShape`: what kvsum needs to know about a model's attention, read once from its config and modules."""

from __future__ import annotations

import hashlib
import weakref
from dataclasses import dataclass

import torch
from transformers.cache_utils import get_layer_types_and_kwargs

from .budget import full_nbytes
from .errors import KVSumError


@dataclass
class ModelShape:
    """Layer count, KV heads, head size, context window, per-layer attention scales and sliding windows.

    Attributes:
        n_layers: decoder layers.
        n_kv_heads: key/value heads per layer.
        head_dim: size of one head.
        max_len: the model's context window (max_position_embeddings).
        scales: attention scale of every layer.
        windows: sliding window of every layer, None for global layers (all None when not given).
        key_bias: the key projection adds a bias (Qwen2): a constant key before RoPE, which turns with the position.
    """

    n_layers: int
    n_kv_heads: int
    head_dim: int
    max_len: int
    scales: list[float]
    windows: list[int | None] = None
    key_bias: bool = False

    def __post_init__(self):
        self.windows = self.windows or [None] * self.n_layers

    @property
    def global_layers(self) -> list[int]:
        """The layers kvsum compresses: those without a sliding window."""
        return [i for i, w in enumerate(self.windows) if w is None]

    def reference_nbytes(self, tokens: int, bits: int = 16) -> tuple[int, int]:
        """(all layers, global layers) bytes of the full cache of `tokens` tokens at `bits` per element,
        sliding layers counted as transformers holds them (at most window - 1 tokens)."""
        glob = full_nbytes(len(self.global_layers), self.n_kv_heads, self.head_dim, tokens, bits)
        win = sum(full_nbytes(1, self.n_kv_heads, self.head_dim, min(tokens, w - 1), bits) for w in self.windows if w)
        return glob + win, glob

    @classmethod
    def of(cls, model) -> ModelShape:
        """The shape of a transformers causal LM; a KVSumError names what kvsum does not support."""
        cfg = getattr(model, "config", None)
        if cfg is None or not hasattr(cfg, "get_text_config"):
            raise KVSumError(f"model must be a transformers causal LM, got {type(model).__name__}")
        cfg = cfg.get_text_config(decoder=True)
        if getattr(cfg, "num_key_value_heads", None) is None:
            raise KVSumError(f"unsupported architecture {cfg.model_type!r}: no num_key_value_heads in its config")
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        attn = {m.layer_idx: m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "scaling")}
        if len(attn) != cfg.num_hidden_layers:
            raise KVSumError(f"unsupported architecture {cfg.model_type!r}: cannot find its attention modules")
        if getattr(cfg, "attn_logit_softcapping", None):
            raise KVSumError(f"unsupported architecture {cfg.model_type!r}: attention logit soft-capping")
        types, kwargs = get_layer_types_and_kwargs(cfg)
        windows = []
        for i, (kind, kw) in enumerate(zip(types, kwargs)):
            if kind not in ("full_attention", "sliding_attention"):
                raise KVSumError(f"unsupported architecture {cfg.model_type!r}: layer {i} is {kind!r}; "
                                 "accepted layer types: 'full_attention', 'sliding_attention'")
            windows.append(kw.get("sliding_window") if kind == "sliding_attention" else None)
        key_bias = any(getattr(getattr(m, "k_proj", None), "bias", None) is not None for m in attn.values())
        return cls(cfg.num_hidden_layers, cfg.num_key_value_heads, head_dim,
                   getattr(cfg, "max_position_embeddings", 1 << 30),
                   [float(attn[i].scaling) for i in range(cfg.num_hidden_layers)], windows, key_bias)


# model -> (stamp of the hashed weights, fingerprint); weak keys: the entry goes with the model
_FINGERPRINTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def fingerprint(model, strict: bool = True) -> dict | None:
    """What identifies a model: its shape and a hash of some of its weights (rounded to bf16, so the same
    weights loaded in fp32 or bf16 match). Per-model artifacts (kvsum.calibrate) are checked and found by it.

    Computed once per model and weights: a weak-keyed cache holds it while the hashed tensors are unchanged
    (same storage, no in-place write). Without `strict`, None where it cannot be computed (no k_proj weight,
    weights on the meta device) instead of a KVSumError."""
    k_proj = next((p for n, p in model.named_parameters() if n.endswith("k_proj.weight")), None)
    if k_proj is None:
        if not strict:
            return None
        ModelShape.of(model)  # what kvsum does not support at all is said first
        cfg = model.config.get_text_config()
        raise KVSumError(f"unsupported architecture {cfg.model_type!r}: no k_proj weight to fingerprint")
    emb = model.get_input_embeddings().weight
    if not strict and "meta" in (k_proj.device.type, emb.device.type):
        return None
    stamp = tuple((t.data_ptr(), t._version, t.dtype, t.device) for t in (k_proj, emb))
    hit = _FINGERPRINTS.get(model)
    if hit is not None and hit[0] == stamp:
        return dict(hit[1])
    s = ModelShape.of(model)
    h = hashlib.sha256()
    for t in (k_proj, emb[:8]):
        h.update(t.detach().to(torch.bfloat16).view(torch.int16).cpu().numpy().tobytes())
    fp = {"model_type": model.config.get_text_config().model_type, "layers": s.n_layers, "kv_heads": s.n_kv_heads,
          "head_dim": s.head_dim, "weights_sha256": h.hexdigest()[:16]}
    _FINGERPRINTS[model] = (stamp, fp)
    return dict(fp)
