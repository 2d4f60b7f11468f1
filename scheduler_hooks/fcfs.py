"""`FCFSPolicy`: the baseline scheduling policy, vLLM's default order (one queue by arrival; the head blocks).

It has the `SchedulingPolicy` contract's every member: no load planner (`planner` is None), so the planning members
answer their neutral values (no backlog, no re-plan) and a connector or simulator driving it plans nothing.
Plain Python.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Callable
from dataclasses import replace

from kvtier.scheduler_hooks.base import Waiting
from kvtier.scheduler_hooks.load_plan import LoadPlanner
from kvtier.scheduler_hooks.tier_hint import TierHint, TierState

__all__ = ["FCFSPolicy"]


class FCFSPolicy:
    """The baseline: one queue in arrival order, the head blocks until it fits (vLLM's default behaviour).

    `prefetch=False` (scheduler `fcfs`): hints are ignored; SSD data is read when the request runs (the engine stalls
    the GPU on it, as vLLM + LMCache's synchronous retrieve does). `prefetch=True` (`fcfs+prefetch`): SSD reads are
    issued eagerly in arrival order, and the head waits for its own read (head-of-line blocking on I/O).
    """

    #: no load-or-recompute plan: hints carry none, nothing is re-planned
    planner: LoadPlanner | None = None

    def __init__(self, prefetch: bool = False) -> None:
        self.prefetch = prefetch
        self.name = "fcfs+prefetch" if prefetch else "fcfs"
        self._reqs: dict[str, Waiting] = {}
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
        w = Waiting(hint=hint, gpu_need=int(gpu_need), seq=self._seq, key=(hint.arrival, self._seq))
        self._reqs[hint.request_id] = w
        bisect.insort(self._queue, w.key + (hint.request_id,))
        if self.prefetch and hint.state.waits_for_prefetch:
            self._to_read.append(hint.request_id)

    def update(self, hint: TierHint, gpu_need: int | None = None) -> None:
        w = self._reqs.get(hint.request_id)
        if w is None:
            self.add(hint, gpu_need or 0)
            return
        if (hint is w.hint or hint == w.hint) and (gpu_need is None or gpu_need == w.gpu_need):
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

    # --- load or recompute: no planner, so nothing to plan with ---------------------------------------------------
    def gpu_backlog_s(self, exclude: str | None = None) -> float:
        return 0.0

    def gpu_wait_estimate(self, service_s: float, exclude: str | None = None) -> float:
        return 0.0

    def ssd_backlog_bytes(self, exclude: str | None = None) -> int:
        return 0

    def observe_gpu_busy(self, now: float, busy_s: float) -> None:
        return None

    def replan_idle(self, read_s: Callable[[TierHint], float], free_gpu: int | None = None) -> str | None:
        return None
