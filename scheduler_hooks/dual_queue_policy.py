"""The scheduling policy core: Bidaw's dual queue with disk-HRRN, Strata's delay-hit avoidance, a starvation bound.

Plain Python (no vLLM import): the vLLM scheduler hook (`scheduler_hooks/dual_queue.py`), the connector's SSD
prefetcher and the simulator (`kvtier simulate`) drive the *same* objects.

Queues of a `DualQueuePolicy`:
- **ready**: requests whose cached prefix is on the GPU or in host memory, or that have nothing cached
  (`TierState.READY` / `MISS`). Order (`ready_order`): `arrival` (Bidaw) is FCFS by the *original arrival time*
  (a request promoted from the preparing queue, its SSD data landed in host memory, is inserted at its arrival
  position, not at the tail); `hrrn` (SGLang's prefill policy) is highest response ratio next,
  (waiting time + 1 ms) / estimated service time, the service time being the GPU seconds of its uncached part
  and its loads (the load plan's cost model: short prefills go first, waiting raises every ratio). `pick` returns
  the first ready request in that order that fits the free GPU memory: a request too large for it is skipped, it
  does not block the queue.
- **preparing**: requests with part of their prefix only on the SSD (`PREPARING`) or only in the shared tier
  (`REMOTE`: treated alike, sized by `TierHint.prefetch_bytes`), in disk-HRRN order (`DiskHRRNQueue`);
  `next_prefetch` hands the next read to the prefetcher and marks the request `LOADING`.
- **delay-hit avoidance** (`delay_hit=True`): a ready request whose hint reports at least
  `delay_hit_threshold_tokens` prefix tokens being computed or loaded by another in-flight request
  (`TierHint.inflight_tokens`) is passed over until a newer hint reports them landed, instead of recomputing them;
  and the idle-GPU re-plan (`replan_idle`) does not recompute such a request's SSD part (Strata: a prefix being
  computed *or loaded* by another request is waited for). `delay_hit_own_loads=True` extends that to a request
  whose *own* SSD read is issued: it waits for the read at an idle GPU (fewer recomputed tokens; gives up the load
  plan's "never slower than recomputing at an idle GPU" for that request).
- **idle-GPU re-plan under load** (`idle_replan_counts_arrivals=True`, the default): `replan_idle` charges a
  recompute with the work expected to arrive while the read is in flight, at the GPU's recent busy share
  (`observe_gpu_busy`, `GpuLoad`): it recomputes only where `fallback_gpu_s + load * read_s < read_s + gpu_s`
  (`LoadPlanner.recompute_now`). At an unloaded engine that is the plain rule (an earlier first token than
  waiting for the read); under load the GPU time that arrivals would have used in the read's idle window counts.
- **load or recompute**: `planner` (a `LoadPlanner` built from `load_plan`) is the engine's one decision object;
  the connector and the simulator derive hints with it (`hint_derivation.derive_tier_hint`), so a request whose
  SSD part is cheaper to recompute arrives READY instead of PREPARING. `gpu_backlog_s()` / `ssd_backlog_bytes()`
  are the queue's share of the plan's context.
- **starvation bound**: a request that has waited (since arrival) longer than
  `max(starvation_multiple * mean wait, starvation_floor_s)` - the mean over the last `mean_window` dispatched
  requests - goes first: in the ready queue it is no longer skipped for size (the GPU waits for memory to free up
  for it) nor deferred for delay hits; in the preparing queue its read is issued before any HRRN choice.

The call protocol is the `SchedulingPolicy` contract (`scheduler_hooks/base.py`); the knobs are
`DualQueueConfig` (`scheduler_hooks/dual_queue_config.py`). `FCFSPolicy` (`scheduler_hooks/fcfs.py`) is the
baseline with the same interface (vLLM's default order; head-of-line blocking); `make_scheduling_policy(name)`
builds either by name. The names below stay importable from here.
"""

from __future__ import annotations

import bisect
import logging
import math
from collections import deque
from collections.abc import Callable
from dataclasses import replace

