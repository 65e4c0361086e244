"""`KVTierConnector`: vLLM's KV connector interface (`KVConnectorBase_V1`) over kvtier's host pool
and storage tier. With `stats`, the only modules of kvtier that import vLLM.

In the scheduler process it answers `get_num_new_matched_tokens` with the whole blocks kvtier holds
beyond vLLM's own prefix cache and plans each step's loads and saves (`scheduler`); in each worker
it moves the blocks (`blocks`): host hits submitted before the forward (`start_load_kv`; on a GPU
on their own stream, `wait_for_layer_load` waiting for that layer only), requests with pages in
storage fetched in the background (`async`: vLLM holds them in its queue until `get_finished`
reports them), saves layer by layer
(`save_kv_layer`) into the host pool, then a write to storage per saved block. A storage page that
is absent or refused by its checks is reported through `get_block_ids_with_load_errors`; with
`kv_load_failure_policy: recompute` vLLM recomputes those blocks. Options: `config`; counters in
vLLM's log and `/metrics`: `stats`.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from kvtier.errors import BackendUnavailableError, ConfigError, InvariantError
from kvtier.integrations.vllm import stats
from kvtier.integrations.vllm.blocks import BlockViews, HostBlocks
from kvtier.integrations.vllm.config import ConnectorConfig, page_fingerprint, rank_identity
from kvtier.integrations.vllm.fetches import Fetches
from kvtier.integrations.vllm.scheduler import ConnectorScheduler, StepPlan
from kvtier.storage.backend import StorageBackend, open_backend
from kvtier.storage.keys import PageKeys

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger(__name__)


class KVTierMetadata(KVConnectorMetadata):
    """One step's plan, from the scheduler to the workers."""

    def __init__(self, plan: StepPlan) -> None:
        self.plan = plan


