"""kvsum/integrations/vllm.py (and prefix.py): KvsumConnector, vLLM's KVConnectorBase_V1 over a kvsum.Store.

Driven as vLLM's own connector unit tests drive a connector (tests/v1/kv_connector/unit in vLLM): the scheduler-
side calls (`on_new_request`, `get_num_new_matched_tokens`, `update_state_after_alloc`, `build_connector_meta`)
with requests and scheduler outputs, then the worker-side calls (`bind_connector_metadata`, `save_kv_layer`,
`wait_for_save`, `start_load_kv`) on paged buffers laid out as vLLM's (blocks, kv_heads, block_size, 2 *
head_dim), on CPU with the tiny test model. Where vllm is importable, its own classes are used (the connector's
base class, KVTransferConfig, Request with SamplingParams, SchedulerOutput, NewRequestData, CachedRequestData);
elsewhere minimal stand-ins with the fields base.py and sched/output.py define (`Namespace` objects below).
Both ways, the VllmConfig and the ForwardContext are stand-ins: vLLM builds neither without a device.
"""

from types import SimpleNamespace as Namespace

import pytest
import torch
from transformers import DynamicCache

import kvsum
from kvsum.integrations import codec
from kvsum.integrations.vllm import KvsumConnector, KvsumConnectorMetadata
from tests.helpers import greedy, random_ids, tiny_llama

try:
    from vllm.config import KVTransferConfig
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
    from vllm.v1.request import Request

    VLLM = True
except ImportError:
    VLLM = False

BLOCK, METHOD = 16, "turboquant:bits=4,key_shift=0"
NAMES = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]


def connector(tmp_path, cache_dtype="auto", **extra):
    extra = {"store": str(tmp_path / "store"), "method": METHOD, **extra}
    kv = dict(kv_connector="KvsumConnector", kv_role="kv_both", kv_connector_module_path="kvsum.integrations.vllm",
              kv_connector_extra_config=extra)
    config = Namespace(kv_transfer_config=KVTransferConfig(**kv) if VLLM else Namespace(**kv),
                       cache_config=Namespace(block_size=BLOCK, cache_dtype=cache_dtype),
                       model_config=Namespace(model="tiny", use_mla=False),
                       parallel_config=Namespace(tensor_parallel_size=1, pipeline_parallel_size=1))
    return KvsumConnector(config, role=None)


def request(rid, ids, params=None):
    ids = ids[0].tolist()
    if VLLM:
        sp = SamplingParams(max_tokens=8, extra_args={"kv_transfer_params": params} if params else None)
        return Request(request_id=rid, prompt_token_ids=ids, sampling_params=sp, pooling_params=None)
    return Namespace(request_id=rid, prompt_token_ids=ids, kv_transfer_params=params)


def step(new=(), cached=(), finished=()):
    """A SchedulerOutput: `new` as (request, block_ids, computed, scheduled), `cached` as (req_id, new block_ids,
    computed, scheduled)."""
    scheduled = {r.request_id: n for r, _, _, n in new} | {rid: n for rid, _, _, n in cached}
    if VLLM:
        news = [NewRequestData(req_id=r.request_id, prompt_token_ids=list(r.prompt_token_ids), mm_features=[],
                               sampling_params=None, pooling_params=None, block_ids=(list(b),), num_computed_tokens=c,
                               lora_request=None, prefill_token_ids=list(r.prompt_token_ids)) for r, b, c, _ in new]
        old = CachedRequestData(req_ids=[c[0] for c in cached],
                                new_token_ids=[[] for _ in cached],
                                new_block_ids=[(list(c[1]),) if c[1] else None for c in cached],
                                num_computed_tokens=[c[2] for c in cached], num_output_tokens=[0 for _ in cached]) \
            if cached else CachedRequestData.make_empty()
        return SchedulerOutput(scheduled_new_reqs=news, scheduled_cached_reqs=old, num_scheduled_tokens=scheduled,
                               total_num_scheduled_tokens=sum(scheduled.values()), scheduled_spec_decode_tokens={},
                               scheduled_encoder_inputs={}, finished_req_ids=set(finished), free_encoder_mm_hashes=[])
    news = [Namespace(req_id=r.request_id, prompt_token_ids=list(r.prompt_token_ids), block_ids=(list(b),),
                      num_computed_tokens=c) for r, b, c, _ in new]
    old = Namespace(req_ids=[c[0] for c in cached], new_block_ids=[(list(c[1]),) if c[1] else None for c in cached],
                    num_computed_tokens=[c[2] for c in cached])
    return Namespace(scheduled_new_reqs=news, scheduled_cached_reqs=old, num_scheduled_tokens=scheduled,
                     finished_req_ids=set(finished))


