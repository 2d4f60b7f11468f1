"""The simulator's engine (what `kvtier simulate` runs): a discrete-event replay of a request trace through kvtier's
scheduling policies and the baselines a user would really pick, with every cost charged.

`Simulator`'s methods are split by role: this module holds its state, the event loop, arrivals and prefetches and
the result; `kvtier.sim.tiers` the tiers' contents and the hints derived over them; `kvtier.sim.gpu` admission and
the GPU jobs; `kvtier.sim.base` the types they share. A tier shared by replicas plugs in as `remote`
(`kvtier.sim.base.SharedTierView`); the replicas layer (`kvtier.sim.remote`) imports this module, never the reverse.

The simulator drives the *same* objects as production: the scheduling policies (`make_scheduling_policy`: the
vLLM hook's `DualQueuePolicy` / `FCFSPolicy`), the load-or-recompute planner (`DualQueuePolicy.planner`), the
hint derivation (`kvtier.scheduler_hooks.hint_derivation.derive_tier_hint`, which the connector's scheduler side
calls too) and the host tier's eviction policy (`kvtier.storage_backends.eviction`). Costs come from
`kvtier.sim.cost_model`, the SSD from `kvtier.sim.ssd`.

The modelled system (one GPU; all choices below are the simulator's, documented so results can be judged):
- KV lives in 512-token blocks (the trace's `hash_ids`; a request's last block holds its remainder). Tiers: vLLM's
  GPU prefix cache (LRU; its capacity is the GPU's KV memory minus what admitted requests hold), kvtier's host
  tier (capacity from the profile, eviction policy `--eviction`), the SSD tier (LRU, large).
- Write-back is charged: every computed full block is written to the host tier and queued for the SSD when it
  lands (inclusive SSD tier and full chunks only, as production; a prompt's partial last block stays on the GPU);
  the SSD's reads and writes share the device (`kvtier.sim.ssd`: reads get `ssd_read_share` of it while writes are
  queued; a full write buffer drops the write and counts it). A block is on the SSD tier once its write completes.
- GPU: one job at a time. A job is [a synchronous SSD read of prefix blocks found only on SSD, GPU stalled (`fcfs`
  always; `fcfs+prefetch` and `+always-load` for blocks no prefetch brought)] + host->GPU load of its cached prefix
  + prefill of the rest + its share of decode time
  (continuous batching, `CostProfile.decode_gpu_time`). The first token comes at the end of the prefill; the
  request holds input+output tokens of GPU KV from admission until `output * tpot` after its first token.
- Computing window (chunked prefill): the engine admits the next request when the running prefill reaches its last
  chunk (`prefill_chunk_tokens`), as vLLM fills a step's token budget with the next waiting request. The blocks of
  earlier chunks have landed by then (GPU cache, host tier, SSD queue); the last chunk's blocks are *computing*
  until the prefill ends. A request admitted in that window whose prompt continues into them recomputes them,
  unless delay-hit avoidance holds it until they land (`+delay-hit`). Its work starts when the GPU is free.
  Loads count too: SSD blocks of a waiting request that another request's prefetch is reading are in its hint's
  `inflight_tokens`, and a recompute of them is counted `inflight`; with `+delay-hit` the idle-GPU re-plan
  does not recompute them, nor with `+own-loads` an SSD part whose own read is issued
  (`DualQueuePolicy.replan_idle`). The re-plan charges a recompute with the work arriving during the read at the
  GPU's busy share, which the simulator reports at each idle moment (`observe_gpu_busy`; `+eager-replan`: not).
- A prefix is used up to its first block that is resident nowhere (or still computing); everything after is
  recomputed. The load plan may cut it earlier: a plan that recomputes the SSD part uses only what is on the GPU
  or in host memory at admission.
- Schedulers: `fcfs` - arrival order, the head waits until it fits, SSD hits are read on the critical path (vLLM +
  LMCache's synchronous retrieve). `fcfs+prefetch` - the same order, SSD reads issued eagerly in arrival order,
  the head waits for its own read. `recompute` - the same order without host or SSD tier (vLLM's prefix cache
  only). `dual-queue[+hrrn][+delay-hit][+always-load]` - kvtier: eager SSD prefetch in disk-HRRN order (one read
  at a time; a read skips blocks an earlier read already brought into host memory), ready queue by
  arrival (or HRRN by uncached service time), oversized requests skipped, the starvation bound, the load plan
  (off with `+always-load`); blocks of waiting requests are pinned in the host tier.
- Replicas and a tier shared by them (issue 13): `--replicas N --routing ... --remote[-gbps|-latency-ms|-gb]` run
  N of these simulators on one clock in front of one store (`kvtier.sim.remote`, which documents that model);
  `remote` is then this replica's view of the store (write-through of computed chunks, REMOTE hints, prefetches).
- Times: queueing time = GPU-job start - arrival (includes waiting for an SSD prefetch and for the GPU);
  TTFT = first token - arrival.
- Load: arrival times are multiplied by `time_scale`. By default it is chosen so that FCFS's GPU work (including
  its stalls on synchronous SSD reads) equals `load` (0.85) of the scaled trace span; the load factor printed is
  FCFS's GPU work / scaled span.
- Recomputed tokens: computed prompt tokens of blocks that existed before (computed, or being computed, by an
  earlier request), by why the prefix was cut where it was (`recomputed`): `inflight` (another request was still
  computing or reading that block), `plan` (cached, the load plan chose to recompute), `evicted` (resident nowhere
  any more).
"""

