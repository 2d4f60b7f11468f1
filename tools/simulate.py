"""`kvtier simulate`: a discrete-event replay of a request trace through kvtier's scheduling policies.

The simulator drives the *same* policy objects as production (`make_scheduling_policy`: the vLLM hook's
`DualQueuePolicy` / `FCFSPolicy`; the host tier's eviction policy from `kvtier.storage_backends.eviction`), feeding
them the `TierHint`s a connector would publish. Costs come from `kvtier.tools.cost_model`.

The modelled system (one GPU; all choices below are the simulator's, documented so results can be judged):
- KV lives in 512-token blocks (the trace's `hash_ids`; a request's last block holds its remainder). Tiers: vLLM's
  GPU prefix cache (LRU; its capacity is the GPU's KV memory minus what running requests hold), kvtier's host tier
  (capacity from the profile, eviction policy `--eviction`), the SSD tier (LRU, large). Computed blocks are written
  through to host and SSD when the prefill ends; SSD write bandwidth is not charged (the written volume is
  reported).
- The GPU serves one prefill at a time. A request's GPU job is: [a synchronous SSD read of prefix blocks found
  only on SSD, GPU stalled] + host->GPU load of its host-resident prefix + prefill of the rest + its share of
  decode time (continuous batching, `CostProfile.decode_gpu_time`). The first token comes at the end of the
  prefill; the request then holds input+output tokens of GPU KV for `output * tpot` seconds. A prefix is used up
  to its first block that is resident nowhere (or still being computed/loaded by another request); everything
  after is recomputed.
- Schedulers: `fcfs` - arrival order, the head waits until it fits, SSD hits are read on the critical path (vLLM +
  LMCache's synchronous retrieve). `fcfs+prefetch` - the same order, SSD reads issued eagerly in arrival order,
  the head waits for its own read. `dual-queue` - Bidaw: eager SSD prefetch in disk-HRRN order on one SSD (one read
  at a time), ready queue by arrival, oversized requests skipped; blocks of waiting requests are pinned in the
  host tier. `dual-queue+delay-hit` - plus Strata's delay-hit avoidance (hints carry `inflight_tokens`).
- Times: queueing time = GPU-job start - arrival (includes waiting for an SSD prefetch); TTFT = first token -
  arrival.
- Load: arrival times are multiplied by `time_scale`. By default it is chosen so that FCFS's GPU work equals
  `load` (0.85) of the scaled trace span ("FCFS keeps up on average with the GPU 85% busy"); the load factor
  printed is FCFS's GPU work / scaled span.
"""

from __future__ import annotations

import argparse
import heapq
import inspect
import json
import logging
import math
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Sequence

from kvtier.tools.cost_model import DEFAULT_PROFILE, PROFILES, CostProfile, get_profile
from kvtier.scheduler_hooks.dual_queue_policy import (
    SCHEDULER_NAMES,
    DualQueueConfig,
    SchedulingPolicy,
    make_scheduling_policy,
)
from kvtier.scheduler_hooks.tier_hint import TierHint, classify

logger = logging.getLogger(__name__)

__all__ = [
    "SimConfig",
    "SimRequest",
    "SimResult",
    "Simulator",
    "add_arguments",
    "calibrate_time_scale",
    "load_trace",
    "run",
    "simulate",
]

TRACE_BLOCK_TOKENS = 512

# event kinds (ties at equal times are broken by push order)
_ARRIVAL, _SSD_DONE, _PREFILL_DONE, _GPU_FREE, _DECODE_DONE, _WAKE = range(6)


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
    policy: DualQueueConfig = field(default_factory=DualQueueConfig)
    #: override the profile's host-tier capacity (bytes); tests use small tiers
    host_bytes: int | None = None
    #: override the profile's GPU KV capacity (tokens)
    gpu_kv_tokens: int | None = None
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
    ssd_util: float  #: SSD reading / makespan
    makespan_s: float
    tokens: dict[str, int]  #: prompt tokens by where they came from: gpu, host, ssd_prefetch, ssd_sync, computed
    ssd_read_gb: float
    ssd_write_gb: float
    policy_stats: dict[str, int]
    decision_us_mean: float  #: mean wall time of one policy call (pick / next_prefetch) in this run
    queue_s: list[float] = field(default_factory=list, repr=False)
    ttft_s: list[float] = field(default_factory=list, repr=False)
    arrival_s: list[float] = field(default_factory=list, repr=False)

    def to_json(self) -> dict:
        d = asdict(self)
        for k in ("queue_s", "ttft_s", "arrival_s"):
            d.pop(k)
        return d


