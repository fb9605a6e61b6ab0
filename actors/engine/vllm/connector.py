"""Prorsa's KV connector for vLLM: KV blocks between vLLM engines over NATS.

Loaded by vLLM through `kv_connector_module_path = "actors.engine.vllm.connector"` with
`kv_connector = "ProrsaNatsConnector"` and `kv_role = "kv_both"`: every engine can hold KV
for others (prefill) and load KV from others (decode), so a role switch needs no restart.
A request says what to do through `SamplingParams.extra_args["kv_transfer_params"]`:

    {"prorsa_hold": HANDLE}                          prefill: keep the prompt's KV under HANDLE
    {"prorsa_load": {"holder": ENGINE, "handle": HANDLE, "tokens": N}}
                                                     decode: the first N positions' KV is on ENGINE

Scheduler side (vLLM's scheduler, each step):
  1. `get_num_new_matched_tokens`: a load request's N minus what the local prefix cache
     holds (block-aligned): loaded synchronously, before the step's forward pass.
  2. `update_state_after_alloc` / `build_connector_meta`: the blocks vLLM allocated for those
     tokens become the step's load list; a hold request whose prompt completes in this
     step joins its save list with all its blocks.
Worker side (the model runner, around the forward pass):
  3. `start_load_kv`: fetch each load's blocks over NATS (`KvBus.fetch`, CRC-32C checked) and
     copy them into the paged KV cache. Any failure marks the blocks invalid: vLLM
     recomputes them (`kv_load_failure_policy = "recompute"`), never decodes on wrong KV.
  4. `wait_for_save`: copy each save's blocks out of the paged cache and hold them on the
     bus (`KvBus.hold`) until fetched or expired.

Blocks move whole, layer after layer, exactly as the paged cache stores them, so any
attention backend's layout round-trips as long as both engines share model and config.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole

from actors.engine.vllm.kvbus import Held, KvBus, KvLoadError

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

log = logging.getLogger("prorsa.vllm.connector")

HOLD_KEY = "prorsa_hold"
LOAD_KEY = "prorsa_load"


@dataclass(slots=True)
class LoadSpec:
    holder: str
    handle: str
    start_tokens: int  # block-aligned: what the local prefix cache already held
    tokens: int  # load positions start_tokens..tokens
    block_ids: list[int]  # the request's blocks covering positions start_tokens..tokens
    req_id: str = ""


@dataclass(slots=True)
class SaveSpec:
    handle: str
    tokens: int
    block_ids: list[int]  # the request's blocks covering positions 0..tokens


@dataclass
class ProrsaConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)


def _blocks_for(start_tokens: int, stop_tokens: int, block_size: int) -> tuple[int, int]:
    """Block indexes [first, last) that hold positions start_tokens..stop_tokens."""
    return start_tokens // block_size, -(-stop_tokens // block_size)


class ProrsaNatsConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config=None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config
        self._block_size = vllm_config.cache_config.block_size
        self._engine_id = str(extra["engine_id"])
        # scheduler side
        self._to_load: dict[str, tuple[dict[str, Any], int]] = {}  # req id -> (load params, external tokens)
        self._holds: dict[str, tuple[str, int]] = {}  # req id -> (handle, prompt tokens)
        self._hold_blocks: dict[str, list[int]] = {}
        # worker side
        self._bus: KvBus | None = None
        self._kv_caches: list[torch.Tensor] = []
        self._load_errors: set[int] = set()
        self._loaded_reqs: set[str] = set()
        if role == KVConnectorRole.WORKER:
            self._bus = KvBus(
                str(extra["nats_url"]),
                self._engine_id,
                int(extra["chunk_bytes"]),
                float(extra["ttl_wall_s"]),
                float(extra["timeout_wall_s"]),
            )

    # --- scheduler side --------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        params = request.kv_transfer_params or {}
        if HOLD_KEY in params:
            self._holds[request.request_id] = (str(params[HOLD_KEY]), request.num_prompt_tokens)
        load = params.get(LOAD_KEY)
        if not load:
            return 0, False
        tokens = min(int(load["tokens"]), request.num_tokens - 1)  # vLLM computes at least the last token
        return max(0, tokens - num_computed_tokens), False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        if num_external_tokens > 0:
            self._to_load[request.request_id] = (request.kv_transfer_params[LOAD_KEY], num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = ProrsaConnectorMetadata()
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            block_ids = list(new.block_ids[0])
            if new.req_id in self._to_load:
                load, external = self._to_load.pop(new.req_id)
                start = new.num_computed_tokens - external
                first, last = _blocks_for(start, new.num_computed_tokens, self._block_size)
                meta.loads.append(
                    LoadSpec(str(load["holder"]), str(load["handle"]), start, new.num_computed_tokens, block_ids[first:last], new.req_id)
                )
            if new.req_id in self._holds:
                self._hold_blocks[new.req_id] = block_ids
                self._maybe_save(meta, new.req_id, new.num_computed_tokens + scheduled.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            new_blocks = cached.new_block_ids[i]
            if req_id in self._to_load and req_id in cached.resumed_req_ids and new_blocks:  # preempted, loads again
                load, external = self._to_load.pop(req_id)
                computed = cached.num_computed_tokens[i]
                first, last = _blocks_for(computed - external, computed, self._block_size)
                meta.loads.append(
                    LoadSpec(
                        str(load["holder"]), str(load["handle"]), computed - external, computed, list(new_blocks[0])[first:last], req_id
                    )
                )
            if req_id not in self._hold_blocks:
                continue
            if req_id in cached.resumed_req_ids:  # preempted and back: its blocks are all new
                self._hold_blocks[req_id] = list(new_blocks[0]) if new_blocks else []
            elif new_blocks is not None:
                self._hold_blocks[req_id].extend(new_blocks[0])
            self._maybe_save(meta, req_id, cached.num_computed_tokens[i] + scheduled.get(req_id, 0))
        self._to_load.clear()  # a load not scheduled now is asked for again when it is
        return meta

    def _maybe_save(self, meta: ProrsaConnectorMetadata, req_id: str, computed_after_step: int) -> None:
        handle, prompt_tokens = self._holds[req_id]
        if computed_after_step < prompt_tokens:
            return  # chunked prefill: the prompt's KV is complete only after a later step
        _, last = _blocks_for(0, prompt_tokens, self._block_size)
        meta.saves.append(SaveSpec(handle, prompt_tokens, self._hold_blocks.pop(req_id)[:last]))
        del self._holds[req_id]

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._holds.pop(request.request_id, None)  # aborted before its prompt completed
        self._hold_blocks.pop(request.request_id, None)
        return False, None

    # --- worker side -----------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._kv_caches = [kv_caches[name] for name in sorted(kv_caches)]

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, ProrsaConnectorMetadata)
        for load in meta.loads:
            try:
                self._load(load)
            except KvLoadError as err:
                self._bus.counters["kv_load_failures"] += 1
                self._load_errors.update(load.block_ids)
                log.error("engine %s: KV of %s not loaded, recomputing: %s", self._engine_id, load.handle, err)

    def _load(self, load: LoadSpec) -> None:
        payload, start_tokens = self._bus.fetch(load.holder, load.handle, load.start_tokens)
        if start_tokens != load.start_tokens:
            raise KvLoadError(f"holder sent KV from position {start_tokens}, asked for {load.start_tokens}")
        n_blocks = len(load.block_ids)
        caches = self._kv_caches
        block_shape = caches[0].shape[1:]
        expected = len(caches) * n_blocks * caches[0][0].numel() * caches[0].element_size()
        if len(payload) != expected:
            raise KvLoadError(f"KV of {load.handle} has {len(payload)} bytes, the blocks here take {expected}")
        src = torch.frombuffer(bytearray(payload), dtype=caches[0].dtype).view(len(caches), n_blocks, *block_shape)
        index = torch.tensor(load.block_ids, dtype=torch.long, device=caches[0].device)
        for layer, cache in enumerate(caches):
            cache.index_copy_(0, index, src[layer].to(cache.device))
        self._bus.counters["kv_loaded_tokens"] += load.tokens - load.start_tokens
        self._bus.counters["kv_loads"] += 1
        if load.req_id in self._loaded_reqs:
            self._bus.counters["kv_loads_repeated"] += 1
            log.warning("engine %s: request %s loaded KV again (%d..%d)", self._engine_id, load.req_id, load.start_tokens, load.tokens)
        self._loaded_reqs.add(load.req_id)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads complete in start_load_kv

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        return  # saves copy whole blocks once the step ends (wait_for_save)

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, ProrsaConnectorMetadata)
        for save in meta.saves:
            index = torch.tensor(save.block_ids, dtype=torch.long, device=self._kv_caches[0].device)
            blocks = torch.stack([cache.index_select(0, index) for cache in self._kv_caches]).cpu().contiguous()
            block_bytes = blocks[0][0].numel() * blocks.element_size()
            payload = blocks.view(torch.uint8).numpy().tobytes()
            self._bus.hold(save.handle, Held(payload, save.tokens, block_bytes, len(self._kv_caches), self._block_size, 0.0))

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        if self._bus is not None:
            self._bus.close()