from __future__ import annotations

import heapq
import inspect
import logging
import math
import time
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import replace

from kvtier.scheduler_hooks.dual_queue_policy import SchedulingPolicy, make_scheduling_policy
from kvtier.scheduler_hooks.hint_derivation import PrefetchPhase
from kvtier.sim.base import (
    EV_ARRIVAL,
    EV_DECODE_DONE,
    EV_GPU_FREE,
    EV_LANDING,
    EV_PREFILL_DONE,
    EV_SSD,
    GpuJob,
    SharedTierView,
    SimConfig,
    SimRequest,
    SimResult,
    percentile,
)
from kvtier.sim.cost_model import CostProfile, get_profile
from kvtier.sim.gpu import GpuModel
from kvtier.sim.ssd import SimSSD
from kvtier.sim.tiers import TierModel
from kvtier.storage_backends.admission.config import make_policy as make_admission

logger = logging.getLogger(__name__)

__all__ = ["Simulator", "calibrate_time_scale", "simulate"]


class Simulator(TierModel, GpuModel):
    """One replay. `run()` returns a `SimResult`; the object keeps its state for inspection (tests)."""

    def __init__(self, requests: Sequence[SimRequest], config: SimConfig,
                 remote: SharedTierView | None = None) -> None:
        self.config = config
        self.cost: CostProfile = get_profile(config.profile)
        self.gpu_cap = int(config.gpu_kv_tokens or self.cost.gpu_kv_tokens)
        pcfg = replace(config.policy, gpu_capacity=self.gpu_cap)
        if config.policy_cost_from_profile:
            pcfg = replace(pcfg, load_plan=replace(pcfg.load_plan, cost=self.cost.load_cost_model()))
        self.policy: SchedulingPolicy = make_scheduling_policy(config.scheduler, pcfg)
        self.planner = self.policy.planner
        base, *mods = config.scheduler.split("+")
        #: host and SSD tiers exist (not for `recompute`)
        self.tiers = config.scheduler != "recompute"
        #: SSD reads are issued ahead of admission
        self.prefetching = self.tiers and config.scheduler not in ("fcfs",)
        #: SSD-only prefix blocks found at admission are read synchronously (GPU stalled) instead of recomputed
        self.sync_reads = self.tiers and (base == "fcfs" or "always-load" in mods)
        self.kv = self.cost.kv_bytes_per_token
        self.host_cap = int(config.host_bytes if config.host_bytes is not None else self.cost.host_bytes)
        if not self.tiers:
            self.host_cap = 0
        self.ssd_cap = int(self.cost.ssd_bytes)
        self.requests = sorted(requests, key=lambda r: r.arrival)
        self.now = 0.0
        self.host_policy = _make_eviction(config.eviction, lambda: self.now, max(self.host_cap, 1))
        self.dev = SimSSD(self.cost.ssd_read_bytes_per_s, self.cost.ssd_write_bytes_per_s,
                          read_share=config.ssd_read_share, write_buffer_bytes=config.ssd_write_buffer_bytes)

        self.gpu: OrderedDict[int, int] = OrderedDict()  # block -> tokens (vLLM prefix cache, LRU)
        self.gpu_tokens = 0
        self.held = 0  # GPU KV tokens held by admitted requests
        self.host: dict[int, int] = {}  # block -> bytes
        self.host_used = 0
        self.ssd: OrderedDict[int, int] = OrderedDict()
        self.ssd_used = 0
        self.ssd_queued: dict[int, int] = {}  # block -> bytes, write queued on the device
        self.loading: dict[int, str] = {}  # block -> request whose SSD read brings it
        self.computing: dict[int, str] = {}  # block -> request whose prefill computes it
        self.seen: set[int] = set()  # blocks computed at least once
        #: the SSD tier's write admission (asked once per admitted request) and the blocks it kept off the SSD
        self.ssd_admission = make_admission(config.ssd_admission)
        self.ssd_refused_blocks = 0
        self.pins: dict[int, int] = {}
        self.pinned_by: dict[str, set[int]] = {}
        self.staged: dict[str, set[int]] = {}  # blocks read for a waiting request (its pinned prefetch buffer)
        self.phase: dict[str, PrefetchPhase] = {}
        self.waiting: dict[str, SimRequest] = {}
        self.waiters_of: dict[int, set[str]] = {}  # block -> waiting requests whose prompt holds it
        self.inflight_waiters: set[str] = set()
        self.reading: str | None = None
        self.jobs: deque[GpuJob] = deque()  # running job first, then at most one admitted behind it

        self._events: list[tuple[float, int, int, object]] = []
        self._seq = 0
        self._ssd_next: float | None = None
        # accounting
        self.queue: dict[str, float] = {}
        self.ttft: dict[str, float] = {}
        self.completed = 0
        self.rejected = 0
        self.gpu_busy_s = 0.0
        self.gpu_compute_s = 0.0
        self.ssd_write_bytes = 0
        self.tokens = {"gpu": 0, "host": 0, "ssd_prefetch": 0, "ssd_sync": 0, "computed": 0}
        self.recomputed = {"inflight": 0, "plan": 0, "evicted": 0}
        #: the shared tier as this replica sees it (`kvtier.sim.remote.RemoteView`; None: no shared tier)
        self.remote = remote if self.tiers else None
        self.remote_reading: dict[str, list[int]] = {}  # request -> blocks its shared-tier read brings
        self.remote_staged: dict[str, set[int]] = {}  # blocks of `staged` that came from the shared tier
        self.ssd_reading: set[str] = set()  # requests whose SSD read is in flight
        if self.remote is not None:
            self.tokens.update(remote=0, remote_sync=0)
        self.last_event = 0.0
        self._decision_s = 0.0
        self._decisions = 0
        #: `_issue_prefetch` calls ended because the policy offered the same request twice without progress
        self.prefetch_giveups = 0
        self.dispatch_order: list[str] = []  #: request ids in the order they were admitted
        self.read_order: list[str] = []  #: request ids in the order their SSD prefetches were issued

    # --- small helpers -------------------------------------------------------------------------------------------
    # --- small helpers -------------------------------------------------------------------------------------------
    def _push(self, t: float, kind: int, data: object) -> None:
        self._seq += 1
        heapq.heappush(self._events, (t, self._seq, kind, data))

    # --- the SSD device ------------------------------------------------------------------------------------------
    def _ssd_drain(self) -> None:
        for kind, what in self.dev.advance(self.now):
            if kind == "write":
                nbytes = self.ssd_queued.pop(what, None)
                if nbytes is not None:
                    self._ssd_insert(what, nbytes)
            elif what[0] == "prefetch":
                self._on_prefetch_done(what[1], what[2])
            else:  # a synchronous read: the stalled job computes
                self._after_sync_ssd(what[1])

    def _ssd_schedule(self) -> None:
        t = self.dev.next_event_time()
        if t is not None and t != self._ssd_next:
            self._ssd_next = t
            self._push(t, EV_SSD, None)

    # --- arrivals and prefetches ---------------------------------------------------------------------------------
    def _on_arrival(self, r: SimRequest) -> bool:
        if self._need(r) > self.gpu_cap:
            self.rejected += 1
            logger.debug("request %s needs %d KV tokens > GPU capacity %d: rejected", r.rid, self._need(r),
                         self.gpu_cap)
            return False
        self.host_policy.on_request(r.blocks, self.now)
        self.waiting[r.rid] = r
        for b in r.blocks:
            self.waiters_of.setdefault(b, set()).add(r.rid)
        self.phase[r.rid] = PrefetchPhase.NONE
        if self.prefetching:
            self._pin_prefix(r)
        self._publish(r.rid, new=True)
        return True

    def _issue_prefetch(self) -> None:
        """Issue the policy's next SSD read (one at a time: nothing else is being read when this runs).

        A request whose read finds nothing left to read is re-evaluated and the policy asked again. Each waiting
        request gets at most one such turn per call: a request offered a second time without progress (its
        re-evaluation did not change what the policy offers) ends the call and counts in `prefetch_giveups`
        instead of looping forever; the next event asks again."""
        tried: set[str] = set()
        while True:
            t0 = time.perf_counter()
            rid = self.policy.next_prefetch(self.now)
            self._decision_s += time.perf_counter() - t0
            self._decisions += 1
            if rid is None:
                return
            if rid in tried:
                self.prefetch_giveups += 1
                logger.debug("prefetch of %s made no progress twice at t=%.3f: given up for this event", rid, self.now)
                return
            tried.add(rid)
            r = self.waiting[rid]
            staged = self.staged.setdefault(rid, set())
            todo: list[int] = []
            miss = len(r.blocks)
            for i, b in enumerate(r.blocks):
                if b in self.gpu or b in self.host or b in staged:
                    continue
                if b in self.ssd:
                    todo.append(b)
                    continue
                miss = i
                break
            rtodo = self.remote.prefix(r.blocks[miss:]) if self.remote is not None else []
            self.phase[rid] = PrefetchPhase.INFLIGHT
            if rtodo:  # the shared-tier part is read at once, beside the SSD part; it holds this prefetch slot
                self.reading = rid
                self.read_order.append(rid)
                self.remote_reading[rid] = rtodo
                self.remote.read(rid, rtodo)
                if not todo:
                    return
            if not todo:  # an earlier read brought its data meanwhile
                self._reevaluate(rid)
                continue
            self.ssd_reading.add(rid)
            nbytes = sum(self.ssd[b] for b in todo)
            for b in todo:
                self.loading[b] = rid
            self.reading = rid
            if not rtodo:
                self.read_order.append(rid)
            self.dev.submit_read(self.now, ("prefetch", rid, todo), nbytes)
            riders: set[str] = set()
            for b in todo:
                riders |= self.waiters_of.get(b, set())
            riders.discard(rid)
            for w in riders:  # their SSD part is in flight now: their hints count it (delay hit on a load)
                self._publish(w)
            return

    def _on_prefetch_done(self, rid: str, blocks: list[int]) -> None:
        self.ssd_reading.discard(rid)
        remote_pending = rid in self.remote_reading  # its shared-tier read finishes the prefetch
        if not remote_pending:
            self.reading = None
        waiting = rid in self.waiting
        staged = self.staged.setdefault(rid, set()) if waiting else None
        for b in blocks:
            self.loading.pop(b, None)
            nbytes = self.ssd.get(b)
            if nbytes is None:
                continue
            self.ssd.move_to_end(b)
            if self._host_insert(b, nbytes) and waiting:
                self._pin(rid, b)
            if staged is not None:
                staged.add(b)
        if waiting and not remote_pending:
            self._reevaluate(rid)
        self._refresh_inflight()

    def _on_remote_done(self, rid: str, blocks: list[int], nbytes: dict[int, int]) -> None:
        """A shared-tier prefetch landed: its chunks go into host memory, pinned for the request (as an SSD one)."""
        self.remote_reading.pop(rid, None)
        waiting = rid in self.waiting
        if waiting:
            staged = self.staged.setdefault(rid, set())
            mine = self.remote_staged.setdefault(rid, set())
            for b in blocks:
                if self._host_insert(b, nbytes[b]):
                    self._pin(rid, b)
                staged.add(b)
                mine.add(b)
        else:
            for b in blocks:
                self._host_insert(b, nbytes[b])
        if rid in self.ssd_reading:
            return  # its SSD read finishes the prefetch
        self.reading = None
        if waiting:
            self._reevaluate(rid)
        self._refresh_inflight()

    def _reevaluate(self, rid: str) -> None:
        """After its read: promote the request, or queue it again if part of its prefix left the host tier."""
        r = self.waiting[rid]
        _, res, _ = self._walk(r)
        if res.ssd_tokens == 0 and getattr(res, "remote_tokens", 0) == 0:
            self.phase[rid] = PrefetchPhase.DONE
            self._pin_prefix(r)
            hint = self._hint(r)
            if hint.inflight_tokens > 0:
                self.inflight_waiters.add(rid)
            self.policy.prefetch_done(rid, self.now, hint)
            return
        self.phase[rid] = PrefetchPhase.QUEUED
        self._publish(rid)

    def _refresh_inflight(self) -> None:
        for rid in list(self.inflight_waiters):
            if rid in self.waiting:
                self._publish(rid)
            else:
                self.inflight_waiters.discard(rid)

    # --- main loop -----------------------------------------------------------------------------------------------
    def run(self) -> SimResult:
        self.begin()
        try:
            while self._events:
                self.step()
        finally:
            self._bar.close()
        return self.finish()

    # one replay in steps, so that several replicas can share one clock (`kvtier.sim.remote.Cluster`)
    def begin(self) -> None:
        """Queue the arrivals (call once, before `step`)."""
        from tqdm import tqdm

        scale = self.config.time_scale
        for r in self.requests:
            self._push(r.arrival * scale, EV_ARRIVAL, r)
        self._first_arrival = self.requests[0].arrival * scale if self.requests else 0.0
        self._bar = tqdm(total=len(self.requests), desc=self.config.scheduler, unit="req",
                         disable=not self.config.progress, leave=False)

    def next_time(self) -> float:
        """When this replica's next event is due (inf: none)."""
        return self._events[0][0] if self._events else math.inf

    def step(self) -> None:
        """Handle the next event."""
        t, _, kind, data = heapq.heappop(self._events)
        self.now = t
        self._ssd_drain()
        if kind == EV_ARRIVAL:
            if not self._on_arrival(data):  # type: ignore[arg-type]
                self._bar.update(1)
        elif kind == EV_SSD:
            if self._ssd_next == t:
                self._ssd_next = None
        elif kind == EV_LANDING:
            self._on_landing(data)  # type: ignore[arg-type]
        elif kind == EV_PREFILL_DONE:
            self._on_prefill_done(data)  # type: ignore[arg-type]
        elif kind == EV_GPU_FREE:
            self._on_gpu_free(data)  # type: ignore[arg-type]
        elif kind == EV_DECODE_DONE:
            self._on_decode_done(data)  # type: ignore[arg-type]
            self._bar.update(1)
            self.last_event = max(self.last_event, t)
        self.settle()

    def settle(self) -> None:
        """After anything changed: admit, issue prefetches, schedule the SSD's next event."""
        self._kick()
        self._ssd_schedule()

    def external(self, t: float, fn, *args) -> None:
        """Handle an event from outside this replica (the shared tier's) at time `t`."""
        self.now = t
        self._ssd_drain()
        fn(*args)
        self.settle()

    def finish(self) -> SimResult:
        if self.waiting:
            logger.warning("%d requests never ran (policy %s)", len(self.waiting), self.config.scheduler)
        return self._result(self._first_arrival)

    def _kick(self) -> None:
        # admissions first: an idle GPU may take a request whose read is not issued yet (the idle re-plan)
        while self.waiting and self._admit_open() and self._try_dispatch():
            pass
        if self.prefetching and self.reading is None:
            self._issue_prefetch()
            while self.waiting and self._admit_open() and self._try_dispatch():
                pass

    def _result(self, first_arrival: float) -> SimResult:
        q = list(self.queue.values())
        tt = list(self.ttft.values())
        span = max(self.last_event - first_arrival, 1e-9)
        ids = list(self.queue)
        by_id = {r.rid: r for r in self.requests}
        stats = dict(self.policy.stats)
        if self.planner is not None and self.tiers:
            stats.update(self.planner.stats)
        stats["prefetch_giveups"] = self.prefetch_giveups
        return SimResult(
            scheduler=self.config.scheduler,
            eviction=self.config.eviction,
            profile=self.config.profile,
            time_scale=self.config.time_scale,
            load_factor=None,
            requests=len(self.requests),
            completed=self.completed,
            rejected=self.rejected,
            mean_queue_s=sum(q) / len(q) if q else 0.0,
            p50_queue_s=percentile(q, 50),
            p99_queue_s=percentile(q, 99),
            max_queue_s=max(q, default=0.0),
            mean_ttft_s=sum(tt) / len(tt) if tt else 0.0,
            p50_ttft_s=percentile(tt, 50),
            p99_ttft_s=percentile(tt, 99),
            max_ttft_s=max(tt, default=0.0),
            gpu_util=self.gpu_busy_s / span,
            gpu_compute_util=self.gpu_compute_s / span,
            ssd_util=self.dev.busy_s / span,
            ssd_read_util=self.dev.read_busy_s / span,
            ssd_write_util=self.dev.write_busy_s / span,
            makespan_s=span,
            tokens=dict(self.tokens),
            recomputed_tokens=sum(self.recomputed.values()),
            recomputed=dict(self.recomputed),
            ssd_read_gb=self.dev.read_bytes / 1e9,
            ssd_write_gb=self.ssd_write_bytes / 1e9,
            ssd_dropped_write_gb=self.dev.dropped_write_bytes / 1e9,
            policy_stats=stats,
            decision_us_mean=1e6 * self._decision_s / max(self._decisions, 1),
            queue_s=q,
            ttft_s=tt,
            arrival_s=[by_id[i].arrival * self.config.time_scale for i in ids],
            ssd_admission=self.config.ssd_admission,
            ssd_refused_blocks=self.ssd_refused_blocks,
        )


