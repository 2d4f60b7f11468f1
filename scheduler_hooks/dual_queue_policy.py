"""The scheduling policy core: Bidaw's dual queue with disk-HRRN, Strata's delay-hit avoidance, a starvation bound.

Plain Python (no vLLM import): the vLLM scheduler hook (`scheduler_hooks/dual_queue.py`), the connector's SSD
prefetcher and the simulator (`kvtier simulate`) drive the *same* objects.

Queues of a `DualQueuePolicy`:
- **ready**: requests whose cached prefix is on the GPU or in host memory, or that have nothing cached
  (`TierState.READY` / `MISS`), FCFS by their *original arrival time*. A request promoted from the preparing
  queue (its SSD data landed in host memory) is inserted at its arrival position, not at the tail.
  `pick` returns the first ready request that fits the free GPU memory: a request too large for it is skipped,
  it does not block the queue.
- **preparing**: requests with part of their prefix only on the SSD (`PREPARING`) or only in the shared tier
  (`REMOTE`: treated alike, sized by `TierHint.prefetch_bytes`), in disk-HRRN order (`DiskHRRNQueue`);
  `next_prefetch` hands the next read to the prefetcher and marks the request `LOADING`.
- **delay-hit avoidance** (`delay_hit=True`): a ready request whose hint reports at least
  `delay_hit_threshold_tokens` prefix tokens being computed or loaded by another in-flight request
  (`TierHint.inflight_tokens`) is passed over until a newer hint reports them landed, instead of recomputing them.
- **starvation bound**: a request that has waited (since arrival) longer than
  `max(starvation_multiple * mean wait, starvation_floor_s)` - the mean over the last `mean_window` dispatched
  requests - goes first: in the ready queue it is no longer skipped for size (the GPU waits for memory to free up
  for it) nor deferred for delay hits; in the preparing queue its read is issued before any HRRN choice.

Call protocol (one thread; the caller serialises):
    add(hint, gpu_need)           a request was queued (`gpu_need`: GPU KV units it must allocate, same unit as
                                  the `free_gpu` passed to `pick`/`order`: blocks in vLLM, tokens in the simulator)
    update(hint)                  data moved: a newer hint for a waiting request (moves it between queues; the
                                  hint's state is authoritative: publish LOADING while its read is in flight)
    next_prefetch(now)            prefetcher: which request's SSD read to issue next (None: nothing to read)
    prefetch_done(request_id)     its read landed in host memory: promote to the ready queue
    pick(now, free_gpu)           scheduler: the next request to admit, or None (not removed)
    order(now, free_gpu)          scheduler: every waiting request in the order to try (for vLLM's waiting queue)
    dispatched(request_id, now)   it was admitted: it leaves the queues; its wait feeds the mean
    remove(request_id)            aborted / finished elsewhere

`FCFSPolicy` is the baseline with the same interface (vLLM's default order; head-of-line blocking).
"""

from __future__ import annotations

import bisect
import logging
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Protocol

from kvtier.scheduler_hooks.hrrn import GiB, DiskHRRNQueue
from kvtier.scheduler_hooks.tier_hint import TierHint, TierState

logger = logging.getLogger(__name__)

__all__ = [
    "SCHEDULER_NAMES",
    "DualQueueConfig",
    "DualQueuePolicy",
    "FCFSPolicy",
    "SchedulingPolicy",
    "make_scheduling_policy",
]


@dataclass(frozen=True, slots=True)
class DualQueueConfig:
    """Knobs of `DualQueuePolicy` (defaults: the values used in production and by `kvtier simulate`)."""

    delay_hit: bool = True
    delay_hit_threshold_tokens: int = 100
    starvation_multiple: float = 4.0
    starvation_floor_s: float = 2.0
    mean_window: int = 256
    hrrn_byte_unit: int = GiB
    #: total GPU KV units (same unit as `gpu_need`); a request needing more can never run, and the starvation bound
    #: does not hold the queue for it (the engine must reject it). None: unknown.
    gpu_capacity: int | None = None

    def __post_init__(self) -> None:
        if self.delay_hit_threshold_tokens < 1:
            raise ValueError("delay_hit_threshold_tokens must be >= 1")
        if self.starvation_multiple <= 0 or self.starvation_floor_s < 0:
            raise ValueError("starvation_multiple must be > 0 and starvation_floor_s >= 0")
        if self.mean_window < 1:
            raise ValueError("mean_window must be >= 1")


