"""A serde for LMCache's storage backends: KV chunks stored as kvsum's compressed bytes.

LMCache (lmcache.v1.distributed) moves KV between its L1 memory and its L2 adapters (local disk, Redis, S3, peers,
...); an adapter configured with a `"serde"` runs a `Serializer` before it stores a chunk and a `Deserializer`
after it loads one (lmcache/v1/distributed/serde/base.py; the adapter's JSON spec names the serde's registered
type, lmcache/v1/distributed/l2_adapters/config.py). This module's serde codes each chunk with a kvsum
quantizer (kvsum.integrations.codec): what LMCache stores and ships between machines is a .kvsum file (packed
codes stay packed, a SHA-256 over everything), and what comes back into L1 is full-precision KV, one key and
value per token, the dequantized codes kvsum's own cache attends over. A payload altered in storage or in flight
is refused (KVSumError: LMCache's serde processor reports the task failed), never loaded as wrong KV.

    import kvsum.integrations.lmcache as kl
    kl.register()   # the serde type "kvsum", once per process, before LMCache reads its adapter config
    # an L2 adapter spec:  {"type": "fs", "base_path": "/cache",
    #                       "serde": {"type": "kvsum", "head_dim": 128, "method": "turboquant:bits=4,key_shift=0"}}

Chunk layout: LMCache's KV_2LTD, one tensor (2, layers, tokens, kv_heads * head_dim) per chunk. Written against
lmcache 0.5.6 (serialize/deserialize take the chunk's ObjectKey; older releases without it work too).
"""

from __future__ import annotations

import math

import torch

from ..errors import KVSumError
from . import codec

try:  # the real bases when LMCache is installed; the classes below work on any object with a `.tensor`
    from lmcache.v1.distributed.serde.base import Deserializer, Serializer
except ImportError:  # pragma: no cover - exercised where lmcache is absent
    Serializer = Deserializer = object

TYPE = "kvsum"  # the serde type name in LMCache's adapter config
MARGIN = 4096  # bytes over a chunk's measured payload: the header's variable text (model name, numbers)


def _tensor(obj, role: str) -> torch.Tensor:
    t = getattr(obj, "tensor", None)
    if t is None:
        raise KVSumError(f"kvsum serde: the {role} memory object has no tensor")
    return t