def _make_eviction(name: str, clock, capacity: int):
    """The host tier's eviction policy `name` (a production one), given the arguments its constructor takes."""
    from kvtier.storage_backends.eviction import make_policy
    from kvtier.storage_backends.eviction.base import policy_class

    cls = policy_class(name)
    kwargs: dict = {"clock": clock}
    if cls is not None:
        params = inspect.signature(cls.__init__).parameters
        if "capacity" in params:
            kwargs["capacity"] = capacity
        if "clock" not in params and not any(p.kind is p.VAR_KEYWORD for p in params.values()):
            kwargs.pop("clock")
    return make_policy(name, **kwargs)


# ---------------------------------------------------------------------------------------------------------------------
# entry points


def simulate(requests: Sequence[SimRequest], config: SimConfig) -> SimResult:
    """One replay of `requests` on one GPU (no shared tier)."""
    return Simulator(requests, config).run()


def calibrate_time_scale(
    requests: Sequence[SimRequest], config: SimConfig, load: float = 0.85, iterations: int = 2
) -> tuple[float, float]:
    """(time_scale, fcfs_gpu_work_s): stretch arrivals so that FCFS's GPU work is `load` of the scaled span.

    FCFS serves in arrival order whatever the load, so its GPU work hardly depends on the scale; two fixed-point
    iterations settle it (the GPU prefix cache shrinks a little as concurrency grows).
    """
    if not requests:
        return 1.0, 0.0
    span = requests[-1].arrival - requests[0].arrival
    if span <= 0:
        span = 1.0
    scale, work = 1.0, 0.0
    for _ in range(iterations):
        sim = Simulator(requests, replace(config, scheduler="fcfs", time_scale=scale))
        sim.run()
        work = sim.gpu_busy_s
        scale = work / (load * span)
    return scale, work

