"""`kvtier simulate`: a discrete-event replay of a request trace through kvtier's scheduling policies and the
baselines a user would really pick, with every cost charged.

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
  lands (inclusive SSD tier and full chunks only, as production; a prompt's partial last block stays on the GPU); the SSD's reads and writes share the device (`sim_ssd`: reads get
  `ssd_read_share` of it while writes are queued; a full write buffer drops the write and counts it). A block is
  on the SSD tier once its write completes.
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

import argparse
import heapq
import inspect
import json
import logging
import math
import time
from collections import OrderedDict, deque
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Sequence

from kvtier.scheduler_hooks.dual_queue_policy import (
    BASELINE_NAMES,
    DUAL_QUEUE_MODIFIERS,
    SCHEDULER_NAMES,
    DualQueueConfig,
    SchedulingPolicy,
    make_scheduling_policy,
)
from kvtier.scheduler_hooks.hint_derivation import (
    HOST,
    SSD,
    PrefetchPhase,
    Residency,
    count_inflight,
    derive_tier_hint,
    walk_prefix,
)
from kvtier.scheduler_hooks.load_plan import LoadAction, PlanContext
from kvtier.scheduler_hooks.tier_hint import TierHint, TierState
from kvtier.sim.cost_model import DEFAULT_PROFILE, PROFILES, CostProfile, get_profile
from kvtier.sim.ssd import SimSSD

logger = logging.getLogger(__name__)

__all__ = [
    "FAIR_BASELINES",
    "SimConfig",
    "SimRequest",
    "SimResult",
    "Simulator",
    "add_arguments",
    "best_baseline",
    "calibrate_time_scale",
    "load_trace",
    "print_table",
    "run",
    "simulate",
]

TRACE_BLOCK_TOKENS = 512
#: the baselines kvtier's schedulers are compared with (`fcfs` stalls the GPU on SSD reads: not a fair one)
FAIR_BASELINES = ("fcfs+prefetch", "recompute")

# event kinds (ties at equal times are broken by push order)
_ARRIVAL, _SSD_EVENT, _LANDING, _PREFILL_DONE, _GPU_FREE, _DECODE_DONE = range(6)


@dataclass(frozen=True, slots=True)
class SimRequest:
    """One trace request as the simulator sees it (arrival in seconds, before time scaling)."""

    rid: str
    arrival: float
    blocks: tuple[int, ...]
    input_tokens: int
    output_tokens: int


@dataclass(frozen=True, slots=True)
class SimConfig:
    scheduler: str = "dual-queue"
    profile: str = DEFAULT_PROFILE
    eviction: str = "lru"
    time_scale: float = 1.0
    block_tokens: int = TRACE_BLOCK_TOKENS
    #: knobs of kvtier's policy (the scheduler name still decides ready order, delay hit and the load plan);
    #: its load plan's cost model defaults to the profile's numbers (`policy_cost_from_profile`)
    policy: DualQueueConfig = field(default_factory=DualQueueConfig)
    policy_cost_from_profile: bool = True
    #: override the profile's host-tier capacity (bytes); tests use small tiers
    host_bytes: int | None = None
    #: override the profile's GPU KV capacity (tokens)
    gpu_kv_tokens: int | None = None
    #: SSD sharing: the read share while writes are queued, and the write buffer (production's default 2 GiB)
    ssd_read_share: float = 0.5
    ssd_write_buffer_bytes: int = 2 << 30
    progress: bool = False


@dataclass(slots=True)
class SimResult:
    """What one simulated run reports (`to_json` is the `--json` content)."""

    scheduler: str
    eviction: str
    profile: str
    time_scale: float
    load_factor: float | None
    requests: int
    completed: int
    rejected: int
    mean_queue_s: float
    p50_queue_s: float
    p99_queue_s: float
    max_queue_s: float
    mean_ttft_s: float
    p50_ttft_s: float
    p99_ttft_s: float
    max_ttft_s: float
    gpu_util: float  #: GPU occupied (including stalls on synchronous SSD reads) / makespan
    gpu_compute_util: float  #: GPU computing (load + prefill + decode share) / makespan
    ssd_util: float  #: SSD busy (reading or writing) / makespan
    ssd_read_util: float  #: device-seconds spent reading / makespan
    ssd_write_util: float  #: device-seconds spent writing / makespan
    makespan_s: float
    tokens: dict[str, int]  #: prompt tokens by where they came from: gpu, host, ssd_prefetch, ssd_sync, computed
    recomputed_tokens: int  #: computed tokens of blocks that existed before
    recomputed: dict[str, int]  #: ... by why: inflight, plan, evicted
    ssd_read_gb: float
    ssd_write_gb: float  #: written to the SSD tier (completed writes)
    ssd_dropped_write_gb: float  #: write-back dropped for a full write buffer
    policy_stats: dict[str, int]
    decision_us_mean: float  #: mean wall time of one decision (pick, next_prefetch, a hint with its plan) in this run
    queue_s: list[float] = field(default_factory=list, repr=False)
    ttft_s: list[float] = field(default_factory=list, repr=False)
    arrival_s: list[float] = field(default_factory=list, repr=False)

    def to_json(self) -> dict:
        d = asdict(self)
        for k in ("queue_s", "ttft_s", "arrival_s"):
            d.pop(k)
        return d


@dataclass(slots=True)
class _Job:
    """One admitted request's GPU job."""

    r: SimRequest
    stop: int  #: blocks [0, stop) come from the caches, [stop, n) are computed
    split: int  #: computed blocks [stop, split) land when the last chunk starts, [split, n) at the prefill end
    cached: int
    new: int
    host_bytes: int
    sync_bytes: int
    sync_blocks: list[int]
    sync_remote_bytes: int = 0  #: read synchronously from the shared tier (after the SSD part), GPU stalled
    sync_remote_blocks: list[int] = field(default_factory=list)
    start: float = math.inf
    compute_start: float = math.inf
    lc: float = math.inf  #: when its last prefill chunk starts (the next admission opens)
    first: float = math.inf
    end: float = math.inf
    estimate_s: float = 0.0


