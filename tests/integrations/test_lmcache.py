"""kvsum/integrations/lmcache.py: the "kvsum" serde for LMCache's storage backends.

The serde's contract is LMCache's (lmcache/v1/distributed/serde/base.py, lmcache 0.5.6): `serialize(src, dst,
key) -> bytes written` into a uint8 buffer of `estimate_serialized_size(layout)` bytes, `deserialize(src, dst,
key)` back into a KV_2LTD chunk (2, layers, tokens, kv_heads * head_dim). The first tests drive the serde
through objects exposing `.tensor` only, as LMCache's own serde tests do (tests/v1/distributed/serde/
test_fp8.py's _FakeMemoryObj), so they run without lmcache; those marked by `lmcache` use LMCache's real classes
(TensorMemoryObj, register_serde_factory, create_serde_processor, AsyncSerdeProcessor) and are skipped where
lmcache is not installed.
"""

import select
import time
from dataclasses import dataclass

import pytest
import torch
from transformers import DynamicCache

import kvsum
from kvsum.integrations import codec
from kvsum.integrations.lmcache import MARGIN, KvsumDeserializer, KvsumSerializer
from tests.helpers import greedy, random_ids, tiny_llama

METHOD = "turboquant:bits=4,key_shift=0"


@dataclass
class Obj:
    """Stand-in for an LMCache MemoryObj: the serde reads and writes `.tensor` only (as in LMCache's tests)."""

    tensor: torch.Tensor


@dataclass
class Key:
    """Stand-in for lmcache's ObjectKey: the serde reads `model_name` only."""

    model_name: str = "tiny"


class Layout:
    def __init__(self, shape, dtype):
        self.shapes, self.dtypes = [torch.Size(shape)], [dtype]


def chunk(model, ids, dtype=torch.float32):
    """The prompt's KV as LMCache holds one chunk of it: KV_2LTD (2, layers, tokens, kv_heads * head_dim)."""
    with torch.no_grad():
        layers = model(ids, use_cache=True).past_key_values.layers
    kv = [torch.stack([layer.keys[0], layer.values[0]]) for layer in layers]  # (2, H, T, d) each
    kv = torch.stack(kv, 1)  # (2, L, H, T, d)
    return kv.transpose(2, 3).reshape(2, kv.shape[1], kv.shape[3], -1).to(dtype).contiguous()


