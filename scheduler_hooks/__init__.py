"""kvtier.scheduler_hooks: storage-aware request scheduling for engines serving from kvtier's host and SSD tiers.

Plain-Python core (no vLLM import; the simulator, the connector's prefetcher and the vLLM hook share it):
- `TierHint` / `TierState` (`tier_hint`): where a waiting request's prefix KV lives, published by the connector.
- `DiskHRRNQueue` (`hrrn`): SSD reads in disk-HRRN order (1 + waiting time / KV bytes, highest first).
- `SchedulingPolicy` (`base`): the contract every caller drives a policy through; `TierHintSource` (`base`): what
  the vLLM hook needs from the KV connector (kvtier's `KVTierConnector`).
- The prefix walk (`prefix_walk`): one rule for where a prompt's chunks are, the worker's lookups and the simulator.
- `DualQueuePolicy` (`dual_queue_policy`, knobs in `dual_queue_config`): Bidaw's ready + preparing queues, Strata's
  delay-hit avoidance, a starvation bound; `FCFSPolicy` (`fcfs`), the baseline; `make_scheduling_policy(name)`.
- `LoadPlanner` (`load_plan`) and `derive_tier_hint` (`hint_derivation`): load or recompute, per request.

`kvtier simulate` (a discrete-event replay with the same policy objects) and its cost model live in `kvtier.sim`.

vLLM hook (imported lazily, needs vLLM): `DualQueueScheduler` (`dual_queue`), for
`--scheduler-cls kvtier.scheduler_hooks.DualQueueScheduler`.
"""

from __future__ import annotations

from typing import Any

from kvtier.scheduler_hooks.dual_queue_policy import (
    SCHEDULER_NAMES,
    DualQueueConfig,
    DualQueuePolicy,
    FCFSPolicy,
    SchedulingPolicy,
    make_scheduling_policy,
)
from kvtier.scheduler_hooks.hrrn import DiskHRRNQueue, response_ratio
from kvtier.scheduler_hooks.tier_hint import TierHint, TierState, classify

__all__ = [
    "SCHEDULER_NAMES",
    "DiskHRRNQueue",
    "DualQueueConfig",
    "DualQueuePolicy",
    "DualQueueScheduler",
    "FCFSPolicy",
    "SchedulingPolicy",
    "TierHint",
    "TierState",
    "classify",
    "make_scheduling_policy",
    "response_ratio",
]


def __getattr__(name: str) -> Any:  # PEP 562: the vLLM hook is imported only when asked for
    if name in ("DualQueueScheduler", "AsyncDualQueueScheduler"):
        from kvtier.scheduler_hooks import dual_queue

        return getattr(dual_queue, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