@dataclass(slots=True)
class _Waiting:
    hint: TierHint
    gpu_need: int
    seq: int
    where: str = ""  # "ready" | "preparing" | "loading"
    key: tuple = field(default=())  # (arrival, seq): position in the ready list


class SchedulingPolicy(Protocol):
    """What the simulator and the vLLM hook need from a scheduling policy."""

    name: str

    def add(self, hint: TierHint, gpu_need: int = 0) -> None: ...
    def update(self, hint: TierHint, gpu_need: int | None = None) -> None: ...
    def remove(self, request_id: str) -> bool: ...
    def next_prefetch(self, now: float) -> str | None: ...
    def prefetch_done(self, request_id: str, now: float | None = None) -> None: ...
    def pick(self, now: float, free_gpu: int | None = None) -> str | None: ...
    def holds(self, request_id: str, now: float) -> bool: ...
    def order(self, now: float, free_gpu: int | None = None) -> list[str]: ...
    def dispatched(self, request_id: str, now: float) -> None: ...
    def hint(self, request_id: str) -> TierHint: ...
    def ids(self) -> list[str]: ...
    def __len__(self) -> int: ...
    def __contains__(self, request_id: object) -> bool: ...


class _WaitStats:
    """Mean waiting time over the last `window` dispatched requests."""

    __slots__ = ("_window", "_sum", "count")

    def __init__(self, window: int) -> None:
        self._window: deque[float] = deque(maxlen=window)
        self._sum = 0.0
        self.count = 0

    def add(self, wait: float) -> None:
        if len(self._window) == self._window.maxlen:
            self._sum -= self._window[0]
        self._window.append(wait)
        self._sum += wait
        self.count += 1

    @property
    def mean(self) -> float:
        return self._sum / len(self._window) if self._window else 0.0