def pages(blocks=32):
    return {name: torch.zeros(blocks, 2, BLOCK, 32) for name in NAMES}  # tiny_llama: 2 KV heads of 16


def forward(buffers):
    return Namespace(no_compile_layers={n: Namespace(kv_cache=kv) for n, kv in buffers.items()}, attn_metadata={})


def prefill_into(model, ids, buffers, block_ids):
    """Write the prompt's KV into the request's pages, as vLLM's prefill would."""
    with torch.no_grad():
        layers = model(ids, use_cache=True).past_key_values.layers
    pos = torch.arange(ids.shape[1])
    slot = torch.as_tensor(block_ids)[pos // BLOCK] * BLOCK + pos % BLOCK
    for name, layer in zip(NAMES, layers):
        kv = torch.cat([layer.keys[0], layer.values[0]], -1).transpose(0, 1)  # (T, H, 2d)
        buffers[name][slot // BLOCK, :, slot % BLOCK] = kv


def read_pages(buffers, block_ids, n):
    pos = torch.arange(n)
    slot = torch.as_tensor(block_ids)[pos // BLOCK] * BLOCK + pos % BLOCK
    out = []
    for name in NAMES:
        kv = buffers[name][slot // BLOCK, :, slot % BLOCK].transpose(0, 1)  # (H, n, 2d)
        out.append((kv[..., :16], kv[..., 16:]))
    return out


def run_worker(conn, meta, buffers, load=False):
    conn.bind_connector_metadata(meta)
    if load:
        conn.start_load_kv(forward(buffers))
    for name in NAMES:
        conn.save_kv_layer(name, buffers[name], None)
    conn.wait_for_save()
    conn.clear_connector_metadata()


def save_document(tmp_path, model, doc, question):
    """Request 1 (document + question) prefilled in one step: the connector saves the document's pages."""
    conn = connector(tmp_path)
    r1 = request("r1", torch.cat([doc, question], -1), {"kvsum_prefix_tokens": doc.shape[1]})
    conn.on_new_request(r1)
    assert conn.get_num_new_matched_tokens(r1, 0) == (0, False)
    conn.update_state_after_alloc(r1, None, 0)
    blocks = [5, 2, 9, 11, 3, 7, 8, 20]
    meta = conn.build_connector_meta(step(new=[(r1, blocks, 0, len(r1.prompt_token_ids))]))
    assert isinstance(meta, KvsumConnectorMetadata) and not meta.loads
    assert [(t.req_id, t.start, t.stop) for t in meta.saves] == [("r1", 0, doc.shape[1])]
    buffers = pages()
    prefill_into(model, torch.cat([doc, question], -1), buffers, blocks)
    run_worker(conn, meta, buffers)
    return conn


def test_a_saved_document_prefix_loads_into_another_requests_pages_as_kvsums_own_kv(tmp_path):
    model, doc = tiny_llama(), random_ids(96, 1)
    save_document(tmp_path, model, doc, random_ids(7, 2))
    conn = connector(tmp_path)  # another engine on the same store
    ids2 = torch.cat([doc, random_ids(5, 3)], -1)
    r2 = request("r2", ids2)
    conn.on_new_request(r2)
    assert conn.get_num_new_matched_tokens(r2, 0) == (96, False)
    conn.update_state_after_alloc(r2, None, 96)
    blocks = [30, 1, 4, 6, 12, 13, 14]
    meta = conn.build_connector_meta(step(new=[(r2, blocks, 96, ids2.shape[1] - 96)]))
    assert [(t.req_id, t.start, t.stop) for t in meta.loads] == [("r2", 0, 96)] and not meta.saves
    buffers = pages()
    run_worker(conn, meta, buffers, load=True)
    ref = kvsum.compress(model, doc, method="turboquant", budget=1.0, bits=4, key_shift=0)
    for (k, v), (k_ref, v_ref) in zip(read_pages(buffers, blocks, 96), codec.dense_kv(ref)):
        assert torch.equal(k, k_ref) and torch.equal(v, v_ref)  # the pages hold what kvsum's cache attends over
    cache = DynamicCache(config=model.config)
    for i, (k, v) in enumerate(read_pages(buffers, blocks, 96)):
        cache.update(k[None].contiguous(), v[None].contiguous(), i)
    assert torch.equal(greedy(model, ids2, cache, steps=10), greedy(model, ids2, ref, steps=10))
    (row,) = conn.prefixes.store.ls()  # an ordinary Store entry: `kvsum store ls|du|rm` see it
    assert row["tokens"] == 96 and "turboquant" in str(row)


def test_a_local_prefix_hit_is_not_overwritten(tmp_path):
    model, doc = tiny_llama(), random_ids(96, 1)
    save_document(tmp_path, model, doc, random_ids(7, 2))
    conn = connector(tmp_path)
    r = request("r", torch.cat([doc, random_ids(3, 4)], -1))
    assert conn.get_num_new_matched_tokens(r, 32) == (64, False)  # vLLM's own cache holds the first 2 pages
    conn.update_state_after_alloc(r, None, 64)
    blocks = [0, 1, 2, 3, 4, 5, 6]
    meta = conn.build_connector_meta(step(new=[(r, blocks, 96, 3)]))
    assert [(t.start, t.stop) for t in meta.loads] == [(32, 96)]
    buffers = {n: torch.full((32, 2, BLOCK, 32), 7.0) for n in NAMES}
    run_worker(conn, meta, buffers, load=True)
    for name in NAMES:
        assert bool((buffers[name][:2] == 7.0).all()) and not bool((buffers[name][2:6] == 7.0).any())


def test_no_match_without_a_stored_prefix_and_never_the_last_token(tmp_path):
    model, doc = tiny_llama(), random_ids(96, 1)
    save_document(tmp_path, model, doc, random_ids(7, 2))
    conn = connector(tmp_path)
    assert conn.get_num_new_matched_tokens(request("a", random_ids(120, 9)), 0) == (0, False)
    # the document alone: its last token must be computed, so at most 80 tokens (5 pages) may come from the
    # store, and only a stored 80-token prefix would match: none is
    assert conn.get_num_new_matched_tokens(request("c", doc), 0) == (0, False)
    assert conn.get_num_new_matched_tokens(request("d", torch.cat([doc, doc], -1)), 96) == (0, False)


def test_a_prefill_in_chunks_is_saved_once_complete(tmp_path):
    model, ids = tiny_llama(), random_ids(100, 5)
    conn = connector(tmp_path)
    r = request("r", ids)
    conn.on_new_request(r)
    conn.get_num_new_matched_tokens(r, 0)
    conn.update_state_after_alloc(r, None, 0)
    meta = conn.build_connector_meta(step(new=[(r, [3, 4, 5], 0, 48)]))
    assert not meta.saves  # 48 of the 96 tokens to keep are computed
    meta2 = conn.build_connector_meta(step(cached=[("r", [6, 7, 8, 9], 48, 52)]))
    assert [(t.start, t.stop) for t in meta2.saves] == [(0, 96)]
    assert meta2.saves[0].slots.tolist() == codec_slots([3, 4, 5, 6, 7, 8, 9], 96)
    buffers = pages()
    prefill_into(model, ids, buffers, [3, 4, 5, 6, 7, 8, 9])
    run_worker(conn, meta2, buffers)
    assert conn.prefixes.has(meta2.saves[0].key)
    assert not conn.build_connector_meta(step(cached=[("r", None, 100, 1)])).saves  # saved once


def codec_slots(block_ids, n):
    return [block_ids[t // BLOCK] * BLOCK + t % BLOCK for t in range(n)]


def test_an_entry_altered_or_removed_before_loading_is_reported_as_failed_blocks(tmp_path):
    model, doc = tiny_llama(), random_ids(96, 1)
    save_document(tmp_path, model, doc, random_ids(7, 2))
    conn = connector(tmp_path)
    r = request("r", torch.cat([doc, random_ids(3, 4)], -1))
    conn.get_num_new_matched_tokens(r, 0)
    conn.update_state_after_alloc(r, None, 96)
    blocks = [10, 11, 12, 13, 14, 15, 16]
    meta = conn.build_connector_meta(step(new=[(r, blocks, 96, 3)]))
    path = conn.prefixes.store.path(meta.loads[0].key)
    data = bytearray(path.read_bytes())
    data[-10] ^= 0x01
    path.write_bytes(bytes(data))
    for spoil in (lambda: None, path.unlink):  # altered, then gone
        spoil()
        buffers = pages()
        run_worker(conn, meta, buffers, load=True)
        assert conn.get_block_ids_with_load_errors() == set(blocks[:6])  # vLLM recomputes these
        assert conn.get_block_ids_with_load_errors() == set()  # reported once
        assert not any(bool(kv.any()) for kv in buffers.values())  # and nothing was written


@pytest.mark.parametrize("change", [dict(cache_dtype="fp8"), dict(method="snapkv"), dict(method="summary")])
def test_configurations_it_cannot_serve_are_refused(tmp_path, change):
    with pytest.raises(kvsum.KVSumError):
        connector(tmp_path, **change)


def test_vllms_factory_finds_it_by_module_path_where_vllm_imports(tmp_path):
    pytest.importorskip("vllm")
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata

    cls = KVConnectorFactory.get_connector_class(connector(tmp_path)._kv_transfer_config)  # --kv-transfer-config
    assert cls is KvsumConnector and issubclass(cls, KVConnectorBase_V1)
    assert issubclass(KvsumConnectorMetadata, KVConnectorMetadata) and not cls.__abstractmethods__
