"""The vLLM hook: a `Scheduler` subclass that orders vLLM's waiting queue with kvtier's `DualQueuePolicy`.

    vllm serve MODEL --scheduler-cls kvtier.scheduler_hooks.DualQueueScheduler --kv-transfer-config '{...kvtier...}'

Each step, before vLLM's own `schedule()`, the hook refreshes the tier hints of the waiting requests from the
connector (`TierHintSource.tier_hint(request_id) -> TierHint | None`, `scheduler_hooks/base.py`), asks the policy
for an order (`DualQueuePolicy.order(now, free_gpu_blocks)`) and rewrites `self.waiting` in that order. Everything
else (token budget, preemption, chunked prefill, prefix caching, the connector's `None` = "not yet" answers) is
vLLM's own code. Requests the policy does not track (preempted or resumed ones, which vLLM prepends) keep their
place at the front.

- Without a connector that is a `TierHintSource` (kvtier's `KVTierConnector`; not LMCache's connector nor vLLM's
  MultiConnector), or with `--scheduling-policy priority`, the hook does nothing: vLLM's default behaviour, exactly.
- The hook hands the connector its policy object (`set_scheduling_policy`), so the connector's SSD prefetcher
  issues reads in the same disk-HRRN order (`policy.next_prefetch(now)`, `policy.prefetch_done(id)`).
- Policy knobs: `kv_connector_extra_config["kvtier.scheduler"]` (`SCHEDULER_KEYS`, parsed by
  `DualQueueConfig.from_keys`: delay hit, starvation bound, `ready_order`, and the load plan's cost model and
  weights). The load plan's KV bytes per token come from the KV cache spec. The policy's `planner` is the engine's
  load-or-recompute decision object (`hint_derivation.derive_tier_hint(..., planner=policy.planner)`).
- Async scheduling (vLLM's GPU default): `DualQueueScheduler` builds an `AsyncDualQueueScheduler` (AsyncScheduler
  base) when `scheduler_config.async_scheduling` is on; the plain `Scheduler` base otherwise (CPU).
Times are `time.time()` seconds, the clock of vLLM's `Request.arrival_time`.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import replace
from typing import Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.request_queue import FCFSRequestQueue
from vllm.v1.core.sched.scheduler import Scheduler

from kvtier.scheduler_hooks.base import TierHintSource
from kvtier.scheduler_hooks.dual_queue_policy import DualQueueConfig, DualQueuePolicy
from kvtier.scheduler_hooks.kv_cache_size import kv_bytes_per_token
from kvtier.scheduler_hooks.tier_hint import TierHint, TierState

logger = logging.getLogger(__name__)

__all__ = ["AsyncDualQueueScheduler", "DualQueueScheduler"]

class DualQueueScheduler(Scheduler):
    """vLLM `Scheduler` whose waiting queue is ordered by kvtier's dual-queue policy."""

    def __new__(cls, *args: Any, **kwargs: Any):
        if cls is DualQueueScheduler:
            vllm_config = kwargs.get("vllm_config", args[0] if args else None)
            if getattr(getattr(vllm_config, "scheduler_config", None), "async_scheduling", False):
                cls = AsyncDualQueueScheduler
        return super().__new__(cls)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.kvtier_policy: DualQueuePolicy | None = None
        connector = self.connector
        self._kvtier_hints: TierHintSource | None = connector if isinstance(connector, TierHintSource) else None
        if self._kvtier_hints is None:
            logger.info("kvtier: no connector with tier_hint(); vLLM's default scheduling order is kept")
            return
        if not isinstance(self.waiting, FCFSRequestQueue):
            logger.warning("kvtier: waiting queue is %s, not FCFS; the dual-queue order is not applied",
                           type(self.waiting).__name__)
            self._kvtier_hints = None
            return
        self.kvtier_policy = DualQueuePolicy(self._kvtier_config())
        self._kvtier_hints.set_scheduling_policy(self.kvtier_policy)
        logger.info("kvtier: dual-queue scheduling on (%s)", self.kvtier_policy.config)

    # --- configuration -------------------------------------------------------------------------------------------
    def _kvtier_config(self) -> DualQueueConfig:
        extra: dict = {}
        ktc = getattr(self.vllm_config, "kv_transfer_config", None)
        if ktc is not None:
            extra = dict((getattr(ktc, "kv_connector_extra_config", None) or {}).get("kvtier.scheduler", {}) or {})
        total_blocks = None
        with contextlib.suppress(AttributeError, TypeError, ValueError):
            total_blocks = int(self.kv_cache_config.num_blocks)
        return DualQueueConfig.from_keys(extra, gpu_capacity=total_blocks,
                                         kv_bytes_per_token=kv_bytes_per_token(self.kv_cache_config))

    # --- hints ---------------------------------------------------------------------------------------------------
    def _kvtier_hint(self, request: Any) -> TierHint:
        hint = None
        try:
            hint = self._kvtier_hints.tier_hint(request.request_id) if self._kvtier_hints is not None else None
        except Exception:  # a broken hint source must not stop the engine
            logger.exception("kvtier: tier_hint(%s) failed; treating the request as a miss", request.request_id)
        if hint is None:
            return TierHint(request.request_id, state=TierState.MISS, arrival=float(request.arrival_time))
        if hint.arrival == 0.0:
            hint = replace(hint, arrival=float(request.arrival_time))
        return hint

    def _kvtier_need(self, request: Any, hint: TierHint) -> int:
        new_tokens = max(int(request.num_tokens) - hint.gpu_tokens, 1)
        return -(-new_tokens // self.block_size)

    # --- the hook ------------------------------------------------------------------------------------------------
    def _kvtier_reorder(self) -> None:
        policy = self.kvtier_policy
        if policy is None or not self.waiting:
            return
        now = time.time()
        for req in self.waiting:
            if req.num_computed_tokens > 0 and req.request_id not in policy:
                continue  # preempted / resumed: keeps vLLM's own place for it (the front)
            hint = self._kvtier_hint(req)
            policy.update(hint, self._kvtier_need(req, hint))
        free = self.kv_cache_manager.block_pool.get_num_free_blocks()
        pos = {rid: i for i, rid in enumerate(policy.order(now, free))}
        untracked = [r for r in self.waiting if r.request_id not in pos]
        tracked = sorted((r for r in self.waiting if r.request_id in pos), key=lambda r: pos[r.request_id])
        self.waiting.clear()
        self.waiting.extend(untracked + tracked)

    def _kvtier_after_schedule(self) -> None:
        policy = self.kvtier_policy
        if policy is None or not len(policy):
            return
        now = time.time()
        still = {r.request_id for r in self.waiting}
        for req in self.kv_holding_waiting if hasattr(self, "kv_holding_waiting") else ():
            still.discard(req.request_id)  # blocks allocated: admitted (waiting for its async load)
        for rid in [r for r in policy.ids() if r not in still]:
            policy.dispatched(rid, now)

    def schedule(self, *args: Any, **kwargs: Any):
        self._kvtier_reorder()
        out = super().schedule(*args, **kwargs)
        self._kvtier_after_schedule()
        return out

    def finish_requests(self, request_ids, finished_status):
        finished = super().finish_requests(request_ids, finished_status)
        if self.kvtier_policy is not None:
            for req in finished or ():
                self.kvtier_policy.remove(req.request_id)
        return finished


class AsyncDualQueueScheduler(DualQueueScheduler, AsyncScheduler):
    """The same hook over vLLM's `AsyncScheduler` (GPU default with async scheduling)."""
