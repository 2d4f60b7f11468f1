"""`KVTierConnector`: the vLLM KV connector (KVConnectorBase_V1) that serves KV from kvtier's host and SSD tiers.

    vllm serve MODEL --kv-transfer-config '{"kv_connector":"KVTierConnector",
      "kv_connector_module_path":"kvtier.connector","kv_role":"kv_both","kv_load_failure_policy":"recompute",
      "kv_connector_extra_config":{"config_file":"configs/lmcache-kvtier.yaml"}}'

One class, two roles (vLLM builds one instance per role): the scheduler role delegates to `SchedulerSide`
(tier hints, eager SSD prefetch, load/save planning), the worker role to `WorkerSide` (an LMCache engine with
kvtier's SSD tier and page-first GPU connector). Loads and saves use vLLM's asynchronous protocol: large loads park
their request in WAITING_FOR_REMOTE_KVS until `get_finished` reports them, saves run on the worker's transfer
thread (`connector/transfers.py`), finished requests keep their blocks until their saves are done
(`request_finished` -> delay_free_blocks), preempted requests' saves finish in `handle_preemptions`.
Configuration and versions are checked in the constructor, so a bad setting stops the engine at start.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole

from kvtier.connector import metrics_export
from kvtier.connector.config import check_versions, load_connector_config
from kvtier.connector.messages import KVTierConnectorMetadata, KVTierWorkerMetadata
from kvtier.connector.metrics import KVTierConnectorStats, KVTierPromMetrics

if TYPE_CHECKING:
    import torch

    from kvtier.scheduler_hooks.base import SchedulingPolicy
    from kvtier.scheduler_hooks.tier_hint import TierHint

logger = logging.getLogger(__name__)


class KVTierConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        vv, lv = check_versions()
        ktc = vllm_config.kv_transfer_config
        if vllm_config.parallel_config.pipeline_parallel_size > 1:
            from kvtier.storage_backends.config import ConfigError

            raise ConfigError("the kvtier connector does not support pipeline parallelism yet")
        if ktc.kv_load_failure_policy != "recompute":
            logger.warning("kvtier: kv_load_failure_policy is %r: a KV block that fails to load fails its request; "
                           "set \"kv_load_failure_policy\": \"recompute\" to recompute it instead",
                           ktc.kv_load_failure_policy)
        self.cfg = load_connector_config(ktc.kv_connector_extra_config, int(vllm_config.cache_config.block_size))
        self.scheduler_side = None
        self.worker_side = None
        if role == KVConnectorRole.SCHEDULER:
            from kvtier.connector.scheduler_side import SchedulerSide

            self.scheduler_side = SchedulerSide(vllm_config, self.cfg, kv_cache_config)
        else:
            from kvtier.connector.worker_side import WorkerSide

            self.worker_side = WorkerSide(vllm_config, self.cfg)
        if role == KVConnectorRole.SCHEDULER and not vllm_config.shutdown_timeout \
                and os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") != "0":
            logger.warning("kvtier: vLLM's shutdown_timeout is 0: at shutdown vLLM kills its workers at once, and "
                           "SSD writes still queued then are lost (committed chunks are kept); start vllm serve "
                           "with --shutdown-timeout 10 to let the connector commit them")
        # one version line per engine (the scheduler role); the worker logs its own start-up line
        logger.log(logging.INFO if role == KVConnectorRole.SCHEDULER else logging.DEBUG,
                   "kvtier connector (%s role) on vLLM %s, LMCache %s, config %s", role.name, vv, lv,
                   self.cfg.config_file)

    # ------------------------------------------------------------------ worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self.worker_side is not None
        self.worker_side.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self.worker_side is not None and isinstance(connector_metadata, KVTierConnectorMetadata):
            self.worker_side.bind(connector_metadata)

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        if self.worker_side is not None:
            self.worker_side.clear()

    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        if self.worker_side is not None:
            self.worker_side.handle_preemptions(kv_connector_metadata)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        if self.worker_side is not None:
            self.worker_side.start_load()

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # synchronous loads complete in start_load_kv (host memory -> KV cache, one batch)

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return None  # saves are queued once per step in wait_for_save

    def wait_for_save(self) -> None:
        if self.worker_side is not None:
            self.worker_side.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self.worker_side is None:
            return None, None
        return self.worker_side.get_finished(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker_side.take_load_errors() if self.worker_side is not None else set()

    def build_connector_worker_meta(self) -> KVTierWorkerMetadata | None:
        return self.worker_side.build_worker_meta() if self.worker_side is not None else None

    def unregister_kv_caches(self) -> None:
        """vLLM 0.33's sleep mode is about to release the KV cache: no transfer may touch it afterwards."""
        if self.worker_side is not None and self.worker_side.transfers is not None:
            self.worker_side.transfers.drain()

    def get_kv_connector_stats(self) -> KVTierConnectorStats | None:
        """Both roles: the worker's interval counters (vLLM's log line), plus this process's kvtier series
        changes for the API server's /metrics (`metrics_export`)."""
        stats = self.worker_side.take_stats() if self.worker_side is not None else None
        payload = metrics_export.exporter().take()
        if payload is None:
            return stats
        return (stats or KVTierConnectorStats()).add_export(payload)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVTierConnectorStats:
        data = dict(data or {})
        if metrics_export.PAYLOAD_KEY in data:  # own list: aggregate() extends it, the caller's stays as it was
            data[metrics_export.PAYLOAD_KEY] = list(data[metrics_export.PAYLOAD_KEY])
        return KVTierConnectorStats(data=data)

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: Any, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KVTierPromMetrics:
        """Called in the process that serves /metrics: kvtier's series there mirror the engine's processes."""
        return KVTierPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self.worker_side is not None:
            self.worker_side.close()
        if self.scheduler_side is not None:
            self.scheduler_side.close()

    # ------------------------------------------------------------------ scheduler side
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self.scheduler_side is not None
        return self.scheduler_side.get_num_new_matched_tokens(request, num_computed_tokens)

    def get_external_cache_hit_sources(self, request: Any, num_external_tokens: int) -> dict[Any, int]:
        assert self.scheduler_side is not None
        return self.scheduler_side.get_external_cache_hit_sources(request, num_external_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        assert self.scheduler_side is not None
        self.scheduler_side.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVTierConnectorMetadata:
        assert self.scheduler_side is not None
        return self.scheduler_side.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        if self.scheduler_side is not None:
            self.scheduler_side.update_connector_output(connector_output)

    def has_pending_block_frees(self) -> bool:
        return self.scheduler_side.has_pending_block_frees() if self.scheduler_side is not None else False

    def on_new_request(self, request: Any) -> None:
        if self.scheduler_side is not None:
            self.scheduler_side.on_new_request(request)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self.scheduler_side is not None
        return self.scheduler_side.request_finished(request, block_ids)

    # ------------------------------------------------------------ kvtier's hook (scheduler_hooks.base.TierHintSource)
    def tier_hint(self, request_id: str) -> TierHint | None:
        """The latest `TierHint` of a waiting request (None if unknown)."""
        return self.scheduler_side.tier_hint(request_id) if self.scheduler_side is not None else None

    def set_scheduling_policy(self, policy: SchedulingPolicy) -> None:
        """Called by kvtier's dual-queue scheduler: prefetches follow its disk-HRRN order."""
        if self.scheduler_side is not None:
            self.scheduler_side.set_scheduling_policy(policy)