from kvtier.scheduler_hooks.base import SchedulingPolicy, Waiting
from kvtier.scheduler_hooks.dual_queue_config import READY_ORDERS, SCHEDULER_KEYS, DualQueueConfig
from kvtier.scheduler_hooks.fcfs import FCFSPolicy
from kvtier.scheduler_hooks.gpu_load import GpuLoad
from kvtier.scheduler_hooks.hrrn import DiskHRRNQueue
from kvtier.scheduler_hooks.load_plan import LoadPlanner
from kvtier.scheduler_hooks.ratio_index import RatioIndex
from kvtier.scheduler_hooks.tier_hint import TierHint, TierState

logger = logging.getLogger(__name__)

__all__ = [
    "BASELINE_NAMES",
    "DUAL_QUEUE_MODIFIERS",
    "KVTIER_SCHEDULER_NAMES",
    "OWN_LOADS_NAMES",
    "READY_ORDERS",
    "SCHEDULER_KEYS",
    "SCHEDULER_NAMES",
    "DualQueueConfig",
    "DualQueuePolicy",
    "FCFSPolicy",
    "SchedulingPolicy",
    "make_scheduling_policy",
]


#: HRRN's ratio is (waiting time + this) / service: among requests that waited equally long (a burst arriving at
#: once) the shortest goes first
_RATIO_EPS_S = 1e-3
_BUCKETS = 64  # log buckets of service time: 2**(k/4) ms, 0.5 ms .. ~28 min