# ---------------------------------------------------------------------------------------------------------------------
# trace


def load_trace(path: str | Path, limit: int | None = None, start_s: float | None = None,
               end_s: float | None = None) -> list[SimRequest]:
    """Mooncake-style JSONL (or anything `kvtier.replay.traces.read_trace` reads) -> requests, optionally only those
    arriving in [start_s, end_s) (trace seconds; the held-out split of the benchmark)."""
    from kvtier.replay.traces import read_trace

    out = [SimRequest(str(r.index), float(r.timestamp), tuple(r.hash_ids), int(r.input_length), int(r.output_length))
           for r in read_trace(path, limit=limit)
           if (start_s is None or r.timestamp >= start_s) and (end_s is None or r.timestamp < end_s)]
    out.sort(key=lambda r: r.arrival)  # stable: equal timestamps keep file order
    return out


def _percentile(xs: Sequence[float], q: float) -> float:
    if not xs:
        return 0.0
    s = sorted(xs)
    k = (len(s) - 1) * q / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


# ---------------------------------------------------------------------------------------------------------------------
# the engine


class Simulator:
    """One replay. `run()` returns a `SimResult`; the object keeps its state for inspection (tests)."""

    def __init__(self, requests: Sequence[SimRequest], config: SimConfig, remote=None) -> None:
        self.config = config
        self.cost: CostProfile = get_profile(config.profile)
        self.gpu_cap = int(config.gpu_kv_tokens or self.cost.gpu_kv_tokens)
        pcfg = replace(config.policy, gpu_capacity=self.gpu_cap)
        if config.policy_cost_from_profile:
            pcfg = replace(pcfg, load_plan=replace(pcfg.load_plan, cost=self.cost.load_cost_model()))
        self.policy: SchedulingPolicy = make_scheduling_policy(config.scheduler, pcfg)
        self.planner = getattr(self.policy, "planner", None)
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
        self.pins: dict[int, int] = {}
        self.pinned_by: dict[str, set[int]] = {}
        self.staged: dict[str, set[int]] = {}  # blocks read for a waiting request (its pinned prefetch buffer)
        self.phase: dict[str, PrefetchPhase] = {}
        self.waiting: dict[str, SimRequest] = {}
        self.waiters_of: dict[int, set[str]] = {}  # block -> waiting requests whose prompt holds it
        self.inflight_waiters: set[str] = set()
        self.reading: str | None = None
        self.jobs: deque[_Job] = deque()  # running job first, then at most one admitted behind it

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

    def seed(self, blocks: Sequence[int], tier: str, tokens: int | None = None) -> None:
        """Place blocks in a tier before `run()` (hand-built scenarios): "ssd", "host" (+SSD) or "gpu" (+host+SSD).
        Seeded blocks count as computed before (a recompute of them is a recompute)."""
        if tier not in ("ssd", "host", "gpu"):
            raise ValueError(f"unknown tier {tier!r}")
        t = tokens or self.config.block_tokens
        for b in blocks:
            self.seen.add(b)
            if self.tiers and b not in self.ssd:
                self.ssd[b] = t * self.kv
                self.ssd_used += t * self.kv
            if tier in ("host", "gpu"):
                self._host_insert(b, t * self.kv)
            if tier == "gpu":
                self._gpu_insert(b, t)

    # --- small helpers -------------------------------------------------------------------------------------------
    def _push(self, t: float, kind: int, data: object) -> None:
        self._seq += 1
        heapq.heappush(self._events, (t, self._seq, kind, data))

    def _block_tokens(self, r: SimRequest, i: int) -> int:
        b = self.config.block_tokens
        return max(1, min(b, r.input_tokens - i * b))

    def _need(self, r: SimRequest) -> int:
        return r.input_tokens + r.output_tokens

    # --- hints: the production derivation over the simulator's tiers --------------------------------------------
    def _walk(self, r: SimRequest) -> tuple[int, Residency, int]:
        """(vLLM's GPU hit, the storage side's prefix walk, index of the first block resident nowhere)."""
        gpu = 0
        gpu_run = True
        staged = self.staged.get(r.rid, ())
        chunks: list[tuple[str | None, int, int]] = []
        stop = len(r.blocks)
        for i, b in enumerate(r.blocks):
            t = self._block_tokens(r, i)
            if b in self.gpu:
                if gpu_run:
                    gpu += t
                chunks.append((HOST, t, 0))
                continue
            gpu_run = False
            if b in staged or b in self.host:
                chunks.append((HOST, t, 0))
            elif b in self.ssd:
                chunks.append((SSD, t, self.ssd[b]))
            else:
                stop = i
                break
        res = walk_prefix(chunks)
        if self.remote is not None and stop < len(r.blocks):
            res, stop = self.remote.extend_walk(r, res, stop, staged)
        return gpu, res, stop

    def _running_s(self) -> float:
        """GPU seconds left of the admitted jobs."""
        return sum(max(j.end - self.now, 0.0) if j.end < math.inf else j.estimate_s for j in self.jobs)

    def _plan_context(self, rid: str) -> PlanContext:
        pol = self.policy
        running = self._running_s()
        share = self.dev.current_read_share()
        ssd_ahead = self.dev.read_backlog + pol.ssd_backlog_bytes(rid)  # type: ignore[attr-defined]
        estimate = pol.gpu_wait_estimate  # type: ignore[attr-defined]
        return PlanContext(gpu_wait_s=running + pol.gpu_backlog_s(rid),  # type: ignore[attr-defined]
                           gpu_wait_fn=lambda service: running + estimate(service, rid),
                           ssd_wait_s=ssd_ahead / (self.cost.ssd_read_bytes_per_s * share), ssd_read_share=share)

    def _read_s(self, hint: TierHint) -> float:
        """Seconds until `hint`'s SSD part lands: its read's remainder if issued (or if another request's read in
        flight brings all of it), else if it were issued next."""
        rate = self.cost.ssd_read_bytes_per_s * self.dev.current_read_share()
        r = self.waiting.get(hint.request_id)
        riding = r is not None and self._ssd_part_loading(r)[1]
        if hint.state is TierState.LOADING or riding:
            return self.dev.read_backlog / rate
        return (self.dev.read_backlog + hint.ssd_bytes) / rate

    def _ssd_part_loading(self, r: SimRequest) -> tuple[int, bool]:
        """(tokens of `r`'s SSD-only prefix blocks that another request's read in flight is bringing into host
        memory, whether that is all of its SSD part): Strata's delay hit covers loads as well as computations."""
        if not self.loading:
            return 0, False
        n, whole = 0, True
        staged = self.staged.get(r.rid, ())
        for i, b in enumerate(r.blocks):
            if b in self.gpu or b in self.host or b in staged:
                continue
            if b not in self.ssd:
                break
            owner = self.loading.get(b)
            if owner is not None and owner != r.rid:
                n += self._block_tokens(r, i)
            else:
                whole = False
        return n, whole and n > 0

    def _hint(self, r: SimRequest) -> TierHint:
        """What the connector would publish for `r` now (`derive_tier_hint` over the simulator's tiers)."""
        gpu, res, stop = self._walk(r)
        owners = ((self.computing.get(b), self._block_tokens(r, stop + k)) for k, b in enumerate(r.blocks[stop:]))
        inflight = count_inflight(owners, r.rid) + self._ssd_part_loading(r)[0]
        phase = self.phase.get(r.rid, PrefetchPhase.NONE)
        planner = self.planner if self.tiers else None
        t0 = time.perf_counter()
        hint = derive_tier_hint(r.rid, r.arrival * self.config.time_scale, gpu_tokens=gpu, residency=res,
                                prefetch=phase, inflight_tokens=inflight, prompt_tokens=r.input_tokens,
                                planner=planner, context=self._plan_context(r.rid) if planner else None)
        self._decision_s += time.perf_counter() - t0
        self._decisions += 1
        return hint

    def _publish(self, rid: str, new: bool = False) -> TierHint:
        r = self.waiting[rid]
        hint = self._hint(r)
        if self.prefetching and hint.state.waits_for_prefetch and \
                self.phase.get(rid, PrefetchPhase.NONE) is PrefetchPhase.NONE:
            self.phase[rid] = PrefetchPhase.QUEUED  # the connector queues its prefetch
        if hint.inflight_tokens > 0:
            self.inflight_waiters.add(rid)
        else:
            self.inflight_waiters.discard(rid)
        if new:
            self.policy.add(hint, self._need(r))
        else:
            self.policy.update(hint)
        return hint

    # --- pins and tiers ------------------------------------------------------------------------------------------
    def _pin(self, rid: str, b: int) -> None:
        mine = self.pinned_by.setdefault(rid, set())
        if b in mine:
            return
        mine.add(b)
        self.pins[b] = self.pins.get(b, 0) + 1

    def _pin_prefix(self, r: SimRequest) -> None:
        """Pin the host-resident part of the prefix until the request runs (prefetching schedulers)."""
        staged = self.staged.get(r.rid, ())
        for b in r.blocks:
            if b in self.host and b not in staged:
                self._pin(r.rid, b)
            elif b not in self.gpu and b not in staged:
                break

    def _unpin_all(self, rid: str) -> None:
        for b in self.pinned_by.pop(rid, ()):
            n = self.pins[b] - 1
            if n:
                self.pins[b] = n
            else:
                del self.pins[b]

    def _host_insert(self, b: int, nbytes: int) -> bool:
        if b in self.host:
            self.host_policy.on_access(b)
            return True
        if nbytes > self.host_cap:
            return False
        need = self.host_used + nbytes - self.host_cap
        if need > 0:
            pins = self.pins
            for v in list(self.host_policy.victims(need, lambda k: pins.get(k, 0) == 0)):
                if need <= 0:
                    break
                n = self.host.pop(v, None)
                if n is None:
                    continue
                self.host_used -= n
                need -= n
                self.host_policy.on_remove(v)
            if need > 0:
                return False  # everything else is pinned: the SSD copy serves
        self.host[b] = nbytes
        self.host_used += nbytes
        self.host_policy.on_insert(b, nbytes)
        return True

    def _ssd_write(self, b: int, nbytes: int) -> None:
        if not self.tiers or b in self.ssd or b in self.ssd_queued:
            return
        if self.dev.submit_write(self.now, b, nbytes):
            self.ssd_queued[b] = nbytes

    def _ssd_insert(self, b: int, nbytes: int) -> None:
        if b in self.ssd:
            self.ssd.move_to_end(b)
            return
        self.ssd[b] = nbytes
        self.ssd_used += nbytes
        self.ssd_write_bytes += nbytes
        while self.ssd_used > self.ssd_cap and self.ssd:
            _, n = self.ssd.popitem(last=False)
            self.ssd_used -= n

    def _gpu_insert(self, b: int, tokens: int) -> None:
        if b in self.gpu:
            self.gpu.move_to_end(b)
        else:
            self.gpu[b] = tokens
            self.gpu_tokens += tokens
        self._gpu_trim()

    def _gpu_trim(self) -> None:
        room = max(self.gpu_cap - self.held, 0)
        while self.gpu_tokens > room and self.gpu:
            _, t = self.gpu.popitem(last=False)
            self.gpu_tokens -= t

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
            self._push(t, _SSD_EVENT, None)

    # --- arrivals and prefetches ---------------------------------------------------------------------------------
    def _on_arrival(self, r: SimRequest) -> bool:
        if self._need(r) > self.gpu_cap:
            self.rejected += 1
            logger.debug("request %s needs %d KV tokens > GPU capacity %d: rejected", r.rid, self._need(r), self.gpu_cap)
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

    # --- admission and the GPU -----------------------------------------------------------------------------------
    def _admit_open(self) -> bool:
        if not self.jobs:
            return True
        return len(self.jobs) == 1 and self.now >= self.jobs[0].lc

    def _try_dispatch(self) -> bool:
        free = max(self.gpu_cap - self.held, 0)
        t0 = time.perf_counter()
        idle = not self.jobs and self.planner is not None and self.tiers
        if idle:  # nothing runs: the busy total is exact now (a job's busy time is booked when it starts computing)
            self.policy.observe_gpu_busy(self.now, self.gpu_busy_s)  # type: ignore[attr-defined]
        rid = self.policy.pick(self.now, free)
        if rid is None and idle:
            rid = self.policy.replan_idle(self._read_s, free)  # type: ignore[attr-defined]
            if rid is not None:
                self.phase[rid] = PrefetchPhase.NONE  # its prefetch is dropped: it recomputes the SSD part
        self._decision_s += time.perf_counter() - t0
        self._decisions += 1
        if rid is None:
            return False
        hint = self.policy.hint(rid)
        r = self.waiting.pop(rid)
        for b in r.blocks:
            ws = self.waiters_of.get(b)
            if ws is not None:
                ws.discard(rid)
                if not ws:
                    del self.waiters_of[b]
        self.policy.dispatched(rid, self.now)
        self.inflight_waiters.discard(rid)
        self.dispatch_order.append(rid)
        self.phase.pop(rid, None)
        plan = hint.plan
        use_host = plan is None or plan.host is not LoadAction.RECOMPUTE
        staged = self.staged.pop(rid, set())
        rstaged = self.remote_staged.pop(rid, set())
        kv = self.kv
        cached = host_b = sync_b = sync_rb = 0
        sync_blocks: list[int] = []
        sync_remote: list[int] = []
        stop = len(r.blocks)
        cut_by_plan = False
        for i, b in enumerate(r.blocks):
            if sync_remote and (b not in self.remote or b in self.gpu):  # the shared tier's part is a prefix tail
                stop = i
                break
            t = self._block_tokens(r, i)
            if b in self.gpu:
                self.tokens["gpu"] += t
                self.gpu.move_to_end(b)
            elif not use_host and (b in staged or b in self.host or b in self.ssd):
                stop, cut_by_plan = i, True
                break
            elif b in staged:
                self.tokens["remote" if b in rstaged else "ssd_prefetch"] += t
                host_b += t * kv
            elif b in self.host:
                self.tokens["host"] += t
                host_b += t * kv
                self.host_policy.on_access(b)
            elif b in self.computing:
                stop = i
                break
            elif b in self.ssd and self.sync_reads:
                self.tokens["ssd_sync"] += t
                sync_b += t * kv
                sync_blocks.append(b)
                self.ssd.move_to_end(b)
            elif self.sync_reads and self.remote is not None and b in self.remote:
                self.tokens["remote_sync"] += t
                sync_rb += t * kv
                sync_remote.append(b)
            else:
                stop = i
                cut_by_plan = b in self.ssd
                break
            cached += t
        if stop < len(r.blocks):  # blocks past the cut that existed are recomputed, for the cut's reason
            b0 = r.blocks[stop]
            loaded_by_other = self.loading.get(b0, rid) != rid  # another request's read was bringing it
            why = "inflight" if b0 in self.computing or loaded_by_other else ("plan" if cut_by_plan else (
                "inflight" if b0 in self.loading else "evicted"))
            for k, b in enumerate(r.blocks[stop:]):
                if b in self.seen or b in self.computing or b in self.loading or b in staged:
                    self.recomputed[why] += self._block_tokens(r, stop + k)
        new = max(r.input_tokens - cached, 1 if r.input_tokens else 0)
        self.tokens["computed"] += new
        affected: set[str] = set()
        for b in r.blocks[stop:]:
            if self.computing.setdefault(b, rid) == rid:
                affected |= self.waiters_of.get(b, set())
        for w in affected:  # production's hints count in-flight chunks live: theirs change now
            self._publish(w)
        self.held += self._need(r)
        self._gpu_trim()
        # computed blocks land when the last chunk starts (those before it) and when the prefill ends (the rest)
        chunk = self.cost.prefill_chunk_tokens
        before_last = cached + chunk * ((new - 1) // chunk) if new > 0 else cached
        split = stop
        while split < len(r.blocks) and (split + 1) * self.config.block_tokens <= before_last:
            split += 1
        job = _Job(r, stop, split, cached, new, host_b, sync_b, sync_blocks, sync_rb, sync_remote)
        job.estimate_s = self.cost.ssd_read_time(sync_b) + self.cost.host_to_gpu_time(host_b + sync_b + sync_rb) + \
            (self.remote.read_time(sync_rb) if sync_rb else 0.0) + \
            self.cost.prefill_time(new, cached) + self.cost.decode_gpu_time(r.output_tokens, r.input_tokens)
        self.jobs.append(job)
        if len(self.jobs) == 1:
            self._start(job)
        return True

    def _start(self, job: _Job) -> None:
        r = job.r
        job.start = self.now
        self.queue[r.rid] = self.now - r.arrival * self.config.time_scale
        self._unpin_all(r.rid)
        if job.sync_bytes:
            self.dev.submit_read(self.now, ("sync", job), job.sync_bytes)  # the GPU stalls until it is read
        else:
            self._after_sync_ssd(job)

    def _after_sync_ssd(self, job: _Job) -> None:
        if job.sync_remote_bytes:  # then the shared tier's part, still stalled (LMCache's synchronous retrieve)
            self.remote.read_sync(job)
        else:
            self._compute(job, self.now)

    def _compute(self, job: _Job, t0: float) -> None:
        r = job.r
        cost = self.cost
        load = cost.host_to_gpu_time(job.host_bytes + job.sync_bytes + job.sync_remote_bytes)
        prefill = cost.prefill_time(job.new, job.cached)
        job.compute_start = t0
        job.first = t0 + load + prefill
        job.lc = job.first - cost.last_chunk_time(job.new, job.cached)
        decode = cost.decode_gpu_time(r.output_tokens, r.input_tokens)
        job.end = job.first + decode
        self.gpu_busy_s += job.end - job.start
        self.gpu_compute_s += load + prefill + decode
        self.ttft[r.rid] = job.first - r.arrival * self.config.time_scale
        self._push(job.lc, _LANDING, job)
        self._push(job.first, _PREFILL_DONE, job)
        self._push(job.end, _GPU_FREE, job)
        self._push(job.first + cost.decode_wall_time(r.output_tokens), _DECODE_DONE, r)

    def _land(self, job: _Job, lo: int, hi: int) -> None:
        r = job.r
        for i in range(lo, hi):
            b = r.blocks[i]
            t = self._block_tokens(r, i)
            self._gpu_insert(b, t)
            if self.computing.get(b) == r.rid:
                del self.computing[b]
            self.seen.add(b)
            nbytes = t * self.kv
            if self.tiers and t == self.config.block_tokens:  # the connector stores full chunks only
                self._host_insert(b, nbytes)
                self._ssd_write(b, nbytes)
                if self.remote is not None:  # `writes: all`: written through to the shared tier
                    self.remote.write(b, nbytes)

    def _on_landing(self, job: _Job) -> None:
        if job.split > job.stop:
            self._land(job, job.stop, job.split)
            self._refresh_inflight()

    def _on_prefill_done(self, job: _Job) -> None:
        r = job.r
        for i in range(job.stop):
            self._gpu_insert(r.blocks[i], self._block_tokens(r, i))
        for b in job.sync_blocks:  # read synchronously: now also in host memory
            if b not in self.host and b in self.ssd:
                self._host_insert(b, self.ssd[b])
        for b in job.sync_remote_blocks:
            self._host_insert(b, self._block_tokens(r, r.blocks.index(b)) * self.kv)
        self._land(job, job.split, len(r.blocks))
        self._refresh_inflight()

    def _on_gpu_free(self, job: _Job) -> None:
        if self.jobs and self.jobs[0] is job:
            self.jobs.popleft()
        if self.jobs:
            self._start(self.jobs[0])

    def _on_decode_done(self, r: SimRequest) -> None:
        self.held -= self._need(r)
        self.completed += 1
        self.host_policy.on_request_finished(r.blocks, r.output_tokens, self.now)

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
            self._push(r.arrival * scale, _ARRIVAL, r)
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
        if kind == _ARRIVAL:
            if not self._on_arrival(data):  # type: ignore[arg-type]
                self._bar.update(1)
        elif kind == _SSD_EVENT:
            if self._ssd_next == t:
                self._ssd_next = None
        elif kind == _LANDING:
            self._on_landing(data)  # type: ignore[arg-type]
        elif kind == _PREFILL_DONE:
            self._on_prefill_done(data)  # type: ignore[arg-type]
        elif kind == _GPU_FREE:
            self._on_gpu_free(data)  # type: ignore[arg-type]
        elif kind == _DECODE_DONE:
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
        stats = dict(getattr(self.policy, "stats", {}))
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
            p50_queue_s=_percentile(q, 50),
            p99_queue_s=_percentile(q, 99),
            max_queue_s=max(q, default=0.0),
            mean_ttft_s=sum(tt) / len(tt) if tt else 0.0,
            p50_ttft_s=_percentile(tt, 50),
            p99_ttft_s=_percentile(tt, 99),
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
        )