def _split(kv: torch.Tensor, head_dim: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """A KV_2LTD chunk (2, L, T, H * d) -> per-layer keys and values (H, T, d)."""
    if kv.dim() != 4 or kv.shape[0] != 2 or kv.shape[-1] % head_dim:
        raise KVSumError(f"kvsum serde: a chunk of shape {tuple(kv.shape)}; expected LMCache's KV_2LTD layout "
                         f"(2, layers, tokens, kv_heads * head_dim) with head_dim={head_dim}")
    L, T, D = kv.shape[1:]
    heads = kv.reshape(2, L, T, D // head_dim, head_dim).transpose(2, 3)  # (2, L, H, T, d)
    return list(heads[0].unbind(0)), list(heads[1].unbind(0))


def _fingerprint(key, kv_shape, head_dim: int) -> dict:
    _, L, _, D = kv_shape
    return codec.layout(getattr(key, "model_name", "") or "", L, D // head_dim, head_dim)


class KvsumSerializer(Serializer):
    """LMCache Serializer: a KV chunk -> kvsum bytes (a length, then a .kvsum file) in the destination buffer.

    Args:
        head_dim: the model's head dimension (the chunk's last axis is kv_heads * head_dim).
        method: a token-aligned kvsum quantizer spec (kvsum.integrations.codec.codec_method says which).
        budget: a bound on its bytes, as in kvsum.compress (1.0: the quantizer's `bits` alone decide).
        storage_dtype: the dtype of tokens kept exact (sinks, windows, residual groups).
    """

    def __init__(self, head_dim: int, method: str = codec.DEFAULT_METHOD, budget: float = 1.0,
                 storage_dtype: torch.dtype = torch.float16):
        if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim <= 0:
            raise KVSumError(f"kvsum serde: head_dim must be a positive int, got {head_dim!r}")
        self.head_dim, self.method, self.budget, self.storage_dtype = head_dim, method, budget, storage_dtype
        codec.codec_method(method)  # a method that cannot code chunks fails at configuration, not per chunk
        self._sizes: dict[tuple, int] = {}

    def payload(self, kv: torch.Tensor, key=None) -> bytes:
        """The framed kvsum bytes of one KV_2LTD chunk."""
        keys, values = _split(kv, self.head_dim)
        cache = codec.compress_kv(keys, values, self.method, self.budget, storage_dtype=self.storage_dtype,
                                  fingerprint=_fingerprint(key, kv.shape, self.head_dim))
        return codec.frame(codec.encode(cache))

    def serialize(self, src, dst, key=None) -> int:
        data = self.payload(_tensor(src, "source"), key)
        out = _tensor(dst, "destination").view(-1).view(torch.uint8)
        if len(data) > out.numel():
            raise KVSumError(f"kvsum serde: {len(data)} bytes do not fit the {out.numel()}-byte buffer "
                             "estimate_serialized_size asked for")
        out[:len(data)].copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        out[len(data):].zero_()
        # The whole buffer, not len(data): LMCache 0.5.6's filesystem adapter stores what serialize reports but reads
        # a chunk back into a buffer of the estimated size and takes a shorter file for a miss ("Incomplete read").
        # The frame's length field tells the deserializer where the payload ends.
        return out.numel()

    def estimate_serialized_size(self, layout_desc) -> int:
        """The chunk's payload size, measured once per layout on a random chunk of that shape (a quantizer's
        bytes depend on the shape alone), plus MARGIN. LMCache's L2 adapter stores the whole buffer, so a
        tight estimate is what keeps the storage saving."""
        if len(layout_desc.shapes) != 1:
            raise KVSumError(f"kvsum serde: {len(layout_desc.shapes)} object groups; use LMCache's multi serde")
        shape, dtype = tuple(int(n) for n in layout_desc.shapes[0]), layout_desc.dtypes[0]
        if (shape, dtype) not in self._sizes:
            probe = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(dtype)
            self._sizes[shape, dtype] = len(self.payload(probe)) + MARGIN
        return self._sizes[shape, dtype]


class KvsumDeserializer(Deserializer):
    """LMCache Deserializer: kvsum bytes -> the chunk's full-precision KV, in the destination's layout and dtype.

    Args:
        head_dim: the model's head dimension, as given to the serializer.
    """

    def __init__(self, head_dim: int):
        if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim <= 0:
            raise KVSumError(f"kvsum serde: head_dim must be a positive int, got {head_dim!r}")
        self.head_dim = head_dim

    def kv(self, buffer: torch.Tensor, shape, key=None, device="cpu") -> torch.Tensor:
        """The fp32 KV_2LTD chunk of `shape` in a buffer `serialize` filled; KVSumError for altered bytes,
        another model's or another shape's."""
        raw = buffer.contiguous().view(-1).view(torch.uint8)
        data = codec.unframe(memoryview(raw.cpu().numpy()))
        cache = codec.decode(data, _fingerprint(key, shape, self.head_dim) if key is not None else None, device)
        layers = codec.dense_kv(cache)
        _, L, T, D = shape
        if len(layers) != L or any(k.shape != (D // self.head_dim, T, self.head_dim) for k, _ in layers):
            raise KVSumError(f"kvsum serde: the payload holds {len(layers)} layers of "
                             f"{tuple(layers[0][0].shape) if layers else ()}, the chunk wants {tuple(shape)}")
        k = torch.stack([k for k, _ in layers]).transpose(1, 2).reshape(L, T, D)  # (L, H, T, d) -> (L, T, H * d)
        v = torch.stack([v for _, v in layers]).transpose(1, 2).reshape(L, T, D)
        return torch.stack([k, v])

    def deserialize(self, src, dst, key=None) -> None:
        out = _tensor(dst, "destination")
        out.copy_(self.kv(_tensor(src, "source"), tuple(out.shape), key, out.device).to(out.dtype))


def processor(kwargs: dict) -> object:
    """LMCache's serde factory for type "kvsum": an AsyncSerdeProcessor over the classes above. kwargs (the
    adapter's "serde" dict less "type"): head_dim (required), method, budget, storage_dtype, max_workers."""
    from lmcache.v1.distributed.serde.async_processor import AsyncSerdeProcessor

    if "head_dim" not in kwargs:
        raise KVSumError('kvsum serde: the "serde" config needs "head_dim" (the model\'s head dimension)')
    head_dim = int(kwargs["head_dim"])
    storage = getattr(torch, str(kwargs.get("storage_dtype", "float16")), None)
    if not isinstance(storage, torch.dtype):
        raise KVSumError(f"kvsum serde: storage_dtype {kwargs.get('storage_dtype')!r} is not a torch dtype")
    budget = float(kwargs.get("budget", 1.0))
    if not math.isfinite(budget):
        raise KVSumError(f"kvsum serde: budget must be a fraction in (0, 1], got {kwargs.get('budget')!r}")
    ser = KvsumSerializer(head_dim, str(kwargs.get("method", codec.DEFAULT_METHOD)), budget, storage)
    return AsyncSerdeProcessor(ser, KvsumDeserializer(head_dim), max_workers=int(kwargs.get("max_workers", 1)))


def register(name: str = TYPE) -> bool:
    """Register the serde with LMCache under `name` (its adapters' `"serde": {"type": name, ...}`); returns False
    when that name is already registered (a second call), True when this call registered it."""
    from lmcache.v1.distributed.serde.factory import get_registered_serde_types, register_serde_factory

    if name in get_registered_serde_types():
        return False
    register_serde_factory(name, processor)
    return True
