"""`KvsumConnector`: a vLLM KV connector that keeps prompt prefixes compressed by kvsum in a `kvsum.Store`.

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KvsumConnector", "kv_role": "kv_both",
        "kv_connector_module_path": "kvsum.integrations.vllm",
        "kv_connector_extra_config": {"store": "/shared/kvsum", "method": "turboquant:bits=4,key_shift=0"}}'

It implements vLLM's KVConnectorBase_V1 (vllm/distributed/kv_transfer/kv_connector/v1/base.py), after vLLM's
ExampleConnector (example_connector.py beside it). Scheduler side: `get_num_new_matched_tokens` finds the longest
stored prefix of a prompt in whole pages, `update_state_after_alloc` records it for loading, and
`build_connector_meta` lists, per step, the loads (entry, page slots) and the saves (prefixes whose prefill has
completed). Worker side: `start_load_kv` rebuilds full-precision KV from the entry into the slots of every layer;
`save_kv_layer` gathers each layer's prefix KV from the pages and `wait_for_save` stores it compressed.

The pages stay full precision: what is saved is storage and transfer bytes, not GPU memory (docs/serving.md).
A request may name the prefix to keep with `kv_transfer_params={"kvsum_prefix_tokens": N}`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from ..errors import KVSumError
from . import codec
from .prefix import PrefixStore, Transfer, gather, layer_order, scatter, slots

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorMetadata,
        KVConnectorRole,
    )
except ImportError:  # vLLM absent: a stand-in base with the same few members, so the logic stays importable

    class KVConnectorMetadata:  # noqa: B024 - an empty marker, as in vLLM
        pass

    class KVConnectorBase_V1:  # noqa: N801 - vLLM's name
        """Stand-in for vLLM's base where vLLM is not installed: the members KvsumConnector uses, as base.py
        defines them (kv_transfer_config from the VllmConfig, metadata bound per step)."""

        def __init__(self, vllm_config, role, kv_cache_config=None):
            if vllm_config.kv_transfer_config is None:
                raise ValueError("kv_transfer_config must be set for KVConnectorBase_V1")
            self._vllm_config, self._role, self._kv_cache_config = vllm_config, role, kv_cache_config
            self._kv_transfer_config = vllm_config.kv_transfer_config
            self._connector_metadata = None

        @property
        def role(self):
            return self._role

        def bind_connector_metadata(self, connector_metadata) -> None:
            self._connector_metadata = connector_metadata

        def clear_connector_metadata(self) -> None:
            self._connector_metadata = None

        def _get_connector_metadata(self):
            assert self._connector_metadata is not None
            return self._connector_metadata

    KVConnectorRole = None

logger = logging.getLogger(__name__)
PREFIX_PARAM = "kvsum_prefix_tokens"  # kv_transfer_params key naming the prefix a request keeps


@dataclass
class KvsumConnectorMetadata(KVConnectorMetadata):
    """Scheduler -> workers, per step: the prefixes to load into pages and those to save from them."""

    loads: list[Transfer] = field(default_factory=list)
    saves: list[Transfer] = field(default_factory=list)


class KvsumConnector(KVConnectorBase_V1):
    """vLLM KV connector over a kvsum.Store. kv_connector_extra_config: store (directory), method (a
    token-aligned kvsum quantizer spec), budget, max_bytes (the Store's bound)."""

    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = dict(getattr(self._kv_transfer_config, "kv_connector_extra_config", None) or {})
        cache_cfg, model_cfg = vllm_config.cache_config, getattr(vllm_config, "model_config", None)
        if str(getattr(cache_cfg, "cache_dtype", "auto")) != "auto":
            raise KVSumError(f"KvsumConnector needs pages of plain keys and values: kv_cache_dtype "
                             f"{cache_cfg.cache_dtype!r} is not supported, use 'auto'")
        if getattr(model_cfg, "use_mla", False):
            raise KVSumError("KvsumConnector: MLA models (one latent per token) are not supported")
        parallel = getattr(vllm_config, "parallel_config", None)
        if getattr(parallel, "tensor_parallel_size", 1) * getattr(parallel, "pipeline_parallel_size", 1) > 1:
            raise KVSumError("KvsumConnector: one worker per engine only (no tensor or pipeline parallelism)")
        max_bytes = extra.get("max_bytes")
        self.prefixes = PrefixStore(extra.get("store"), model=getattr(model_cfg, "model", "") or "",
                                    method=str(extra.get("method", codec.DEFAULT_METHOD)),
                                    budget=float(extra.get("budget", 1.0)), block_size=cache_cfg.block_size,
                                    max_bytes=int(max_bytes) if max_bytes is not None else None)
        self._block_size = cache_cfg.block_size
        # scheduler side
        self._plans: dict[str, tuple[int, str] | None] = {}  # req -> (prefix tokens, key) to save, None: none
        self._matches: dict[str, tuple[int, str, int]] = {}  # req -> (prefix tokens, key, locally computed)
        self._loads: dict[str, tuple[int, str, int]] = {}  # matched and allocated: load in the next step
        self._pending: dict[str, tuple[int, str, list[int]]] = {}  # saves whose prefill is not complete yet
        # worker side
        self._gathered: dict[str, dict[str, tuple]] = {}
        self._load_errors: set[int] = set()

    # ---- scheduler side ------------------------------------------------------------------------------------

    def _limit(self, request) -> int:
        """Tokens a request may take from the store: its prompt less the last token (which must be computed),
        within the prefix its kv_transfer_params name, in whole pages."""
        n = len(request.prompt_token_ids or []) - 1
        params = getattr(request, "kv_transfer_params", None) or {}
        if params.get(PREFIX_PARAM) is not None:
            n = min(n, int(params[PREFIX_PARAM]))
        return max(0, n) // self._block_size * self._block_size

    def on_new_request(self, request) -> None:
        n = self._limit(request)
        self._plans[request.request_id] = (n, self.prefixes.key(request.prompt_token_ids, n)) if n else None

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        n, key = self.prefixes.longest(request.prompt_token_ids or [], self._limit(request))
        if key is None or n <= num_computed_tokens:
            self._matches.pop(request.request_id, None)
            return 0, False
        self._matches[request.request_id] = (n, key, num_computed_tokens)
        return n - num_computed_tokens, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        match = self._matches.pop(request.request_id, None)
        if num_external_tokens > 0 and match is not None:
            n, key, local = match
            if local + num_external_tokens != n:
                raise KVSumError(f"request {request.request_id}: {num_external_tokens} external tokens allocated "
                                 f"after {local} local ones, the stored prefix has {n}")
            self._loads[request.request_id] = match

    def build_connector_meta(self, scheduler_output) -> KvsumConnectorMetadata:
        meta = KvsumConnectorMetadata()
        scheduled = scheduler_output.num_scheduled_tokens
        for req in scheduler_output.scheduled_new_reqs:
            rid, block_ids = req.req_id, list(req.block_ids[0])
            if rid in self._loads:
                n, key, local = self._loads.pop(rid)
                meta.loads.append(Transfer(rid, key, local, n, slots(block_ids, self._block_size, local, n)))
            plan = self._plans.pop(rid, ()) if rid in self._plans else self._plan_of(req)
            if plan and not self.prefixes.has(plan[1]):
                self._pending[rid] = (plan[0], plan[1], block_ids)
            self._save_if_complete(meta, rid, req.num_computed_tokens + scheduled.get(rid, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            if rid in self._pending:
                new = cached.new_block_ids[i]
                if new is not None:
                    self._pending[rid][2].extend(new[0])
                self._save_if_complete(meta, rid, cached.num_computed_tokens[i] + scheduled.get(rid, 0))
        for rid in scheduler_output.finished_req_ids:
            self._pending.pop(rid, None)
            self._plans.pop(rid, None)
        return meta

    def _plan_of(self, req):
        """The save plan of a request on_new_request did not see (its prompt, no kv_transfer_params)."""
        n = max(0, len(req.prompt_token_ids or []) - 1) // self._block_size * self._block_size
        return (n, self.prefixes.key(req.prompt_token_ids, n)) if n else None

    def _save_if_complete(self, meta, rid: str, computed: int) -> None:
        if rid in self._pending and computed >= self._pending[rid][0]:
            n, key, block_ids = self._pending.pop(rid)
            meta.saves.append(Transfer(rid, key, 0, n, slots(block_ids, self._block_size, 0, n)))

    def request_finished(self, request, block_ids) -> tuple[bool, dict[str, Any] | None]:
        for state in (self._pending, self._plans, self._matches, self._loads):
            state.pop(request.request_id, None)
        return False, None  # saves are synchronous (wait_for_save): the blocks may be freed now

    # ---- worker side ---------------------------------------------------------------------------------------

    @staticmethod
    def _layers(forward_context) -> dict[str, Any]:
        """Attention layer name -> its pages (blocks, kv_heads, block_size, 2 * head_dim)."""
        layers = {name: getattr(layer, "kv_cache", None) for name, layer in forward_context.no_compile_layers.items()}
        return {name: kv for name, kv in layers.items() if kv is not None}

    def start_load_kv(self, forward_context, **kwargs) -> None:
        meta = self._get_connector_metadata()
        if not meta.loads:
            return
        pages = self._layers(forward_context)
        order = layer_order(pages)
        if not pages:
            return
        _, H, _, d2 = next(iter(pages.values())).shape
        for t in meta.loads:
            try:
                layers = self.prefixes.load(t.key, len(order), H, d2 // 2)
                if layers is None:
                    raise KVSumError("it was removed (least recently used) after the scheduler matched it")
            except KVSumError as e:  # vLLM recomputes the blocks reported here, rather than read wrong KV
                logger.warning("kvsum: request %s cannot load stored prefix %s: %s", t.req_id, t.key, e)
                self._load_errors |= set((t.slots // self._block_size).tolist())
                continue
            for name, kv in pages.items():
                k, v = layers[order[name]]
                scatter(kv, t.slots, k[:, t.start:t.stop], v[:, t.start:t.stop])

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are synchronous, done in start_load_kv

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs) -> None:
        for t in self._get_connector_metadata().saves:
            k, v = gather(kv_layer, t.slots.to(kv_layer.device))
            self._gathered.setdefault(t.key, {})[layer_name] = (k.float().cpu(), v.float().cpu())

    def wait_for_save(self) -> None:
        gathered, self._gathered = self._gathered, {}
        for key, layers in gathered.items():
            order = layer_order(layers)
            self.prefixes.save(key, [layers[name] for name in sorted(layers, key=order.get)])