class DualQueuePolicy:
    """Ready queue (FCFS by arrival) + preparing queue (disk-HRRN) + delay-hit deferral + starvation bound."""

    name = "dual-queue"

    def __init__(self, config: DualQueueConfig | None = None) -> None:
        self.config = config or DualQueueConfig()
        self._reqs: dict[str, _Waiting] = {}
        self._ready: list[tuple[float, int, str]] = []  # sorted by (arrival, seq)
        self._preparing = DiskHRRNQueue(self.config.hrrn_byte_unit)
        self._loading: set[str] = set()
        self._seq = 0
        self._waits = _WaitStats(self.config.mean_window)
        #: counters for reports
        self.stats = {"skipped_oversized": 0, "deferred_delay_hit": 0, "starvation_overrides": 0, "promoted": 0}

    # --- bookkeeping ---------------------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._reqs)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._reqs

    def hint(self, request_id: str) -> TierHint:
        return self._reqs[request_id].hint

    @property
    def mean_wait(self) -> float:
        return self._waits.mean

    def starvation_threshold(self) -> float:
        """Seconds since arrival after which a waiting request is served before anything else."""
        return max(self.config.starvation_multiple * self._waits.mean, self.config.starvation_floor_s)

    def ids(self) -> list[str]:
        """Every waiting request the policy tracks."""
        return list(self._reqs)

    def ready_ids(self) -> list[str]:
        return [rid for _, _, rid in self._ready]

    def preparing_ids(self, now: float = 0.0) -> list[str]:
        return self._preparing.ordered(now)

    def loading_ids(self) -> list[str]:
        return sorted(self._loading, key=lambda r: self._reqs[r].key)

    def deferred_ids(self) -> list[str]:
        return [rid for _, _, rid in self._ready if self._deferred(self._reqs[rid])]

    def holds(self, request_id: str, now: float) -> bool:
        """Whether a waiting request must not be admitted now for a delay hit: its in-flight prefix is still
        being computed by another request, and it is not starving. A scheduler that walks its waiting queue
        on its own (vLLM) asks this through the connector, which answers "not yet" for it."""
        w = self._reqs.get(request_id)
        if w is None or w.where != "ready" or not self._deferred(w):
            return False
        if self._starving(w, now, self.starvation_threshold()):
            self.stats["starvation_overrides"] += 1
            return False
        self.stats["deferred_delay_hit"] += 1
        return True

    def _deferred(self, w: _Waiting) -> bool:
        return self.config.delay_hit and w.hint.inflight_tokens >= self.config.delay_hit_threshold_tokens

    # --- queue moves ---------------------------------------------------------------------------------------------
    def _detach(self, w: _Waiting) -> None:
        rid = w.hint.request_id
        if w.where == "ready":
            i = bisect.bisect_left(self._ready, w.key + (rid,))
            if i < len(self._ready) and self._ready[i][2] == rid:
                del self._ready[i]
        elif w.where == "preparing":
            self._preparing.remove(rid)
        elif w.where == "loading":
            self._loading.discard(rid)
        w.where = ""

    def _place(self, w: _Waiting) -> None:
        rid, state = w.hint.request_id, w.hint.state
        if state.schedulable:
            bisect.insort(self._ready, w.key + (rid,))  # by original arrival, whatever the promotion time
            w.where = "ready"
        elif state is TierState.LOADING:
            self._loading.add(rid)
            w.where = "loading"
        else:
            self._preparing.push(rid, w.hint.arrival, w.hint.prefetch_bytes)
            w.where = "preparing"

    def add(self, hint: TierHint, gpu_need: int = 0) -> None:
        """Queue a new request (or replace the hint of a queued one)."""
        if hint.request_id in self._reqs:
            self.update(hint, gpu_need)
            return
        self._seq += 1
        w = _Waiting(hint=hint, gpu_need=int(gpu_need), seq=self._seq, key=(hint.arrival, self._seq))
        self._reqs[hint.request_id] = w
        self._place(w)

    def update(self, hint: TierHint, gpu_need: int | None = None) -> None:
        """A newer hint for a waiting request; unknown requests are added. The arrival time is kept."""
        w = self._reqs.get(hint.request_id)
        if w is None:
            self.add(hint, gpu_need or 0)
            return
        if hint.arrival != w.hint.arrival:
            hint = replace(hint, arrival=w.hint.arrival)
        if gpu_need is not None:
            w.gpu_need = int(gpu_need)
        old = w.where
        new_where = "ready" if hint.state.schedulable else ("loading" if hint.state is TierState.LOADING else "preparing")
        if old == new_where == "preparing":
            w.hint = hint
            self._preparing.push(hint.request_id, hint.arrival, hint.prefetch_bytes)  # size update, keeps position
            return
        if old == new_where:
            w.hint = hint
            return
        self._detach(w)
        w.hint = hint
        if new_where == "ready" and old in ("preparing", "loading"):
            self.stats["promoted"] += 1
        self._place(w)

    def remove(self, request_id: str) -> bool:
        w = self._reqs.pop(request_id, None)
        if w is None:
            return False
        self._detach(w)
        return True

    # --- prefetcher side -----------------------------------------------------------------------------------------
    def next_prefetch(self, now: float) -> str | None:
        """The preparing request whose SSD read should be issued now; it becomes LOADING. None if none waits."""
        rid = self._preparing.pop(now, starve_after_s=self.starvation_threshold())
        if rid is None:
            return None
        w = self._reqs[rid]
        w.hint = w.hint.with_state(TierState.LOADING)
        w.where = "loading"
        self._loading.add(rid)
        return rid

    def prefetch_order(self, now: float) -> list[str]:
        """Preparing requests in the order their reads would be issued (for a prefetcher that issues several)."""
        return self._preparing.ordered(now, starve_after_s=self.starvation_threshold())

    def prefetch_done(self, request_id: str, now: float | None = None, hint: TierHint | None = None) -> None:
        """The request's SSD data is in host memory: promote it (at its arrival position) to the ready queue."""
        w = self._reqs.get(request_id)
        if w is None:
            return
        if hint is None:
            h = w.hint
            hint = TierHint(
                request_id=h.request_id,
                gpu_tokens=h.gpu_tokens,
                host_tokens=h.host_tokens + h.ssd_tokens + h.remote_tokens,
                ssd_tokens=0,
                ssd_bytes=0,
                state=TierState.READY,
                arrival=h.arrival,
                inflight_tokens=h.inflight_tokens,
            )
        self.update(hint)

    # --- scheduler side ------------------------------------------------------------------------------------------
    def _starving(self, w: _Waiting, now: float, threshold: float) -> bool:
        cap = self.config.gpu_capacity
        return now - w.hint.arrival > threshold and (cap is None or w.gpu_need <= cap)

    def pick(self, now: float, free_gpu: int | None = None) -> str | None:
        """The next ready request to admit (not removed; call `dispatched` once admitted), or None.

        `free_gpu=None` means no memory check. Returns None when the oldest ready request is starving and does not
        fit: the caller then waits for memory to free up instead of admitting younger requests (the bound).
        """
        if not self._ready:
            return None
        reqs = self._reqs
        head = reqs[self._ready[0][2]]
        if self._starving(head, now, self.starvation_threshold()):
            fits = free_gpu is None or head.gpu_need <= free_gpu
            if not fits or self._deferred(head):
                self.stats["starvation_overrides"] += 1
            return head.hint.request_id if fits else None
        delay_hit = self.config.delay_hit
        thr = self.config.delay_hit_threshold_tokens
        for _, _, rid in self._ready:
            w = reqs[rid]
            if delay_hit and w.hint.inflight_tokens >= thr:
                self.stats["deferred_delay_hit"] += 1
                continue
            if free_gpu is not None and w.gpu_need > free_gpu:
                self.stats["skipped_oversized"] += 1
                continue
            return rid
        return None

    def order(self, now: float, free_gpu: int | None = None, with_prefetch_order: bool = False) -> list[str]:
        """Every waiting request, in the order a scheduler should try them this step.

        Admissible ready requests come first (arrival order, each counted against `free_gpu` as if admitted), then
        ready requests that do not fit or are deferred, then loading and preparing requests (which a connector
        answers with "not yet"; in disk-HRRN order only with `with_prefetch_order=True`, which costs a sort). A starving head that does not fit stays first, so that a scheduler which stops at
        the first request it cannot allocate (vLLM) waits for memory for it.
        """
        out: list[str] = []
        later: list[str] = []
        free = free_gpu
        rest = self._ready
        if rest:
            head = self._reqs[rest[0][2]]
            if self._starving(head, now, self.starvation_threshold()):
                out.append(head.hint.request_id)
                if free is not None and head.gpu_need > free:
                    later = [rid for _, _, rid in rest[1:]]  # the scheduler stops at the head: reserve for it
                    rest = []
                else:
                    rest = rest[1:]
                    if free is not None:
                        free -= head.gpu_need
        for _, _, rid in rest:
            w = self._reqs[rid]
            if self._deferred(w) or (free is not None and w.gpu_need > free):
                later.append(rid)
                continue
            out.append(rid)
            if free is not None:
                free -= w.gpu_need
        out.extend(later)
        if with_prefetch_order:
            out.extend(self.loading_ids())
            out.extend(self.prefetch_order(now))
        else:  # a connector answers "not yet" for all of them: their relative order does not matter
            out.extend(self._loading)
            out.extend(e.request_id for e in self._preparing)
        return out

    def dispatched(self, request_id: str, now: float) -> None:
        """The request was admitted to the GPU: it leaves the queues and its wait counts toward the mean."""
        w = self._reqs.pop(request_id, None)
        if w is None:
            return
        self._detach(w)
        self._waits.add(max(0.0, now - w.hint.arrival))