def _bucket(service_s: float) -> int:
    if service_s <= 0.0005:
        return 0
    return min(_BUCKETS - 1, int(4 * math.log2(service_s * 2000.0)))



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
    """Ready queue (FCFS by arrival, or HRRN) + preparing queue (disk-HRRN) + delay-hit deferral + starvation bound,
    and the engine's load-or-recompute planner."""

    name = "dual-queue"

    def __init__(self, config: DualQueueConfig | None = None) -> None:
        self.config = config or DualQueueConfig()
        self.planner = LoadPlanner(self.config.load_plan)
        self._reqs: dict[str, Waiting] = {}
        #: ready entries (arrival, seq, request id, its Waiting), sorted by (arrival, seq), which are unique
        self._ready: list[tuple[float, int, str, Waiting]] = []
        self._preparing = DiskHRRNQueue(self.config.hrrn_byte_unit)
        self._loading: set[str] = set()
        self._seq = 0
        self._waits = _WaitStats(self.config.mean_window)
        self._hrrn = self.config.ready_order == "hrrn"
        self._beta = self.config.hrrn_service_exponent
        self._index = RatioIndex(_RATIO_EPS_S) if self._hrrn else None  # the ready requests, for HRRN
        self._ready_work = 0.0  # sum of the ready requests' service estimates
        self._work_buckets = [0.0] * _BUCKETS  # the same, by service time (log buckets), for HRRN's wait estimate
        self._prep_bytes = 0  # SSD bytes of preparing + loading requests
        #: the GPU's recent busy share (`observe_gpu_busy`): the idle-GPU re-plan's rate of work arriving meanwhile
        self.gpu_load = GpuLoad()
        #: counters for reports
        self.stats = {"skipped_oversized": 0, "deferred_delay_hit": 0, "starvation_overrides": 0, "promoted": 0,
                      "lookahead_overrides": 0}

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
        return [e[2] for e in self._ready]

    def preparing_ids(self, now: float = 0.0) -> list[str]:
        return self._preparing.ordered(now)

    def loading_ids(self) -> list[str]:
        return sorted(self._loading, key=lambda r: self._reqs[r].key)

    def deferred_ids(self) -> list[str]:
        return [e[2] for e in self._ready if self._deferred(e[3])]

    def gpu_backlog_s(self, exclude: str | None = None) -> float:
        """Estimated GPU seconds of every ready request but `exclude` (the plan's estimate of the wait a request
        faces)."""
        w = self._reqs.get(exclude) if exclude is not None else None
        own = w.service if w is not None and w.where == "ready" else 0.0
        return max(self._ready_work - own, 0.0)

    def gpu_wait_estimate(self, service_s: float, exclude: str | None = None) -> float:
        """Estimated GPU seconds of the ready requests served before a request of `service_s` GPU seconds: all of
        them in arrival order; under HRRN those with a shorter service (and half of its own bucket's)."""
        if not self._hrrn:
            return self.gpu_backlog_s(exclude)
        k = _bucket(service_s)
        est = sum(self._work_buckets[:k]) + 0.5 * self._work_buckets[k]
        w = self._reqs.get(exclude) if exclude is not None else None
        if w is not None and w.where == "ready":
            kk = _bucket(w.service)
            est -= w.service if kk < k else (0.5 * w.service if kk == k else 0.0)
        return max(est, 0.0)

    def replan_idle(self, read_s: Callable[[TierHint], float], free_gpu: int | None = None) -> str | None:
        """The GPU is about to idle with nothing admissible: recompute the SSD part of the preparing or loading
        request that gains most by it (`LoadPlanner.recompute_now`: an earlier first token than waiting for its
        read, which lands in `read_s(hint)` seconds at best; an issued read is left to finish into host memory).
        With delay-hit avoidance a request whose hint counts `inflight_tokens` (another request's read or prefill
        is bringing that part of its prefix) is not recomputed: it waits for them, as in the ready queue; with
        `delay_hit_own_loads` neither is one whose own read is issued. With `idle_replan_counts_arrivals` the gain
        is net of the work expected to arrive while the read is in flight (`arriving_load`).
        Returns that request, now READY, or None."""
        best: Waiting | None = None
        best_gain, best_read = 0.0, 0.0
        rho = self.arriving_load()
        for rid in [e.request_id for e in self._preparing] + list(self._loading):
            w = self._reqs[rid]
            plan = w.hint.plan
            if plan is None or (free_gpu is not None and w.gpu_need > free_gpu):
                continue
            if self._deferred(w) or (w.where == "loading" and self.config.delay_hit and
                                     self.config.delay_hit_own_loads):
                continue  # delay hit: its prefix is being loaded or computed by another request (or its own read)
            rs = read_s(w.hint)
            gain = self.planner.idle_gain_s(plan, rs, rho)
            if gain > best_gain:
                best, best_gain, best_read = w, gain, rs
        if best is None or best.hint.plan is None:  # (a waiting request with an SSD part has a plan)
            return None
        plan = self.planner.recompute_now(best.hint.plan, best_read, rho)
        if plan is None:
            return None
        self.update(replace(best.hint, state=TierState.READY if plan.use_tokens > 0 else TierState.MISS, plan=plan))
        return best.hint.request_id

    def observe_gpu_busy(self, now: float, busy_s: float) -> None:
        """The engine side's report: at `now` the GPU has been busy `busy_s` seconds in total (`GpuLoad`)."""
        self.gpu_load.observe(now, busy_s)

    def arriving_load(self) -> float:
        """GPU seconds per second the idle-GPU re-plan expects to arrive while a read is in flight: the GPU's
        recent busy share (0 with `idle_replan_counts_arrivals` off, or before any `observe_gpu_busy`)."""
        return self.gpu_load.load if self.config.idle_replan_counts_arrivals else 0.0

    def ssd_backlog_bytes(self, exclude: str | None = None) -> int:
        """SSD bytes that preparing and loading requests but `exclude` still read."""
        w = self._reqs.get(exclude) if exclude is not None else None
        own = w.hint.ssd_bytes if w is not None and w.where in ("preparing", "loading") else 0
        return max(self._prep_bytes - own, 0)

    def service_s(self, hint: TierHint) -> float:
        """Estimated GPU seconds of a request's job (its uncached prefill and its loads), from the planner's model."""
        use = hint.use_tokens
        s = self.planner.service_s(max(hint.prompt_tokens, use), use, max(use - hint.gpu_tokens, 0))
        return max(s, 1e-6)  # HRRN divides by it

    def _inverse_service(self, service: float) -> float:
        """HRRN's ratio is (waiting time + eps) times this: 1 / service ** `hrrn_service_exponent`."""
        return 1.0 / service if self._beta == 1.0 else service ** -self._beta

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

    def _deferred(self, w: Waiting) -> bool:
        return self.config.delay_hit and w.hint.inflight_tokens >= self.config.delay_hit_threshold_tokens

    # --- queue moves ---------------------------------------------------------------------------------------------
    def _detach(self, w: Waiting) -> None:
        rid = w.hint.request_id
        if w.where == "ready":
            i = bisect.bisect_left(self._ready, w.key + (rid,))
            if i < len(self._ready) and self._ready[i][2] == rid:
                del self._ready[i]
            if self._index is not None:
                self._index.remove(rid)
            self._ready_work -= w.service
            self._work_buckets[_bucket(w.service)] -= w.service
            if not self._ready:
                self._ready_work = 0.0  # no drift from float sums
                self._work_buckets = [0.0] * _BUCKETS
        elif w.where == "preparing":
            self._preparing.remove(rid)
            self._prep_bytes -= w.hint.ssd_bytes
        elif w.where == "loading":
            self._loading.discard(rid)
            self._prep_bytes -= w.hint.ssd_bytes
        w.where = ""

    def _place(self, w: Waiting) -> None:
        rid, state = w.hint.request_id, w.hint.state
        if state.schedulable:
            bisect.insort(self._ready, w.key + (rid, w))  # by original arrival, whatever the promotion time
            w.where = "ready"
            w.service = self.service_s(w.hint)
            w.inv = self._inverse_service(w.service)
            self._ready_work += w.service
            self._work_buckets[_bucket(w.service)] += w.service
            if self._index is not None:
                self._index.put(rid, w.hint.arrival, w.inv, w.gpu_need, self._deferred(w), w.service)
        elif state is TierState.LOADING:
            self._loading.add(rid)
            w.where = "loading"
            self._prep_bytes += w.hint.ssd_bytes
        else:
            self._preparing.push(rid, w.hint.arrival, w.hint.prefetch_bytes)
            w.where = "preparing"
            self._prep_bytes += w.hint.ssd_bytes

    def add(self, hint: TierHint, gpu_need: int = 0) -> None:
        """Queue a new request (or replace the hint of a queued one)."""
        if hint.request_id in self._reqs:
            self.update(hint, gpu_need)
            return
        self._seq += 1
        w = Waiting(hint=hint, gpu_need=int(gpu_need), seq=self._seq, key=(hint.arrival, self._seq))
        self._reqs[hint.request_id] = w
        self._place(w)

    def update(self, hint: TierHint, gpu_need: int | None = None) -> None:
        """A newer hint for a waiting request; unknown requests are added. The arrival time is kept."""
        w = self._reqs.get(hint.request_id)
        if w is None:
            self.add(hint, gpu_need or 0)
            return
        if (hint is w.hint or hint == w.hint) and (gpu_need is None or gpu_need == w.gpu_need):
            return  # the vLLM hook refreshes every waiting request's hint each step: most did not change
        if hint.arrival != w.hint.arrival:
            hint = replace(hint, arrival=w.hint.arrival)
        if gpu_need is not None:
            w.gpu_need = int(gpu_need)
        old = w.where
        new_where = ("ready" if hint.state.schedulable
                     else "loading" if hint.state is TierState.LOADING else "preparing")
        if old == new_where == "preparing":
            self._prep_bytes += hint.ssd_bytes - w.hint.ssd_bytes
            w.hint = hint
            self._preparing.push(hint.request_id, hint.arrival, hint.prefetch_bytes)  # size update, keeps position
            return
        if old == new_where:
            if old == "ready":
                service = self.service_s(hint)
                self._ready_work += service - w.service
                self._work_buckets[_bucket(w.service)] -= w.service
                self._work_buckets[_bucket(service)] += service
                w.service = service
                w.inv = self._inverse_service(service)
            else:
                self._prep_bytes += hint.ssd_bytes - w.hint.ssd_bytes
            w.hint = hint
            if old == "ready" and self._index is not None:
                self._index.put(hint.request_id, hint.arrival, w.inv, w.gpu_need, self._deferred(w), w.service)
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
            hint = replace(h, host_tokens=h.host_tokens + h.ssd_tokens + h.remote_tokens, ssd_tokens=0, ssd_bytes=0,
                           remote_tokens=0, remote_bytes=0, state=TierState.READY)
        self.update(hint)

    # --- scheduler side ------------------------------------------------------------------------------------------
    def _starving(self, w: Waiting, now: float, threshold: float) -> bool:
        cap = self.config.gpu_capacity
        return now - w.hint.arrival > threshold and (cap is None or w.gpu_need <= cap)

    def pick(self, now: float, free_gpu: int | None = None) -> str | None:
        """The next ready request to admit (not removed; call `dispatched` once admitted), or None.

        `free_gpu=None` means no memory check. Returns None when the oldest ready request is starving and does not
        fit: the caller then waits for memory to free up instead of admitting younger requests (the bound).
        """
        ready = self._ready
        if not ready:
            return None
        head = ready[0][3]
        if self._starving(head, now, self.starvation_threshold()):
            fits = free_gpu is None or head.gpu_need <= free_gpu
            if not fits or self._deferred(head):
                self.stats["starvation_overrides"] += 1
            return head.hint.request_id if fits else None
        delay_hit = self.config.delay_hit
        thr = self.config.delay_hit_threshold_tokens
        big = free_gpu if free_gpu is not None else float("inf")
        if self._index is not None:  # highest (now + eps - arrival) / service first
            rid = self._lookahead_pick(now, big)
            if rid is not None:
                return rid
            rid, deferred, oversized = self._index.best(now, big)
            self.stats["deferred_delay_hit"] += deferred
            self.stats["skipped_oversized"] += oversized
            return rid
        for e in ready:
            w = e[3]
            if delay_hit and w.hint.inflight_tokens >= thr:
                self.stats["deferred_delay_hit"] += 1
            elif w.gpu_need > big:
                self.stats["skipped_oversized"] += 1
            else:
                return e[2]
        return None

    def _lookahead_pick(self, now: float, free: float, count: bool = True) -> str | None:
        """With `starvation_lookahead`: the highest-ratio admissible ready request whose service leaves every older
        one able to start within the starvation bound, when that bound binds (`RatioIndex.allowed`); else None,
        also when none of those can run now (deferred, or no room): then HRRN's own choice runs rather than none."""
        if not self.config.starvation_lookahead or self._index is None or len(self._index) < 2:
            return None
        cap = self.config.gpu_capacity
        counted = self._index.counted_mask(cap) if cap is not None else None
        allowed = self._index.allowed(now, self.starvation_threshold(), counted)
        if allowed is None:
            return None
        rid = self._index.best_allowed(now, free, allowed)
        if rid is not None and count:
            self.stats["lookahead_overrides"] += 1
        return rid

    def order(self, now: float, free_gpu: int | None = None, with_prefetch_order: bool = False) -> list[str]:
        """Every waiting request, in the order a scheduler should try them this step.

        Admissible ready requests come first (in the ready order, each counted against `free_gpu` as if admitted),
        then ready requests that do not fit or are deferred, then loading and preparing requests (which a connector
        answers with "not yet"; in disk-HRRN order only with `with_prefetch_order=True`, which costs a sort). A
        starving head that does not fit stays first, so that a scheduler which stops at the first request it
        cannot allocate (vLLM) waits for memory for it.
        """
        out: list[str] = []
        later: list[str] = []
        free = free_gpu if free_gpu is not None else float("inf")
        rest = self._ready
        if rest:
            head = rest[0][3]
            if self._starving(head, now, self.starvation_threshold()):
                out.append(head.hint.request_id)
                if head.gpu_need > free:
                    later = [e[2] for e in rest[1:]]  # the scheduler stops at the head: reserve for it
                    rest = []
                else:
                    rest = rest[1:]
                    free -= head.gpu_need
        if rest and self._index is not None:
            if not out:  # the lookahead's choice goes first (the others keep the ratio order)
                rid = self._lookahead_pick(now, free, count=False)
                if rid is not None:
                    out.append(rid)
                    free -= self._reqs[rid].gpu_need
            first, other = self._index.order(now, free)
            if out:  # the starving head (or the lookahead's choice) is already placed
                first = [r for r in first if r != out[0]]
                other = [r for r in other if r != out[0]]
            out.extend(first)
            later.extend(other)
            rest = []
        delay_hit = self.config.delay_hit
        thr = self.config.delay_hit_threshold_tokens
        for e in rest:
            w = e[3]
            if (delay_hit and w.hint.inflight_tokens >= thr) or w.gpu_need > free:
                later.append(e[2])
            else:
                out.append(e[2])
                free -= w.gpu_need
        out.extend(later)
        if with_prefetch_order:
            out.extend(self.loading_ids())
            out.extend(self.prefetch_order(now))
        else:  # a connector answers "not yet" for all of them: their relative order does not matter
            out.extend(self._loading)
            out.extend(self._preparing.ids())
        return out

    def dispatched(self, request_id: str, now: float) -> None:
        """The request was admitted to the GPU: it leaves the queues and its wait counts toward the mean."""
        w = self._reqs.pop(request_id, None)
        if w is None:
            return
        self._detach(w)
        self._waits.add(max(0.0, now - w.hint.arrival))