def as_cache(model, kv, head_dim=16):
    """A DynamicCache holding a KV_2LTD chunk (what an engine's pages hold after LMCache loads it)."""
    cache = DynamicCache(config=model.config)
    L, T, D = kv.shape[1:]
    for i in range(L):
        k, v = (kv[j, i].reshape(T, D // head_dim, head_dim).transpose(0, 1)[None].to(model.dtype) for j in (0, 1))
        cache.update(k.contiguous(), v.contiguous(), i)
    return cache


def round_trip(kv, key=None, method=METHOD):
    ser, de = KvsumSerializer(16, method), KvsumDeserializer(16)
    buf = Obj(torch.zeros(ser.estimate_serialized_size(Layout(kv.shape, kv.dtype)), dtype=torch.uint8))
    n = ser.serialize(Obj(kv), buf, key)
    out = Obj(torch.zeros_like(kv))
    de.deserialize(buf, out, key)
    return buf.tensor, n, out.tensor


def test_a_chunk_comes_back_as_the_kv_kvsum_attends_over_and_greedy_generation_is_bit_identical():
    model, ids = tiny_llama(), random_ids(256, 1)
    kv = chunk(model, ids)
    buf, n, back = round_trip(kv, Key())
    assert n == buf.numel()  # the whole buffer (LMCache's fs adapter reads back the estimated size)
    ref = kvsum.compress(model, ids, method="turboquant", budget=1.0, bits=4, key_shift=0)
    expected = codec.dense_kv(ref)
    for i, (k, v) in enumerate(expected):  # the pages hold exactly what kvsum's compressed cache attends over
        assert torch.equal(back[0, i], k.transpose(0, 1).reshape(256, 32))
        assert torch.equal(back[1, i], v.transpose(0, 1).reshape(256, 32))
    assert len(codec.unframe(buf)) < 0.5 * kv.numel() * 2  # vs 16 bits: 4-bit codes, norms, rotation, a header
    full = torch.cat([ids, random_ids(6, 2)], -1)
    assert torch.equal(greedy(model, full, as_cache(model, back), steps=12), greedy(model, full, ref, steps=12))


def test_a_half_precision_chunk_round_trips_in_its_dtype():
    kv = chunk(tiny_llama(), random_ids(64, 1), torch.bfloat16)
    _, _, back = round_trip(kv)
    assert back.dtype == torch.bfloat16 and (back.float() - kv.float()).abs().max() < 0.5 * kv.float().abs().max()


def test_the_estimate_bounds_the_payload_tightly():
    kv = chunk(tiny_llama(), random_ids(128, 1))
    buf, _, _ = round_trip(kv, Key("a-much-longer/model-name-than-the-probe's"))
    n = 8 + len(codec.unframe(buf))
    assert n <= buf.numel() <= n + MARGIN and bool((buf[n:] == 0).all())


def test_a_corrupted_payload_raises_and_writes_nothing():
    kv = chunk(tiny_llama(), random_ids(64, 1))
    ser, de = KvsumSerializer(16), KvsumDeserializer(16)
    buf = torch.zeros(ser.estimate_serialized_size(Layout(kv.shape, kv.dtype)), dtype=torch.uint8)
    ser.serialize(Obj(kv), Obj(buf), Key())
    n = 8 + len(codec.unframe(buf))
    for where in (n - 3, n // 2, 20):  # a code byte, the middle, the header
        bad = buf.clone()
        bad[where] ^= 0x10
        out = torch.full_like(kv, 7.0)
        with pytest.raises(kvsum.KVSumError):
            de.deserialize(Obj(bad), Obj(out), Key())
        assert bool((out == 7.0).all())
    with pytest.raises(kvsum.KVSumError, match="another model"):  # another model's chunk under the same hash
        de.deserialize(Obj(buf), Obj(torch.zeros_like(kv)), Key("another-model"))
    with pytest.raises(kvsum.KVSumError):  # another shape
        de.deserialize(Obj(buf), Obj(torch.zeros(2, 2, 32, 32)), Key())


def test_bad_configurations_are_refused_up_front():
    for method in ("snapkv", "summary", "turboquant"):  # turboquant's default key_shift needs queries
        with pytest.raises(kvsum.KVSumError):
            KvsumSerializer(16, method)
    with pytest.raises(kvsum.KVSumError):
        KvsumSerializer(0)
    with pytest.raises(kvsum.KVSumError, match="KV_2LTD"):
        KvsumSerializer(16).serialize(Obj(torch.zeros(2, 2, 8, 30)), Obj(torch.zeros(10**5, dtype=torch.uint8)))


# ---- LMCache's own classes ---------------------------------------------------------------------------------


def _memory_obj(tensor):
    from lmcache.v1.memory_management import MemoryFormat, MemoryObjMetadata, TensorMemoryObj

    fmt = MemoryFormat.KV_2LTD if tensor.dim() == 4 else MemoryFormat.BINARY_BUFFER
    raw = tensor.contiguous().view(-1).view(torch.uint8)
    meta = MemoryObjMetadata(tensor.shape, tensor.dtype, 0, raw.numel(), 1, fmt=fmt, shapes=[tensor.shape],
                             dtypes=[tensor.dtype])
    return TensorMemoryObj(raw, meta, None)


def _wait(fd, timeout=20.0):
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if poller.poll(100):
            return True
    return False


def _result(query, task, fd):
    assert _wait(fd), "LMCache's serde processor never signalled"
    for _ in range(200):
        r = query(task)
        if r is not None:
            return r
        time.sleep(0.01)
    raise AssertionError("no result")


def test_through_lmcaches_serde_factory_and_async_processor():
    pytest.importorskip("lmcache")
    from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey
    from lmcache.v1.distributed.serde import (
        Deserializer,
        SerdeConfig,
        Serializer,
        create_serde_processor,
        get_registered_serde_types,
        serialized_layout_desc,
    )

    from kvsum.integrations import lmcache as kl

    assert issubclass(KvsumSerializer, Serializer) and issubclass(KvsumDeserializer, Deserializer)
    kl.register()
    assert "kvsum" in get_registered_serde_types() and kl.register() is False  # a second call is a no-op
    proc = create_serde_processor(SerdeConfig(type="kvsum", kwargs={"head_dim": 16, "method": METHOD}))
    try:
        model, ids = tiny_llama(), random_ids(256, 1)
        kv = chunk(model, ids)
        key = ObjectKey(chunk_hash=b"\x01" * 32, model_name="tiny", kv_rank=0)
        layout = serialized_layout_desc(MemoryLayoutDesc(shapes=[kv.shape], dtypes=[kv.dtype]), proc)
        buf = torch.zeros(layout.shapes[0], dtype=torch.uint8)
        task = proc.submit_serialize([_memory_obj(kv)], [_memory_obj(buf)], [key])
        assert _result(proc.query_serialize_result, task, proc.get_serialize_event_fd()) is True
        out = torch.zeros_like(kv)
        task = proc.submit_deserialize([_memory_obj(buf)], [_memory_obj(out)], [key])
        assert _result(proc.query_deserialize_result, task, proc.get_deserialize_event_fd()) is True
        ref = kvsum.compress(model, ids, method="turboquant", budget=1.0, bits=4, key_shift=0)
        full = torch.cat([ids, random_ids(6, 2)], -1)
        assert torch.equal(greedy(model, full, as_cache(model, out), steps=12), greedy(model, full, ref, steps=12))
        buf[buf.numel() // 3] ^= 0x10  # altered in storage: LMCache sees the task fail, the chunk untouched
        spoiled = torch.full_like(kv, 7.0)
        task = proc.submit_deserialize([_memory_obj(buf)], [_memory_obj(spoiled)], [key])
        assert _result(proc.query_deserialize_result, task, proc.get_deserialize_event_fd()) is False
        assert bool((spoiled == 7.0).all())
    finally:
        proc.close()


def test_lmcaches_filesystem_backend_carries_kvsum_chunks(tmp_path):
    """LMCache's StorageManager with its filesystem L2 adapter and the "kvsum" serde, on CPU: a chunk written to
    L1 is stored on disk as kvsum bytes, L1 is cleared, a prefetch loads it back; then a byte altered on disk
    makes the prefetch a miss (the engine recomputes), never wrong KV."""
    pytest.importorskip("lmcache")
    from lmcache.v1.distributed.api import GroupedObjectKeys, MemoryLayoutDesc, ObjectKey, PrefetchTaskSpec
    from lmcache.v1.distributed.config import (
        EvictionConfig,
        L1ManagerConfig,
        L1MemoryManagerConfig,
        StorageManagerConfig,
    )
    from lmcache.v1.distributed.l2_adapters.config import L2AdaptersConfig
    from lmcache.v1.distributed.l2_adapters.fs_l2_adapter import FSL2AdapterConfig
    from lmcache.v1.distributed.serde import SerdeConfig
    from lmcache.v1.distributed.storage_manager import StorageManager

    from kvsum.integrations import lmcache as kl

    kl.register()
    fs = FSL2AdapterConfig(base_path=str(tmp_path), relative_tmp_dir=None, read_ahead_size=None, use_odirect=False)
    fs.serde_config = SerdeConfig(type="kvsum", kwargs={"head_dim": 16, "method": METHOD})
    memory = L1MemoryManagerConfig(size_in_bytes=64 << 20, use_lazy=False, init_size_in_bytes=32 << 20)
    sm = StorageManager(StorageManagerConfig(l1_manager_config=L1ManagerConfig(memory_config=memory),
                                             eviction_config=EvictionConfig(eviction_policy="LRU"),
                                             l2_adapter_config=L2AdaptersConfig(adapters=[fs])))
    try:
        model, ids = tiny_llama(), random_ids(256, 1)
        kv = chunk(model, ids)
        layout = MemoryLayoutDesc(shapes=[kv.shape], dtypes=[kv.dtype])
        keys = [ObjectKey(chunk_hash=b"\x00" * 31 + b"\x01", model_name="tiny", kv_rank=0)]
        sm.reserve_write(keys, layout)[keys[0]].tensor.view(kv.shape).view(kv.dtype).copy_(kv)
        sm.finish_write(keys)
        assert _until(lambda: sm.report_status()["store_controller"]["in_flight_task_count"] == 0
                      and any(p.is_file() for p in tmp_path.iterdir()))
        (path,) = [p for p in tmp_path.iterdir() if p.is_file()]
        assert path.stat().st_size < 0.3 * kv.numel() * kv.element_size()  # vs the fp32 chunk in L1

        def prefetch():
            sm.clear(force=True)
            spec = PrefetchTaskSpec(key_groups=[GroupedObjectKeys(keys=keys, object_group_id=0, layout_desc=layout)])
            handle = sm.submit_prefetch_task(spec)
            result = []
            assert _until(lambda: result.append(sm.query_prefetch_status(handle)) or result[-1] is not None)
            return result[-1]

        assert prefetch().hit_cells[0].count_leading_ones() == 1
        with sm.read_prefetched_results(keys) as objs:
            got = objs[0].tensor.view(kv.shape).view(kv.dtype).clone()
        sm.finish_read_prefetched(keys)
        ref = kvsum.compress(model, ids, method="turboquant", budget=1.0, bits=4, key_shift=0)
        full = torch.cat([ids, random_ids(6, 2)], -1)
        assert torch.equal(greedy(model, full, as_cache(model, got), steps=12), greedy(model, full, ref, steps=12))

        data = bytearray(path.read_bytes())
        data[len(data) // 3] ^= 0x10
        path.write_bytes(bytes(data))
        assert prefetch().hit_cells[0].count_leading_ones() == 0
    finally:
        sm.close()


def _until(predicate, timeout=20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False