class FCFSPolicy:
    """The baseline: one queue in arrival order, the head blocks until it fits (vLLM's default behaviour).

    `prefetch=False` (scheduler `fcfs`): hints are ignored; SSD data is read when the request runs (the engine stalls
    the GPU on it, as vLLM + LMCache's synchronous retrieve does). `prefetch=True` (`fcfs+prefetch`): SSD reads are
    issued eagerly in arrival order, and the head waits for its own read (head-of-line blocking on I/O).
    """

    def __init__(self, prefetch: bool = False) -> None:
        self.prefetch = prefetch
        self.name = "fcfs+prefetch" if prefetch else "fcfs"
        self._reqs: dict[str, _Waiting] = {}
        self._queue: list[tuple[float, int, str]] = []  # sorted by (arrival, seq)
        self._to_read: deque[str] = deque()
        self._seq = 0
        self.stats: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._reqs)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._reqs

    def add(self, hint: TierHint, gpu_need: int = 0) -> None:
        if hint.request_id in self._reqs:
            self.update(hint, gpu_need)
            return
        self._seq += 1
        w = _Waiting(hint=hint, gpu_need=int(gpu_need), seq=self._seq, key=(hint.arrival, self._seq))
        self._reqs[hint.request_id] = w
        bisect.insort(self._queue, w.key + (hint.request_id,))
        if self.prefetch and hint.state.waits_for_prefetch:
            self._to_read.append(hint.request_id)

    def update(self, hint: TierHint, gpu_need: int | None = None) -> None:
        w = self._reqs.get(hint.request_id)
        if w is None:
            self.add(hint, gpu_need or 0)
            return
        was_preparing = w.hint.state.waits_for_prefetch
        w.hint = replace(hint, arrival=w.hint.arrival)
        if gpu_need is not None:
            w.gpu_need = int(gpu_need)
        if self.prefetch and hint.state.waits_for_prefetch and not was_preparing:
            self._to_read.append(hint.request_id)

    def hint(self, request_id: str) -> TierHint:
        return self._reqs[request_id].hint

    def ids(self) -> list[str]:
        return list(self._reqs)

    def remove(self, request_id: str) -> bool:
        w = self._reqs.pop(request_id, None)
        if w is None:
            return False
        i = bisect.bisect_left(self._queue, w.key + (request_id,))
        if i < len(self._queue) and self._queue[i][2] == request_id:
            del self._queue[i]
        return True

    def next_prefetch(self, now: float) -> str | None:
        while self.prefetch and self._to_read:
            rid = self._to_read.popleft()
            w = self._reqs.get(rid)
            if w is not None and w.hint.state.waits_for_prefetch:
                w.hint = w.hint.with_state(TierState.LOADING)
                return rid
        return None

    def prefetch_done(self, request_id: str, now: float | None = None, hint: TierHint | None = None) -> None:
        w = self._reqs.get(request_id)
        if w is None:
            return
        h = hint or TierHint(
            request_id=request_id,
            gpu_tokens=w.hint.gpu_tokens,
            host_tokens=w.hint.host_tokens + w.hint.ssd_tokens + w.hint.remote_tokens,
            state=TierState.READY,
            arrival=w.hint.arrival,
            inflight_tokens=w.hint.inflight_tokens,
        )
        self.update(h)

    def holds(self, request_id: str, now: float) -> bool:
        return False  # no delay-hit avoidance in the baseline

    def pick(self, now: float, free_gpu: int | None = None) -> str | None:
        if not self._queue:
            return None
        w = self._reqs[self._queue[0][2]]
        if free_gpu is not None and w.gpu_need > free_gpu:
            return None
        if self.prefetch and not w.hint.state.schedulable:
            return None
        return w.hint.request_id

    def order(self, now: float, free_gpu: int | None = None) -> list[str]:
        return [rid for _, _, rid in self._queue]

    def dispatched(self, request_id: str, now: float) -> None:
        self.remove(request_id)


SCHEDULER_NAMES = ("fcfs", "fcfs+prefetch", "dual-queue", "dual-queue+delay-hit")


def make_scheduling_policy(name: str, config: DualQueueConfig | None = None) -> SchedulingPolicy:
    """`fcfs`, `fcfs+prefetch`, `dual-queue` (delay-hit off) or `dual-queue+delay-hit`."""
    if name == "fcfs":
        return FCFSPolicy(prefetch=False)
    if name == "fcfs+prefetch":
        return FCFSPolicy(prefetch=True)
    if name in ("dual-queue", "dual-queue+delay-hit"):
        cfg = replace(config or DualQueueConfig(), delay_hit=name == "dual-queue+delay-hit")
        p = DualQueuePolicy(cfg)
        p.name = name
        return p
    raise ValueError(f"unknown scheduler {name!r}; choose one of {', '.join(SCHEDULER_NAMES)}")