# ---------------------------------------------------------------------------------------------------------------------
# trace


def load_trace(path: str | Path, limit: int | None = None) -> list[SimRequest]:
    """Mooncake-style JSONL (or anything `kvtier.tools.traces.read_trace` reads) -> requests."""
    from kvtier.tools.traces import read_trace

    out = [SimRequest(str(r.index), float(r.timestamp), tuple(r.hash_ids), int(r.input_length), int(r.output_length))
           for r in read_trace(path, limit=limit)]
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

    def __init__(self, requests: Sequence[SimRequest], config: SimConfig) -> None:
        self.config = config
        self.cost: CostProfile = get_profile(config.profile)
        self.gpu_cap = int(config.gpu_kv_tokens or self.cost.gpu_kv_tokens)
        self.policy: SchedulingPolicy = make_scheduling_policy(
            config.scheduler, replace(config.policy, gpu_capacity=self.gpu_cap))
        self.prefetching = config.scheduler != "fcfs"
        self.kv = self.cost.kv_bytes_per_token
        self.host_cap = int(config.host_bytes if config.host_bytes is not None else self.cost.host_bytes)
        self.ssd_cap = int(self.cost.ssd_bytes)
        self.requests = sorted(requests, key=lambda r: r.arrival)
        self.now = 0.0
        self.host_policy = _make_eviction(config.eviction, lambda: self.now, self.host_cap)

        self.gpu: OrderedDict[int, int] = OrderedDict()  # block -> tokens (vLLM prefix cache, LRU)
        self.gpu_tokens = 0
        self.held = 0  # GPU KV tokens held by running (decoding) requests
        self.host: dict[int, int] = {}  # block -> bytes
        self.host_used = 0
        self.ssd: OrderedDict[int, int] = OrderedDict()
        self.ssd_used = 0
        self.loading: dict[int, str] = {}  # block -> request whose SSD read brings it
        self.computing: dict[int, str] = {}  # block -> request whose prefill computes it
        self.pins: dict[int, int] = {}
        self.pinned_by: dict[str, list[int]] = {}
        self.staged: dict[str, set[int]] = {}  # blocks read for a waiting request (its pinned prefetch buffer)
        self.waiting: dict[str, SimRequest] = {}
        self.inflight_waiters: set[str] = set()
        self.reading: str | None = None
        self.ssd_busy_until = 0.0
        self.gpu_busy = False

        self._events: list[tuple[float, int, int, object]] = []
        self._seq = 0
        self._wake_at: float | None = None
        # accounting
        self.queue: dict[str, float] = {}
        self.ttft: dict[str, float] = {}
        self.completed = 0
        self.rejected = 0
        self.gpu_busy_s = 0.0
        self.gpu_compute_s = 0.0
        self.ssd_busy_s = 0.0
        self.ssd_read_bytes = 0
        self.ssd_write_bytes = 0
        self.tokens = {"gpu": 0, "host": 0, "ssd_prefetch": 0, "ssd_sync": 0, "computed": 0}
        self.last_event = 0.0
        self._decision_s = 0.0
        self._decisions = 0
        self.dispatch_order: list[str] = []  #: request ids in the order their GPU jobs started
        self.read_order: list[str] = []  #: request ids in the order their SSD prefetches were issued

    def seed(self, blocks: Sequence[int], tier: str, tokens: int | None = None) -> None:
        """Place blocks in a tier before `run()` (hand-built scenarios): "ssd", "host" (+SSD) or "gpu" (+host+SSD)."""
        if tier not in ("ssd", "host", "gpu"):
            raise ValueError(f"unknown tier {tier!r}")
        t = tokens or self.config.block_tokens
        for b in blocks:
            if b not in self.ssd:
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

    def _hint(self, r: SimRequest) -> TierHint:
        """What the connector would publish for `r` now (prefix walk over the tiers)."""
        gpu = host = ssd = inflight = 0
        staged = self.staged.get(r.rid, ())
        for i, b in enumerate(r.blocks):
            t = self._block_tokens(r, i)
            if b in self.gpu:
                gpu += t
            elif b in staged or b in self.host:
                host += t
            elif self.loading.get(b) == r.rid:
                ssd += t
            elif b in self.loading or b in self.computing:
                inflight += t
            elif b in self.ssd:
                ssd += t
            else:
                break
        state = classify(gpu, host, ssd, loading=self.reading == r.rid)
        return TierHint(r.rid, gpu, host, ssd, ssd * self.kv, state, r.arrival * self.config.time_scale, inflight)

    def _publish(self, rid: str, hint: TierHint, new: bool = False) -> None:
        if hint.inflight_tokens > 0:
            self.inflight_waiters.add(rid)
        else:
            self.inflight_waiters.discard(rid)
        if new:
            self.policy.add(hint, self._need(self.waiting[rid]))
        else:
            self.policy.update(hint)

    def _pin(self, rid: str, b: int) -> None:
        self.pins[b] = self.pins.get(b, 0) + 1
        self.pinned_by.setdefault(rid, []).append(b)

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

    # --- events --------------------------------------------------------------------------------------------------
    def _on_arrival(self, r: SimRequest) -> bool:
        if self._need(r) > self.gpu_cap:
            self.rejected += 1
            logger.debug("request %s needs %d KV tokens > GPU capacity %d: rejected", r.rid, self._need(r), self.gpu_cap)
            return False
        self.host_policy.on_request(r.blocks, self.now)
        self.waiting[r.rid] = r
        hint = self._hint(r)
        if self.prefetching:  # pin the host-resident part of the prefix until the request runs
            staged = self.staged.get(r.rid, ())
            for b in r.blocks:
                if b in self.host and b not in staged:
                    self._pin(r.rid, b)
                elif b not in self.gpu:
                    break
        self._publish(r.rid, hint, new=True)
        return True

    def _issue_prefetch(self) -> None:
        while True:
            t0 = time.perf_counter()
            rid = self.policy.next_prefetch(self.now)
            self._decision_s += time.perf_counter() - t0
            self._decisions += 1
            if rid is None:
                return
            r = self.waiting[rid]
            staged = self.staged.setdefault(rid, set())
            todo: list[int] = []
            for b in r.blocks:
                if b in self.gpu or b in self.host or b in staged:
                    continue
                if b in self.loading or b in self.computing:
                    continue  # someone else brings it (delay-hit territory)
                if b in self.ssd:
                    todo.append(b)
                    continue
                break
            if not todo:  # others brought (or are bringing) its data meanwhile
                self._promote(rid, self._hint(r))
                continue
            nbytes = sum(self.ssd[b] for b in todo)
            for b in todo:
                self.loading[b] = rid
            self.reading = rid
            self.read_order.append(rid)
            dur = self.cost.ssd_read_time(nbytes)
            self.ssd_busy_until = self.now + dur
            self.ssd_busy_s += dur
            self.ssd_read_bytes += nbytes
            self._push(self.now + dur, _SSD_DONE, (rid, todo))
            return

    def _promote(self, rid: str, hint: TierHint) -> None:
        if hint.inflight_tokens > 0:
            self.inflight_waiters.add(rid)
        else:
            self.inflight_waiters.discard(rid)
        self.policy.prefetch_done(rid, self.now, hint)

    def _on_ssd_done(self, rid: str, blocks: list[int]) -> None:
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
        if waiting:
            h = self._hint(self.waiting[rid])
            if h.ssd_tokens == 0:
                self._promote(rid, h)
            else:  # part of its prefix left the host tier meanwhile: read again
                self._publish(rid, h)
        self._refresh_inflight()

    def _refresh_inflight(self) -> None:
        for rid in list(self.inflight_waiters):
            if rid in self.waiting:
                self._publish(rid, self._hint(self.waiting[rid]))
            else:
                self.inflight_waiters.discard(rid)

    def _try_dispatch(self) -> None:
        free = max(self.gpu_cap - self.held, 0)
        t0 = time.perf_counter()
        rid = self.policy.pick(self.now, free)
        self._decision_s += time.perf_counter() - t0
        self._decisions += 1
        if rid is None:
            return
        r = self.waiting.pop(rid)
        self.policy.dispatched(rid, self.now)
        self.inflight_waiters.discard(rid)
        self.dispatch_order.append(rid)
        staged = self.staged.pop(rid, set())
        kv = self.kv
        cached = host_b = sync_b = 0
        stop = len(r.blocks)
        for i, b in enumerate(r.blocks):
            t = self._block_tokens(r, i)
            if b in self.gpu:
                self.tokens["gpu"] += t
                self.gpu.move_to_end(b)
            elif b in staged:
                self.tokens["ssd_prefetch"] += t
                host_b += t * kv
            elif b in self.host:
                self.tokens["host"] += t
                host_b += t * kv
                self.host_policy.on_access(b)
            elif b in self.loading or b in self.computing:
                stop = i
                break
            elif b in self.ssd:
                self.tokens["ssd_sync"] += t
                sync_b += t * kv
                self.ssd.move_to_end(b)
            else:
                stop = i
                break
            cached += t
        self._unpin_all(rid)
        new = max(r.input_tokens - cached, 1 if r.input_tokens else 0)
        self.tokens["computed"] += new
        start = self.now
        if sync_b:
            s0 = max(self.now, self.ssd_busy_until)
            dur = self.cost.ssd_read_time(sync_b)
            self.ssd_busy_until = s0 + dur
            self.ssd_busy_s += dur
            self.ssd_read_bytes += sync_b
            start = s0 + dur
        load = self.cost.host_to_gpu_time(host_b + sync_b)
        prefill = self.cost.prefill_time(new, cached)
        first = start + load + prefill
        decode = self.cost.decode_gpu_time(r.output_tokens, r.input_tokens)
        end = first + decode
        self.gpu_busy = True
        self.gpu_busy_s += end - self.now
        self.gpu_compute_s += load + prefill + decode
        self.held += self._need(r)
        self._gpu_trim()
        computed = list(r.blocks[stop:])
        for b in computed:
            self.computing.setdefault(b, rid)
        arrival = r.arrival * self.config.time_scale
        self.queue[rid] = self.now - arrival
        self.ttft[rid] = first - arrival
        self._push(first, _PREFILL_DONE, (r, stop))
        self._push(end, _GPU_FREE, None)
        self._push(first + self.cost.decode_wall_time(r.output_tokens), _DECODE_DONE, r)

    def _on_prefill_done(self, r: SimRequest, stop: int) -> None:
        for i, b in enumerate(r.blocks):
            t = self._block_tokens(r, i)
            self._gpu_insert(b, t)
            if i >= stop:
                if self.computing.get(b) == r.rid:
                    del self.computing[b]
                nbytes = t * self.kv
                self._ssd_insert(b, nbytes)
                self._host_insert(b, nbytes)
            elif b not in self.host and b in self.ssd:  # read synchronously: now also in host memory
                self._host_insert(b, self.ssd[b])
        self._refresh_inflight()

    def _on_decode_done(self, r: SimRequest) -> None:
        self.held -= self._need(r)
        self.completed += 1
        self.host_policy.on_request_finished(r.blocks, r.output_tokens, self.now)

    # --- main loop -----------------------------------------------------------------------------------------------
    def run(self) -> SimResult:
        from tqdm import tqdm

        scale = self.config.time_scale
        for r in self.requests:
            self._push(r.arrival * scale, _ARRIVAL, r)
        first_arrival = self.requests[0].arrival * scale if self.requests else 0.0
        bar = tqdm(total=len(self.requests), desc=self.config.scheduler, unit="req", disable=not self.config.progress,
                   leave=False)
        events = self._events
        try:
            while events:
                t, _, kind, data = heapq.heappop(events)
                self.now = t
                if kind == _ARRIVAL:
                    if not self._on_arrival(data):  # type: ignore[arg-type]
                        bar.update(1)
                elif kind == _SSD_DONE:
                    self._on_ssd_done(*data)  # type: ignore[misc]
                elif kind == _PREFILL_DONE:
                    self._on_prefill_done(*data)  # type: ignore[misc]
                elif kind == _GPU_FREE:
                    self.gpu_busy = False
                elif kind == _DECODE_DONE:
                    self._on_decode_done(data)  # type: ignore[arg-type]
                    bar.update(1)
                    self.last_event = max(self.last_event, t)
                elif kind == _WAKE:
                    self._wake_at = None
                self._kick()
        finally:
            bar.close()
        if self.waiting:
            logger.warning("%d requests never ran (policy %s)", len(self.waiting), self.config.scheduler)
        return self._result(first_arrival)

    def _kick(self) -> None:
        if self.prefetching and self.reading is None:
            if self.now >= self.ssd_busy_until:
                self._issue_prefetch()
            elif self._wake_at is None or self._wake_at > self.ssd_busy_until:
                self._wake_at = self.ssd_busy_until
                self._push(self.ssd_busy_until, _WAKE, None)
        if not self.gpu_busy and self.waiting:
            self._try_dispatch()

    def _result(self, first_arrival: float) -> SimResult:
        q = list(self.queue.values())
        tt = list(self.ttft.values())
        span = max(self.last_event - first_arrival, 1e-9)
        ids = list(self.queue)
        by_id = {r.rid: r for r in self.requests}
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
            ssd_util=self.ssd_busy_s / span,
            makespan_s=span,
            tokens=dict(self.tokens),
            ssd_read_gb=self.ssd_read_bytes / 1e9,
            ssd_write_gb=self.ssd_write_bytes / 1e9,
            policy_stats=dict(getattr(self.policy, "stats", {})),
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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("trace", help="request trace (Mooncake JSONL)")
    parser.add_argument("--scheduler", default="dual-queue",
                        help=f"one of {', '.join(SCHEDULER_NAMES)}, a comma-separated list, or 'all'")
    parser.add_argument("--json", dest="json_out", help="write the results here (JSON)")
    parser.add_argument("--plot", help="write a PNG plot here (TTFT CDF, queueing over time)")
    parser.add_argument("--time-scale", type=float, default=None,
                        help="multiply arrival times by this (default: chosen so FCFS keeps the GPU --load busy)")
    parser.add_argument("--load", type=float, default=0.85, help="target FCFS GPU busy fraction for the default scale")
    parser.add_argument("--eviction", default="lru", help="host-tier eviction policy (any registered production name)")
    parser.add_argument("--profile", default=DEFAULT_PROFILE, choices=sorted(PROFILES), help="cost profile")
    parser.add_argument("--limit", type=int, default=None, help="use only the first N requests")
    parser.add_argument("--host-gb", type=float, default=None, help="override the host tier's capacity (GB)")
    parser.add_argument("--delay-hit-threshold", type=int, default=100, help="tokens (default 100)")
    parser.add_argument("--starvation-multiple", type=float, default=4.0, help="x mean wait (default 4)")
    parser.add_argument("--starvation-floor", type=float, default=2.0, help="seconds (default 2)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def _schedulers(arg: str) -> list[str]:
    names = list(SCHEDULER_NAMES) if arg == "all" else [s.strip() for s in arg.split(",") if s.strip()]
    for n in names:
        if n not in SCHEDULER_NAMES:
            raise SystemExit(f"kvtier simulate: unknown scheduler {n!r}; choose from {', '.join(SCHEDULER_NAMES)}")
    return names


def run(args: argparse.Namespace) -> int:
    from kvtier.storage_backends.eviction import production_policy_names

    names = _schedulers(args.scheduler)
    if args.eviction not in production_policy_names():
        raise SystemExit(f"kvtier simulate: unknown eviction policy {args.eviction!r}; "
                         f"choose from {', '.join(production_policy_names())}")
    reqs = load_trace(args.trace, args.limit)
    if not reqs:
        raise SystemExit(f"kvtier simulate: no requests in {args.trace}")
    base = SimConfig(
        profile=args.profile,
        eviction=args.eviction,
        policy=DualQueueConfig(
            delay_hit_threshold_tokens=args.delay_hit_threshold,
            starvation_multiple=args.starvation_multiple,
            starvation_floor_s=args.starvation_floor,
        ),
        host_bytes=int(args.host_gb * 1e9) if args.host_gb is not None else None,
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
    results: list[SimResult] = []
    for n in names:
        res = simulate(reqs, replace(base, scheduler=n, time_scale=scale))
        res.load_factor = load_factor
        results.append(res)
    _print_table(results)
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


def _print_table(results: Sequence[SimResult]) -> None:
    hdr = (f"{'scheduler':<22}{'done':>6}{'rej':>5}{'queue mean':>11}{'p50':>8}{'p99':>8}{'max':>8}"
           f"{'TTFT mean':>10}{'p50':>8}{'p99':>8}{'GPU':>6}{'SSD':>6}")
    print(hdr)
    for r in results:
        print(f"{r.scheduler:<22}{r.completed:>6}{r.rejected:>5}{r.mean_queue_s:>11.2f}{r.p50_queue_s:>8.2f}"
              f"{r.p99_queue_s:>8.2f}{r.max_queue_s:>8.1f}{r.mean_ttft_s:>10.2f}{r.p50_ttft_s:>8.2f}"
              f"{r.p99_ttft_s:>8.2f}{r.gpu_util:>6.0%}{r.ssd_util:>6.0%}")
    base = next((r for r in results if r.scheduler == "fcfs"), None)
    if base is not None and len(results) > 1:
        for r in results:
            if r is not base:
                print(f"  {r.scheduler} / fcfs: mean queue {r.mean_queue_s / max(base.mean_queue_s, 1e-12):.2f}x, "
                      f"P99 TTFT {r.p99_ttft_s / max(base.p99_ttft_s, 1e-12):.2f}x")


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