class KVTierConnector(KVConnectorBase_V1):
    """kvtier's host and storage tiers under vLLM's own KV cache; see the module docstring."""

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        stats.log_through_vllm()
        self.config = ConnectorConfig.from_extra(self._kv_transfer_config.kv_connector_extra_config)
        if len(kv_cache_config.kv_cache_groups) != 1:
            raise ConfigError(
                f"kvtier's connector handles models with one KV cache group; this one has "
                f"{len(kv_cache_config.kv_cache_groups)} (hybrid attention is not supported yet)"
            )
        group = kv_cache_config.kv_cache_groups[0]
        self.block_size = vllm_config.cache_config.block_size
        self.num_blocks = kv_cache_config.num_blocks
        self.block_bytes = group.kv_cache_spec.page_size_bytes * len(group.layer_names)
        self.host_slots = int(self.config.host_gb * (1 << 30)) // self.block_bytes
        if self.host_slots <= 0:
            gb, nbytes = self.config.host_gb, self.block_bytes
            raise ConfigError(f"kvtier connector: host_gb {gb} holds no vLLM block of {nbytes} bytes")
        tp = vllm_config.parallel_config.tensor_parallel_size
        rank = 0
        if role is KVConnectorRole.WORKER:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            rank = get_tensor_model_parallel_rank()
        spec_name = type(group.kv_cache_spec).__name__
        rank_id, self._writes_storage = rank_identity(spec_name, rank, tp)
        model = self.config.model or str(vllm_config.model_config.model)
        identity = {
            "model": model,
            "dtype": str(vllm_config.model_config.dtype),
            "cache_dtype": str(vllm_config.cache_config.cache_dtype),
            "block_size": self.block_size,
            "block_bytes": self.block_bytes,
            "layers": list(group.layer_names),
            "spec": spec_name,
            "tp": rank_id,
        }
        self.keys = PageKeys(page_fingerprint(identity), self.block_size)
        self._backend: StorageBackend | None = (
            open_backend(self.config.storage) if self.config.storage else None
        )
        self._requests: dict[str, Request] = {}
        self._scheduler: ConnectorScheduler | None = None
        self._host: HostBlocks | None = None
        self._fetches: Fetches | None = None
        self._load_errors: set[int] = set()
        self._failed_fetches: set[str] = set()
        self._step_bad: set[int] = set()
        self._counts = dict.fromkeys(stats.COUNTERS, 0)  # the worker's, cumulative
        self._reported: dict[str, float] = {}
        if role is KVConnectorRole.SCHEDULER:
            stored = self._stored if self._backend is not None else None
            self._scheduler = ConnectorScheduler(
                self.block_size, self.host_slots, self.keys, self._tokens, stored
            )
        where = (role.name.lower(), self.host_slots, self.block_bytes, self.config.host_gb)
        storage = self.config.storage or "none"
        log.info("kvtier connector (%s): %d host blocks of %d bytes (%.1f GiB), storage %s", *where, storage)

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        # A full CUDA graph replays the forward without calling `wait_for_layer_load` or
        # `save_kv_layer`: layer-wise loads would race attention and saves would never run.
        return True

    # -- scheduler side ---------------------------------------------------------------
    #
    # An exception in a hook kills vLLM's engine: each hook logs it and degrades to a miss (a load
    # it cannot plan is planned as failed, so vLLM recomputes those blocks; a request promised an
    # asynchronous load is reported done, its blocks failed, so it never waits forever).

    def _side(self) -> ConnectorScheduler:
        """The scheduler side (`InvariantError` where vLLM calls a scheduler hook on a worker)."""
        if self._scheduler is None:
            raise InvariantError("vLLM called a scheduler hook on a worker's connector")
        return self._scheduler

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        sched = self._side()
        try:
            self._requests[request.request_id] = request
            return sched.match(request.request_id, num_computed_tokens)
        except Exception:
            log.exception("kvtier: lookup failed; a miss")
            sched.forget_match(request.request_id)
            return 0, False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        sched = self._side()
        (ids,) = blocks.get_block_ids()
        try:
            self._requests[request.request_id] = request
            sched.allocated(request.request_id, ids, num_external_tokens)
        except Exception:
            log.exception("kvtier: planning a load failed; vLLM recomputes its blocks")
            start = request.num_computed_tokens // self.block_size
            sched.fail_load(request.request_id, ids, start, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        sched = self._side()
        counts = scheduler_output.num_scheduled_tokens
        runs = []  # (request, new blocks, whole table, tokens computed after the step)
        for new in scheduler_output.scheduled_new_reqs:
            runs.append(
                (new.req_id, new.block_ids[0], True, new.num_computed_tokens + counts.get(new.req_id, 0))
            )
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            new_ids = cached.new_block_ids[i]
            blocks = None if new_ids is None else new_ids[0]
            after = cached.num_computed_tokens[i] + counts.get(req_id, 0)
            runs.append((req_id, blocks, req_id in cached.resumed_req_ids, after))
        for req_id, blocks, replace, after in runs:
            if req_id not in self._requests:
                continue
            try:
                sched.scheduled(req_id, blocks, replace, after)
            except Exception:  # this request's blocks are not saved this step
                log.exception("kvtier: planning saves failed")
        for req_id in scheduler_output.finished_req_ids:
            self._forget(req_id)
        return KVTierMetadata(sched.take_plan())

    def update_connector_output(self, connector_output: Any) -> None:
        if self._scheduler is not None:
            try:
                failed = connector_output.invalid_block_ids or ()  # sent with their fetch's end
                self._scheduler.fetched(list(connector_output.finished_recving or ()), set(failed))
            except Exception:
                log.exception("kvtier: releasing fetched slots failed")

    def has_pending_push_work(self) -> bool:
        # A request aborted while its blocks are fetched keeps them until a step hears the fetch
        # done: vLLM steps on while this is True, even with no request left.
        return self._scheduler is not None and self._scheduler.fetching

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        # The blocks may be freed at once: a step's saves read them within that step (on the CPU,
        # copied before `wait_for_save` returns; on a GPU, the compute stream waits for them there,
        # so whatever vLLM writes into a freed block comes after its save).
        self._forget(request.request_id)
        return False, None

    def _forget(self, req_id: str) -> None:
        self._requests.pop(req_id, None)
        if self._scheduler is not None:
            self._scheduler.finished(req_id)

    def _tokens(self, req_id: str):
        return self._requests[req_id].all_token_ids

    def _stored(self, keys: list[str]) -> int:
        backend = self._backend
        if backend is None:  # `stored` is wired only with a storage tier
            return 0
        try:
            return backend.exists(keys)
        except Exception as e:  # a storage fault is a miss
            log.warning("kvtier: storage lookup failed (%s); treated as a miss", e)
            return 0

    # -- worker side ------------------------------------------------------------------
    #
    # Without a host pool (`register_kv_caches` failed) every planned load fails and every fetch
    # is reported done with its blocks failed. A slot whose save failed is `bad` until a later
    # save fills it: loads from it fail.

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        try:
            views = BlockViews(kv_caches, self.num_blocks)
            if views.block_bytes != self.block_bytes:
                raise ConfigError(
                    f"vLLM's KV tensors hold {views.block_bytes} bytes a block, not {self.block_bytes}"
                )
            pool = (views, self.host_slots, self.keys, self._backend, self.config.max_pending_writes)
            self._host = HostBlocks(*pool, store=self._writes_storage)
            self._fetches = Fetches(self._host)
        except Exception:
            log.exception(
                "kvtier: the connector cannot use these KV tensors; every lookup will be recomputed"
            )
            self._host = self._fetches = None

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        plan = self._plan()
        if plan is None:
            return
        after = None
        for req_id, loads in plan.fetches.items():
            try:
                if self._fetches is None or self._host is None:
                    raise BackendUnavailableError("no host pool (register_kv_caches failed)")
                after = after or self._host.mark()  # the blocks' earlier owners' work in this step
                self._fetches.submit(req_id, loads, after)
            except Exception as e:
                log.warning("kvtier: a fetch could not start (%s); its blocks are recomputed", e)
                self._failed_fetches.add(req_id)
                self._load_errors |= {ld.block for ld in loads}
        if not plan.loads:
            return
        start = time.perf_counter()
        counts, host = self._counts, self._host
        try:
            if host is None:
                raise BackendUnavailableError("no host pool (register_kv_caches failed)")
            blocks, slots = [], []
            for load in plan.loads:
                if not host.loadable(load):
                    self._load_errors.add(load.block)
                    counts["load_failed_blocks"] += 1
                    continue
                counts["storage_hit_blocks" if load.from_storage else "host_hit_blocks"] += 1
                blocks.append(load.block)
                slots.append(load.slot)
            host.load(blocks, slots)
            counts["loaded_bytes"] += len(blocks) * self.block_bytes
        except Exception as e:
            log.warning("kvtier: loading blocks failed (%s); they are recomputed", e)
            self._load_errors |= {ld.block for ld in plan.loads}
        counts["load_seconds"] += time.perf_counter() - start

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self._host is not None:
            try:
                self._host.wait_layer(layer_name)
            except Exception:
                log.exception("kvtier: waiting for a layer's loads failed")

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        plan = self._plan()
        if plan is None or not plan.saves or self._host is None or layer_name not in self._host.views.views:
            return
        start = time.perf_counter()
        slots = [s.slot for s in plan.saves]
        try:
            self._host.save_layer(layer_name, [s.block for s in plan.saves], slots)
        except Exception as e:
            log.warning("kvtier: saving blocks failed (%s); their host slots are not loaded from", e)
            self._step_bad.update(slots)
        self._counts["save_seconds"] += time.perf_counter() - start

    def wait_for_save(self) -> None:
        plan = self._plan()
        host = self._host
        if plan is None or host is None:
            return
        host.fence_saves()
        bad, self._step_bad = self._step_bad, set()
        host.bad -= {s.slot for s in plan.saves} - bad
        host.bad |= bad
        for save in plan.saves:
            if save.store and save.slot not in bad:
                host.store(save.slot, save.page_hash)
        host.counts["saved"] += len(plan.saves) - len(bad)
        self._counts["saved_blocks"] += len(plan.saves) - len(bad)
        self._counts["saved_bytes"] += (len(plan.saves) - len(bad)) * self.block_bytes

    def get_kv_connector_stats(self) -> stats.KVTierStats | None:
        """The worker's counters that moved since its last report."""
        if self._host is None:
            return None
        host = self._host.counts
        now = dict(self._counts, stored_blocks=host["stored"])
        if self._fetches is not None:
            for k, v in self._fetches.counts.items():
                now[k] += v
        now["store_failed_blocks"] = host["store_failed"] + host["store_dropped"]
        moved = stats.delta(now, self._reported)
        self._reported = now
        return stats.KVTierStats(data=moved) if moved else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> stats.KVTierStats:
        return stats.KVTierStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls, vllm_config: Any, metric_types: dict, labelnames: list[str], per_engine_labelvalues: dict
    ) -> stats.KVTierPromMetrics:
        return stats.KVTierPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Requests whose background fetch is done (their failed blocks go with the next
        `get_block_ids_with_load_errors`, which vLLM asks in the same pass)."""
        done, self._failed_fetches = self._failed_fetches, set()
        if self._fetches is not None:
            finished, failed = self._fetches.take()
            done |= finished
            self._load_errors |= failed
        return None, done or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        try:
            if self._fetches is not None:
                self._fetches.close()
                self._fetches = None
            if self._host is not None:
                log.info("kvtier connector: %s", self._host.counts)
                self._host.close()
                self._host = None
            elif self._backend is not None:
                self._backend.close()
            if self._scheduler is not None:
                counts, evictions = self._scheduler.counts, self._scheduler.index.evictions
                log.info("kvtier connector: %s, %d evictions", counts, evictions)
        except Exception:
            log.exception("kvtier: shutting the connector down failed")

    def state(self) -> dict[str, int]:
        """What this side holds now (a debug surface; see `ConnectorScheduler.state`). On a worker:
        `fetches` in flight or done and not reported, `pending_writes` to storage, `load_errors`
        not reported, `bad_slots`; all 0 but `bad_slots` once vLLM is idle and writes flushed."""
        if self._scheduler is not None:
            return self._scheduler.state()
        fetches = self._fetches
        return {
            "fetches": 0 if fetches is None else fetches.in_flight + fetches.untaken(),
            "pending_writes": 0 if self._host is None else self._host.pending_writes,
            "load_errors": len(self._load_errors) + len(self._failed_fetches),
            "bad_slots": 0 if self._host is None else len(self._host.bad),
        }

    def _plan(self) -> StepPlan | None:
        if not self.has_connector_metadata():
            return None
        meta = self._get_connector_metadata()
        return meta.plan if isinstance(meta, KVTierMetadata) else None