def _make_eviction(name: str, clock, capacity: int):
    from kvtier.storage_backends.eviction import make_policy, POLICY_REGISTRY
    from kvtier.storage_backends.eviction.base import _load_all

    _load_all()
    cls = POLICY_REGISTRY.get(name)
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


def best_baseline(results: Sequence[SimResult], metric: str) -> SimResult | None:
    """The fair baseline (`FAIR_BASELINES`) with the lowest `metric` among `results`, or None."""
    fair = [r for r in results if r.scheduler in FAIR_BASELINES]
    return min(fair, key=lambda r: getattr(r, metric)) if fair else None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("trace", help="request trace (Mooncake JSONL)")
    parser.add_argument("--scheduler", default="dual-queue",
                        help=f"one of {', '.join(SCHEDULER_NAMES)} (dual-queue names may combine "
                             f"+{', +'.join(DUAL_QUEUE_MODIFIERS)}), a comma-separated list, or 'all'")
    parser.add_argument("--json", dest="json_out", help="write the results here (JSON)")
    parser.add_argument("--plot", help="write a PNG plot here (TTFT CDF, queueing over time)")
    parser.add_argument("--time-scale", type=float, default=None,
                        help="multiply arrival times by this (default: chosen so FCFS keeps the GPU --load busy)")
    parser.add_argument("--load", type=float, default=0.85, help="target FCFS GPU busy fraction for the default scale")
    parser.add_argument("--eviction", default="lru", help="host-tier eviction policy (any registered production name)")
    parser.add_argument("--profile", default=DEFAULT_PROFILE, choices=sorted(PROFILES), help="cost profile")
    parser.add_argument("--limit", type=int, default=None, help="use only the first N requests")
    parser.add_argument("--start-s", type=float, default=None, help="use only requests arriving at or after this "
                        "trace second")
    parser.add_argument("--end-s", type=float, default=None, help="use only requests arriving before this trace second")
    parser.add_argument("--host-gb", type=float, default=None, help="override the host tier's capacity (GB)")
    parser.add_argument("--delay-hit-threshold", type=int, default=100, help="tokens (default 100)")
    parser.add_argument("--starvation-multiple", type=float, default=4.0, help="x mean wait (default 4)")
    parser.add_argument("--starvation-floor", type=float, default=2.0, help="seconds (default 2)")
    parser.add_argument("--mean-window", type=int, default=None,
                        help="dispatched requests the starvation bound's mean wait is taken over (default: the policy's)")
    parser.add_argument("--starvation-lookahead", action="store_true",
                        help="with +hrrn: a request goes next only if every older ready request can still start within "
                             "the starvation bound (`starvation_lookahead`)")
    parser.add_argument("--recompute-gpu-weight", type=float, default=None,
                        help="load plan: weight of GPU seconds next to TTFT (default: the policy's)")
    parser.add_argument("--ssd-read-share", type=float, default=0.5,
                        help="share of the SSD reads get while write-back is queued (default 0.5)")
    parser.add_argument("--ssd-write-buffer-gb", type=float, default=2.0,
                        help="queued write-back before writes are dropped (default 2, production's default)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    from kvtier.sim import remote as sim_remote  # issue 13: replicas and a shared tier

    sim_remote.add_arguments(parser)


def _schedulers(arg: str) -> list[str]:
    names = list(SCHEDULER_NAMES) if arg == "all" else [s.strip() for s in arg.split(",") if s.strip()]
    for n in names:
        try:
            make_scheduling_policy(n)
        except ValueError as e:
            raise SystemExit(f"kvtier simulate: {e}") from None
    return names


def policy_config(args: argparse.Namespace) -> DualQueueConfig:
    cfg = DualQueueConfig(delay_hit_threshold_tokens=args.delay_hit_threshold,
                          starvation_multiple=args.starvation_multiple, starvation_floor_s=args.starvation_floor)
    if getattr(args, "mean_window", None) is not None:
        cfg = replace(cfg, mean_window=args.mean_window)
    if getattr(args, "starvation_lookahead", False):
        cfg = replace(cfg, starvation_lookahead=True)
    if getattr(args, "recompute_gpu_weight", None) is not None:
        cfg = replace(cfg, load_plan=replace(cfg.load_plan, recompute_gpu_weight=args.recompute_gpu_weight))
    return cfg


def run(args: argparse.Namespace) -> int:
    from kvtier.storage_backends.eviction import production_policy_names

    names = _schedulers(args.scheduler)
    if args.eviction not in production_policy_names():
        raise SystemExit(f"kvtier simulate: unknown eviction policy {args.eviction!r}; "
                         f"choose from {', '.join(production_policy_names())}")
    reqs = load_trace(args.trace, args.limit, args.start_s, args.end_s)
    if not reqs:
        raise SystemExit(f"kvtier simulate: no requests in {args.trace}")
    base = SimConfig(
        profile=args.profile,
        eviction=args.eviction,
        policy=policy_config(args),
        host_bytes=int(args.host_gb * 1e9) if args.host_gb is not None else None,
        ssd_read_share=args.ssd_read_share,
        ssd_write_buffer_bytes=int(args.ssd_write_buffer_gb * (1 << 30)),
        progress=not args.no_progress,
    )
    span = reqs[-1].arrival - reqs[0].arrival or 1.0
    t0 = time.perf_counter()
    auto_scale, work = calibrate_time_scale(reqs, base, load=args.load)
    scale = args.time_scale if args.time_scale is not None else auto_scale
    load_factor = work / (span * scale)
    print(f"trace {args.trace}: {len(reqs)} requests over {span:.0f} s; profile {args.profile}, eviction {args.eviction}")
    print(f"time scale {scale:.3f} ({'given' if args.time_scale is not None else 'auto'}): "
          f"load factor {load_factor:.3f} (FCFS GPU work {work:.0f} s / scaled span {span * scale:.0f} s)"
          f"  [calibration {time.perf_counter() - t0:.1f} s]")
    from kvtier.sim import remote as sim_remote

    if sim_remote.wanted(args):
        return sim_remote.run(args, reqs, base, names, scale)
    results: list[SimResult] = []
    for n in names:
        res = simulate(reqs, replace(base, scheduler=n, time_scale=scale))
        res.load_factor = load_factor
        results.append(res)
    print_table(results)
    if args.json_out:
        payload = results[0].to_json() if len(results) == 1 else {
            "time_scale": scale, "load_factor": load_factor, "runs": [r.to_json() for r in results]}
        Path(args.json_out).write_text(json.dumps(payload, indent=2) + "\n")
        print(f"wrote {args.json_out}")
    if args.plot:
        plot(results, args.plot)
        print(f"wrote {args.plot}")
    incomplete = [r.scheduler for r in results if r.completed + r.rejected != r.requests]
    if incomplete:
        logger.error("not every request completed under %s", ", ".join(incomplete))
        return 1
    return 0


def print_table(results: Sequence[SimResult]) -> None:
    """One row per run, then each kvtier run's ratios against the best fair baseline of the same invocation."""
    hdr = (f"{'scheduler':<28}{'done':>6}{'rej':>5}{'queue mean':>11}{'p50':>8}{'p99':>8}{'max':>8}"
           f"{'TTFT mean':>10}{'p50':>8}{'p99':>8}{'GPU':>6}{'SSD':>6}{'recomp Mtok':>12}")
    print(hdr)
    for r in results:
        print(f"{r.scheduler:<28}{r.completed:>6}{r.rejected:>5}{r.mean_queue_s:>11.2f}{r.p50_queue_s:>8.2f}"
              f"{r.p99_queue_s:>8.2f}{r.max_queue_s:>8.1f}{r.mean_ttft_s:>10.2f}{r.p50_ttft_s:>8.2f}"
              f"{r.p99_ttft_s:>8.2f}{r.gpu_util:>6.0%}{r.ssd_util:>6.0%}{r.recomputed_tokens / 1e6:>12.2f}")
    bq, bt = best_baseline(results, "mean_queue_s"), best_baseline(results, "p99_ttft_s")
    if bq is None or bt is None:
        return
    print(f"  best fair baseline: mean queue {bq.scheduler} ({bq.mean_queue_s:.2f} s), "
          f"P99 TTFT {bt.scheduler} ({bt.p99_ttft_s:.2f} s)")
    for r in results:
        if r.scheduler in BASELINE_NAMES:
            continue
        print(f"  {r.scheduler} / best fair baseline: mean queue {r.mean_queue_s / max(bq.mean_queue_s, 1e-12):.2f}x, "
              f"P99 TTFT {r.p99_ttft_s / max(bt.p99_ttft_s, 1e-12):.2f}x")


def plot(results: Sequence[SimResult], path: str | Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for r in results:
        xs = sorted(r.ttft_s)
        if xs:
            a1.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=r.scheduler)
        pts = sorted(zip(r.arrival_s, r.queue_s))
        if pts:
            w = max(len(pts) // 100, 1)  # moving mean over ~1% of the requests
            ts = [p[0] for p in pts]
            qs = [p[1] for p in pts]
            acc, sm = 0.0, []
            for i, v in enumerate(qs):
                acc += v
                if i >= w:
                    acc -= qs[i - w]
                sm.append(acc / min(i + 1, w))
            a2.plot(ts, sm, label=r.scheduler)
    a1.set_xscale("log")
    a1.set_xlabel("TTFT (s)")
    a1.set_ylabel("fraction of requests")
    a1.set_title("TTFT CDF")
    a1.grid(alpha=0.3)
    a1.legend()
    a2.set_xlabel("arrival time (s, scaled)")
    a2.set_ylabel("queueing time (s), moving mean")
    a2.set_title("queueing over the trace")
    a2.grid(alpha=0.3)
    a2.legend()
    if results:
        fig.suptitle(f"kvtier simulate: {results[0].profile}, eviction {results[0].eviction}, "
                     f"time scale {results[0].time_scale:.2f}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
