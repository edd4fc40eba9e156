"""Compressed prompt prefixes of paged KV in a `kvsum.Store`: keys, lookups, and save / load of page slots.

What `kvsum.integrations.vllm.KvsumConnector` does that does not need vLLM: name a prefix of token ids (one
entry per prefix in whole pages, keyed by the served model, the method, the budget and the ids), find the
longest stored prefix of a prompt, gather a prefix's KV from paged buffers and store it compressed, and write
the rebuilt KV back into page slots.

Pages are vLLM's per-layer buffers, (blocks, kv_heads, block_size, 2 * head_dim): a token's slot is
block_id * block_size + offset, its key the first head_dim channels, its value the rest
(vllm/v1/attention/backends/flash_attn.py and cpu_attn.py split them so).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..errors import KVSumError
from ..spec import format_value
from . import codec


def slots(block_ids: list[int], block_size: int, start: int, stop: int) -> Tensor:
    """The page slots of tokens [start, stop) of a request whose pages are `block_ids`, in token order."""
    if stop > len(block_ids) * block_size:
        raise KVSumError(f"tokens up to {stop} need {-(-stop // block_size)} pages, the request has {len(block_ids)}")
    pos = torch.arange(start, stop)
    return torch.as_tensor(block_ids, dtype=torch.long)[pos // block_size] * block_size + pos % block_size


def gather(pages: Tensor, slot: Tensor) -> tuple[Tensor, Tensor]:
    """Keys and values (H, n, d) of the given slots of one layer's pages (blocks, H, block_size, 2d)."""
    block_size = pages.shape[2]
    kv = pages[slot // block_size, :, slot % block_size]  # (n, H, 2d)
    d = kv.shape[-1] // 2
    return kv[..., :d].transpose(0, 1), kv[..., d:].transpose(0, 1)


def scatter(pages: Tensor, slot: Tensor, keys: Tensor, values: Tensor) -> None:
    """Write keys and values (H, n, d) into the given slots of one layer's pages, in the pages' dtype."""
    block_size = pages.shape[2]
    kv = torch.cat([keys, values], -1).transpose(0, 1).to(pages.dtype)  # (n, H, 2d)
    pages[slot.to(pages.device) // block_size, :, slot.to(pages.device) % block_size] = kv.to(pages.device)


def layer_order(names) -> dict[str, int]:
    """Layer name -> its index among the attention layers, by the layer number in the name
    ("model.layers.12.self_attn.attn" -> 12), ties and names without one after, by name."""
    def number(name: str) -> tuple[int, str]:
        found = re.search(r"(?:^|\.)(\d+)(?:\.|$)", name)
        return (int(found.group(1)) if found else 1 << 30, name)

    return {name: i for i, name in enumerate(sorted(set(names), key=number))}


@dataclass
class Transfer:
    """One request's load or save: the entry `key`, tokens [start, stop) of its prefix and their page slots."""

    req_id: str
    key: str
    start: int
    stop: int
    slots: Tensor = field(repr=False)


class PrefixStore:
    """Compressed prefixes of one served model in a kvsum.Store directory.

    Args:
        directory: the Store's directory (None: kvsum.store.default_directory()).
        model: the served model's name, part of every key and of the entries' layout fingerprint.
        method, budget, storage_dtype: how prefixes are compressed (kvsum.integrations.codec.compress_kv).
        block_size: tokens per page; prefixes are whole pages.
        max_bytes: the Store's bound (least recently used entries go first).
    """

    def __init__(self, directory=None, model: str = "", method: str = codec.DEFAULT_METHOD, budget: float = 1.0,
                 block_size: int = 16, max_bytes: int | None = None, storage_dtype: torch.dtype = torch.float16):
        from ..store import Store

        self.method = codec.codec_method(method)
        self.store = Store(directory, max_bytes=max_bytes)
        self.model, self.budget, self.block_size = str(model), float(budget), block_size
        self.storage_dtype = storage_dtype
        what = [self.model, format_value(self.method), self.budget, str(storage_dtype), block_size]
        self._root = hashlib.sha256(json.dumps(what).encode()).digest()

    def keys(self, ids, pages: int) -> list[str]:
        """The keys of the prefixes of `ids` of 1, 2, ..., `pages` whole pages (a chained hash: one pass)."""
        ids = torch.as_tensor(list(ids)[:pages * self.block_size], dtype=torch.int64).numpy()
        out, h = [], self._root
        for p in range(pages):
            h = hashlib.sha256(h + ids[p * self.block_size:(p + 1) * self.block_size].tobytes()).digest()
            out.append(h.hex()[:32])
        return out

    def key(self, ids, tokens: int) -> str:
        """The key of the first `tokens` ids (a whole number of pages)."""
        if tokens <= 0 or tokens % self.block_size:
            raise KVSumError(f"a stored prefix is whole pages of {self.block_size} tokens, got {tokens}")
        return self.keys(ids, tokens // self.block_size)[-1]

    def has(self, key: str) -> bool:
        return self.store.path(key).exists()

    def longest(self, ids, limit: int) -> tuple[int, str | None]:
        """The longest stored prefix of `ids` of at most `limit` tokens: (its tokens, its key), or (0, None)."""
        pages = max(0, min(limit, len(ids))) // self.block_size
        for n, key in reversed(list(enumerate(self.keys(ids, pages), 1))):
            if self.has(key):
                return n * self.block_size, key
        return 0, None

    def fingerprint(self, n_layers: int, kv_heads: int, head_dim: int) -> dict:
        return codec.layout(self.model, n_layers, kv_heads, head_dim)

    def save(self, key: str, layers: list[tuple[Tensor, Tensor]]) -> None:
        """Compress one prefix's per-layer keys and values (H, n, d) and store it as `key` (atomically)."""
        H, _, d = layers[0][0].shape
        cache = codec.compress_kv([k for k, _ in layers], [v for _, v in layers], self.method, self.budget,
                                  fingerprint=self.fingerprint(len(layers), H, d), storage_dtype=self.storage_dtype)
        self.store.put(key, cache)

    def load(self, key: str, n_layers: int, kv_heads: int, head_dim: int) -> list[tuple[Tensor, Tensor]] | None:
        """The rebuilt per-layer keys and values (H, n, d) fp32 of entry `key`, None if it is gone (evicted
        meanwhile); KVSumError if it does not check (altered, another model's or shape's)."""
        cache = self.store.get(key, fingerprint=self.fingerprint(n_layers, kv_heads, head_dim))
        if cache is None:
            return None
        return codec.dense_kv(cache)
