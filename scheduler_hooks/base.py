"""The contract of a scheduling policy (`SchedulingPolicy`), the record its queues keep per waiting request, and what
the vLLM hook needs from a KV connector (`TierHintSource`).

Three callers drive a policy, each through this contract and nothing else: the vLLM hook
(`scheduler_hooks/dual_queue.py`: `update`, `order`, `dispatched`, `remove`), the connector's scheduler side
(`connector/scheduler_side.py`: prefetch order, delay-hit holds, the load planner and its context, the idle-GPU
re-plan) and the simulator (`kvtier simulate`: all of it). `DualQueuePolicy` implements every member; `FCFSPolicy`
(the baseline) has no planner and answers the planning members with their neutral values.

Call protocol (one thread; the caller serialises; nothing blocks):
    add(hint, gpu_need)           a request was queued (`gpu_need`: GPU KV units it must allocate, same unit as
                                  the `free_gpu` passed to `pick`/`order`: blocks in vLLM, tokens in the simulator)
    update(hint)                  data moved: a newer hint for a waiting request (moves it between queues; the
                                  hint's state is authoritative: publish LOADING while its read is in flight)
    next_prefetch(now)            prefetcher: which request's SSD read to issue next (None: nothing to read)
    prefetch_done(request_id)     its read landed in host memory: promote to the ready queue
    pick(now, free_gpu)           scheduler: the next request to admit, or None (not removed)
    order(now, free_gpu)          scheduler: every waiting request in the order to try (for vLLM's waiting queue)
    holds(request_id, now)        scheduler: whether a request must wait for a delay hit (a connector says "not yet")
    dispatched(request_id, now)   it was admitted: it leaves the queues; its wait feeds the mean
    observe_gpu_busy(now, busy_s) the engine side: the GPU's cumulative busy seconds (for `replan_idle`)
    replan_idle(read_s, free_gpu) the GPU is about to idle: maybe recompute a waiting request's SSD part
    remove(request_id)            aborted / finished elsewhere
Hints are derived with the policy's `planner` (None: no load-or-recompute plan) in the context
`gpu_backlog_s` / `gpu_wait_estimate` / `ssd_backlog_bytes` describe.

Plain Python: no vLLM import.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from kvtier.scheduler_hooks.load_plan import LoadPlanner
from kvtier.scheduler_hooks.tier_hint import TierHint

__all__ = ["SchedulingPolicy", "TierHintSource", "Waiting"]


@runtime_checkable
class SchedulingPolicy(Protocol):
    """What the simulator, the vLLM hook and the connector's scheduler side need from a scheduling policy."""

    name: str
    #: counters for reports (name -> count)
    stats: dict[str, int]

    @property
    def planner(self) -> LoadPlanner | None:
        """The engine's load-or-recompute decision object (hints are derived with it), or None: no plan."""
        ...

    # --- the queues ----------------------------------------------------------------------------------------------
    def add(self, hint: TierHint, gpu_need: int = 0) -> None:
        """Queue a new request (or replace the hint of a queued one)."""
        ...

    def update(self, hint: TierHint, gpu_need: int | None = None) -> None:
        """A newer hint for a waiting request (unknown requests are added); its arrival time is kept."""
        ...

    def remove(self, request_id: str) -> bool:
        """Forget a request (aborted, or finished elsewhere); False if it was not queued."""
        ...

    def hint(self, request_id: str) -> TierHint:
        """The latest hint of a queued request (KeyError if it is not queued)."""
        ...

    def ids(self) -> list[str]:
        """Every waiting request the policy tracks."""
        ...

    def __len__(self) -> int: ...

    def __contains__(self, request_id: object) -> bool: ...

    # --- the prefetcher ------------------------------------------------------------------------------------------
    def next_prefetch(self, now: float) -> str | None:
        """The request whose SSD read should be issued now (it becomes LOADING), or None."""
        ...

    def prefetch_done(self, request_id: str, now: float | None = None, hint: TierHint | None = None) -> None:
        """The request's read landed in host memory (`hint`: its new residency, if known): it becomes ready."""
        ...

    # --- the scheduler -------------------------------------------------------------------------------------------
    def pick(self, now: float, free_gpu: int | None = None) -> str | None:
        """The next ready request to admit (not removed: call `dispatched` once admitted), or None."""
        ...

    def order(self, now: float, free_gpu: int | None = None) -> list[str]:
        """Every waiting request, in the order a scheduler should try them this step."""
        ...

    def holds(self, request_id: str, now: float) -> bool:
        """Whether a waiting request must not be admitted now (a delay hit: its prefix is still in flight)."""
        ...

    def dispatched(self, request_id: str, now: float) -> None:
        """The request was admitted: it leaves the queues."""
        ...

    # --- load or recompute ---------------------------------------------------------------------------------------
    def gpu_backlog_s(self, exclude: str | None = None) -> float:
        """Estimated GPU seconds of the ready requests but `exclude` (the GPU wait a request faces)."""
        ...

    def gpu_wait_estimate(self, service_s: float, exclude: str | None = None) -> float:
        """Estimated GPU seconds served before a request of `service_s` GPU seconds (the ready order's)."""
        ...

    def ssd_backlog_bytes(self, exclude: str | None = None) -> int:
        """SSD bytes that waiting requests but `exclude` still read."""
        ...

    def observe_gpu_busy(self, now: float, busy_s: float) -> None:
        """The engine side's report: at `now` the GPU has been busy `busy_s` seconds in total."""
        ...

    def replan_idle(self, read_s: Callable[[TierHint], float], free_gpu: int | None = None) -> str | None:
        """The GPU is about to idle: recompute the SSD part of a waiting request whose read (landing in
        `read_s(hint)` seconds at best) has not landed, where that gives an earlier first token. Returns that
        request (now ready) or None."""
        ...


@runtime_checkable
class TierHintSource(Protocol):
    """What the vLLM hook (`scheduler_hooks/dual_queue.py`) needs from the engine's KV connector to order vLLM's
    waiting queue: kvtier's `KVTierConnector` implements it; another connector (LMCache's, vLLM's MultiConnector)
    does not, and the hook then keeps vLLM's own order."""

    def tier_hint(self, request_id: str) -> TierHint | None:
        """The latest `TierHint` of a waiting request (None if unknown)."""
        ...

    def set_scheduling_policy(self, policy: SchedulingPolicy) -> None:
        """The hook's policy: the connector's SSD prefetches follow its disk-HRRN order."""
        ...


@dataclass(slots=True)
class Waiting:
    """A waiting request's entry in a policy's queues."""

    hint: TierHint
    gpu_need: int
    seq: int
    where: str = ""  # "ready" | "preparing" | "loading"
    key: tuple[Any, ...] = field(default=())  # (arrival, seq): position in the ready list
    service: float = 0.0  # estimated GPU seconds (ready requests)
    inv: float = 0.0  # 1 / service: HRRN's ratio grows at this rate