#: fair baselines: vLLM's order with a synchronous SSD tier, with eager SSD prefetch, and without host/SSD tiers
BASELINE_NAMES = ("fcfs", "fcfs+prefetch", "recompute")
#: kvtier's schedulers (every dual-queue name may add the modifiers `+hrrn`, `+delay-hit`, `+always-load`,
#: `+eager-replan`)
KVTIER_SCHEDULER_NAMES = ("dual-queue", "dual-queue+delay-hit", "dual-queue+hrrn", "dual-queue+hrrn+delay-hit")
#: delay-hit variants that also wait for their own issued reads (`delay_hit_own_loads`)
OWN_LOADS_NAMES = ("dual-queue+delay-hit+own-loads", "dual-queue+hrrn+delay-hit+own-loads")
SCHEDULER_NAMES = BASELINE_NAMES + KVTIER_SCHEDULER_NAMES
DUAL_QUEUE_MODIFIERS = ("hrrn", "delay-hit", "own-loads", "always-load", "eager-replan")


def make_scheduling_policy(name: str, config: DualQueueConfig | None = None) -> SchedulingPolicy:
    """A policy by name.

    - `fcfs`, `recompute`: vLLM's order (the head blocks); `recompute` is the same policy for an engine without
      host or SSD tiers (the simulator then keeps only vLLM's GPU prefix cache).
    - `fcfs+prefetch`: the same order, SSD reads issued eagerly in arrival order.
    - `dual-queue[+hrrn][+delay-hit][+always-load]`: kvtier's `DualQueuePolicy` with `config`'s knobs, except that
      the name decides the ready order (`+hrrn`, else `arrival`), delay-hit avoidance (`+delay-hit`, else off) and
      the load plan (`+always-load` turns load-or-recompute off: everything cached is loaded); `+own-loads`
      (with `+delay-hit`) sets `delay_hit_own_loads`; `+eager-replan` turns `idle_replan_counts_arrivals` off
      (the idle-GPU re-plan recomputes whenever that is sooner for the request, whatever the load).
    """
    if name == "fcfs":
        return FCFSPolicy(prefetch=False)
    if name == "recompute":
        p = FCFSPolicy(prefetch=False)
        p.name = "recompute"
        return p
    if name == "fcfs+prefetch":
        return FCFSPolicy(prefetch=True)
    base, *mods = name.split("+")
    if base == "dual-queue" and len(set(mods)) == len(mods) and all(m in DUAL_QUEUE_MODIFIERS for m in mods):
        cfg = config or DualQueueConfig()
        plan = cfg.load_plan
        if "always-load" in mods:
            plan = replace(plan, load_or_recompute=False)
        if "own-loads" in mods and "delay-hit" not in mods:
            raise ValueError(f"scheduler {name!r}: +own-loads needs +delay-hit")
        cfg = replace(cfg, delay_hit="delay-hit" in mods, delay_hit_own_loads="own-loads" in mods,
                      ready_order="hrrn" if "hrrn" in mods else "arrival", load_plan=plan)
        if "eager-replan" in mods:
            cfg = replace(cfg, idle_replan_counts_arrivals=False)
        dq = DualQueuePolicy(cfg)
        dq.name = name
        return dq
    raise ValueError(f"unknown scheduler {name!r}; choose one of {', '.join(SCHEDULER_NAMES)} (dual-queue names "
                     f"may combine the modifiers +{', +'.join(DUAL_QUEUE_MODIFIERS)})")
