"""A tier shared by several engines in `kvtier simulate` (issue 13): N replicas, one shared store.

`Cluster` runs N replicas of the simulator (`kvtier.sim.engine.Simulator`: each its own GPU queue, scheduling
policy, host tier and SSD tier) on one clock, in front of one `SimRemoteStore` that all of them share, as vLLM
replicas behind a router share one Redis / Valkey store through kvtier's connector. Each replica sees the store
through a `RemoteView`, the engine's plug-in point for a shared tier (`kvtier.sim.base.SharedTierView`): this
module imports the engine, never the reverse. The command line (`--replicas`, `--remote*`) is `kvtier.sim.simulate`.

The modelled store (the simulator's choices, documented so results can be judged):
- Capacity `capacity_gb`, evicted LRU by the store itself (Redis `maxmemory-policy allkeys-lru`, docs/shared-tier.md's
  configuration; kvtier coordinates no global eviction). A read touches its chunks (LRU order); a lookup does not.
- The link: one store reached over a network of `gbps` gigabits per second per direction (full duplex: reads and
  writes do not slow each other; every replica's reads share the one direction FIFO, every replica's writes the
  other), and `latency_ms` per operation (a request's prefetch is one batched read; a write is visible to other
  replicas `latency_ms` after its bytes are sent). Defaults: 10 Gbit/s (10GbE), 0.5 ms, 64 GB - loosely a Redis
  on a 10GbE network; this machine's loopback Redis measured 0.17-0.5 GB/s under load
  (`benchmarks/shared_tier.py`), i.e. `--remote-gbps 1.5-4`.
- Writes, as production's default `writes: all`: every full chunk a replica computes is written through when it
  lands, unless the store holds it or a write of it is queued (production: "a chunk kvtier has seen in the store is
  not sent again"; the simulator knows the store exactly). Each replica queues at most `write_queue_mb` (production's
  `kvtier.shared.max_queued_write_mb`, 256) of writes not yet sent; beyond it the write is dropped and counted.
- Lookups as production's connector: the store is asked only for the chunks after the first one neither local tier
  holds; its leading run there is the request's remote part (`remote_tokens` / `remote_bytes` of the residency
  passed to production's `derive_tier_hint`, which gives the REMOTE state). Prefetching schedulers read it into the
  replica's host tier (pinned for the request) beside the SSD part; the prefetch holds the replica's one prefetch
  slot until both parts landed. `fcfs` reads it synchronously at admission after the SSD part (GPU stalled, as
  LMCache's retrieve); `recompute` has no tiers at all. Chunks read from the store are not written to the local
  SSD tier (only computed chunks are).
- Routing: `round-robin` (request i, in arrival order, to replica i mod N) or `sticky` (conversation affinity: a
  request whose prompt continues an earlier request's whole prompt - it holds that request's last full block; a
  trace block id names its whole prefix - goes to that request's replica, the deepest such one, unless that
  replica has received more than `STICKY_LOAD_BOUND` (1.1) x its share of the requests so far; any other request
  goes to the replica that has received fewest, round-robin among equals).
- Load: the default time scale is the one-GPU calibration (`calibrate_time_scale`, FCFS local tiers) divided by N:
  the whole trace N times as dense, so that round-robin gives each replica the load a single GPU had.
- Recomputed tokens count blocks computed before by any replica (one `seen` set for the cluster).
"""

from __future__ import annotations

import heapq
import logging
import math
from collections import OrderedDict, deque
from collections.abc import Callable, Collection, Sequence
from dataclasses import asdict, dataclass, field

from kvtier.scheduler_hooks.hint_derivation import PrefixResidency, Residency
from kvtier.sim.base import TRACE_BLOCK_TOKENS, GpuJob, SimConfig, SimRequest, SimResult, percentile
from kvtier.sim.engine import Simulator

logger = logging.getLogger(__name__)

__all__ = ["ROUTINGS", "Cluster", "ClusterResult", "RemoteConfig", "RemoteView", "SimRemoteStore",
           "route", "run_cluster"]

ROUTINGS = ("round-robin", "sticky")
#: `sticky` routing's bound: a replica that has received more than this x its share of the requests routed so far
#: takes no sticky request (bounded-load consistent hashing, Mirrokni et al.; shared prefixes would otherwise pile
#: whole fan-outs onto one replica)
STICKY_LOAD_BOUND = 1.1


@dataclass(frozen=True, slots=True)
class RemoteConfig:
    """The shared store's link and capacity (see the module docstring for the defaults' origin)."""

    gbps: float = 10.0  #: gigabits per second, each direction
    latency_ms: float = 0.5  #: per operation
    capacity_gb: float = 64.0  #: GB (10**9 bytes)
    write_queue_mb: int = 256  #: per replica, MiB of writes not yet sent (production's max_queued_write_mb)

    def __post_init__(self) -> None:
        if self.gbps <= 0:
            raise ValueError(f"--remote-gbps must be > 0, got {self.gbps}")
        if self.latency_ms < 0:
            raise ValueError(f"--remote-latency-ms must be >= 0, got {self.latency_ms}")
        if self.capacity_gb <= 0:
            raise ValueError(f"--remote-gb must be > 0, got {self.capacity_gb}")
        if self.write_queue_mb < 0:
            raise ValueError(f"--remote-write-queue-mb must be >= 0, got {self.write_queue_mb}")

    @property
    def bytes_per_s(self) -> float:
        return self.gbps * 1e9 / 8

    @property
    def latency_s(self) -> float:
        return self.latency_ms / 1e3


class SimRemoteStore:
    """One store shared by every replica: LRU contents, a full-duplex FIFO link, per-replica write queues."""

    def __init__(self, config: RemoteConfig, replicas: int) -> None:
        self.config = config
        self.bps = config.bytes_per_s
        self.lat = config.latency_s
        self.cap = int(config.capacity_gb * 1e9)
        self.queue_cap = int(config.write_queue_mb) << 20
        self.data: OrderedDict[int, int] = OrderedDict()  # block -> bytes
        self.used = 0
        self.t = 0.0
        self._writes: deque[tuple[float, int, int]] = deque()  # (visible at, block, bytes), in time order
        self._pending: set[int] = set()
        self._queued: list[deque[tuple[float, int]]] = [deque() for _ in range(replicas)]  # (sent at, bytes)
        self._queued_bytes = [0] * replicas
        self._read_free = 0.0
        self._write_free = 0.0
        self._reads: list[tuple[float, int, Callable[[float], None]]] = []
        self._seq = 0
        # accounting
        self.read_bytes = 0
        self.reads = 0
        self.written_bytes = 0
        self.writes = 0
        self.dropped_writes = 0
        self.dropped_write_bytes = 0
        self.evictions = 0
        self.evicted_bytes = 0

    # --- time ----------------------------------------------------------------------------------------------------
    def advance(self, now: float) -> None:
        """Writes sent by `now` become visible (inserted, LRU eviction to capacity)."""
        self.t = max(self.t, now)
        w = self._writes
        while w and w[0][0] <= now:
            _, b, n = w.popleft()
            self._pending.discard(b)
            self._insert(b, n)

    def next_time(self) -> float:
        return self._reads[0][0] if self._reads else math.inf

    def fire(self) -> None:
        """Complete the next read (call when `next_time()` is the earliest event of the cluster)."""
        t, _, done = heapq.heappop(self._reads)
        self.advance(t)
        done(t)

    # --- contents ------------------------------------------------------------------------------------------------
    def __contains__(self, b: int) -> bool:
        return b in self.data

    def seed(self, blocks: Sequence[int], nbytes: int) -> None:
        """Place blocks in the store before a run (hand-built scenarios; not counted as writes)."""
        for b in blocks:
            self._insert(b, nbytes)
            self.writes -= 1
            self.written_bytes -= nbytes

    def _insert(self, b: int, n: int) -> None:
        if b in self.data:
            self.data.move_to_end(b)
            return
        if n > self.cap:
            return
        self.data[b] = n
        self.used += n
        self.written_bytes += n
        self.writes += 1
        while self.used > self.cap:
            _, m = self.data.popitem(last=False)
            self.used -= m
            self.evictions += 1
            self.evicted_bytes += m

    # --- operations ----------------------------------------------------------------------------------------------
    def read(self, now: float, blocks: Sequence[int], done: Callable[[float, dict[int, int]], None],
             block_bytes: int = 0) -> float:
        """Read `blocks` for one request; `done(t, sizes)` when they arrived. Returns t. A block evicted since the
        lookup (a synchronous read issued when its job starts) is charged `block_bytes` and still served (the
        simulator's simplification: the store kept it for the reader)."""
        sizes = {}
        for b in blocks:
            n = self.data.get(b)
            if n is None:
                sizes[b] = block_bytes
                continue
            sizes[b] = n
            self.data.move_to_end(b)
        nbytes = sum(sizes.values())
        sent = max(now, self._read_free) + nbytes / self.bps
        self._read_free = sent
        self.read_bytes += nbytes
        self.reads += 1
        self._seq += 1
        t = sent + self.lat
        heapq.heappush(self._reads, (t, self._seq, lambda at: done(at, sizes)))
        return t

    def write(self, now: float, replica: int, b: int, nbytes: int) -> bool:
        """Queue replica's write of `b`; False when skipped (already there or queued) or dropped (queue full)."""
        if b in self.data or b in self._pending:
            return False
        q = self._queued[replica]
        while q and q[0][0] <= now:
            self._queued_bytes[replica] -= q.popleft()[1]
        if self._queued_bytes[replica] + nbytes > self.queue_cap:
            self.dropped_writes += 1
            self.dropped_write_bytes += nbytes
            return False
        sent = max(now, self._write_free) + nbytes / self.bps
        self._write_free = sent
        q.append((sent, nbytes))
        self._queued_bytes[replica] += nbytes
        self._pending.add(b)
        self._writes.append((sent + self.lat, b, nbytes))
        return True

    def transfer_time(self, nbytes: int) -> float:
        return self.lat + nbytes / self.bps

    def stats(self, span_s: float) -> dict:
        span = max(span_s, 1e-9)
        return {"read_gb": self.read_bytes / 1e9, "reads": self.reads, "written_gb": self.written_bytes / 1e9,
                "writes": self.writes, "dropped_writes": self.dropped_writes,
                "dropped_write_gb": self.dropped_write_bytes / 1e9, "evictions": self.evictions,
                "evicted_gb": self.evicted_bytes / 1e9, "used_gb": self.used / 1e9,
                "read_link_util": self.read_bytes / self.bps / span,
                "write_link_util": (self.written_bytes + sum(n for _, _, n in self._writes)) / self.bps / span}


class RemoteView:
    """The shared store as one replica's simulator uses it (`SharedTierView`: what `Simulator` calls on `remote`)."""

    def __init__(self, store: SimRemoteStore, replica: int) -> None:
        self.store = store
        self.replica = replica
        self.sim: Simulator | None = None

    def __contains__(self, b: int) -> bool:
        return b in self.store.data

    def prefix(self, blocks: Sequence[int]) -> list[int]:
        """The leading run of `blocks` in the store (production's `SharedTier.prefix`)."""
        out = []
        data = self.store.data
        for b in blocks:
            if b not in data:
                break
            out.append(b)
        return out

    def extend_walk(self, r: SimRequest, res: PrefixResidency, stop: int,
                    staged: Collection[int]) -> tuple[PrefixResidency, int]:
        """The local walk `res` ended at block `stop` (resident in neither local tier): add the store's run."""
        sim = self.sim
        data = self.store.data
        rt = rb = 0
        i = stop
        while i < len(r.blocks) and r.blocks[i] in data:
            t = sim._block_tokens(r, i)
            rt += t
            rb += t * sim.kv
            i += 1
        if not rt:
            return res, stop
        return Residency(host_end=res.host_end, hit_end=res.hit_end + rt, ssd_tokens=res.ssd_tokens,
                         ssd_bytes=res.ssd_bytes, remote_tokens=rt, remote_bytes=rb), i

    def read(self, rid: str, blocks: list[int]) -> None:
        sim = self.sim
        self.store.read(sim.now, blocks, lambda t, sizes: sim.external(t, sim._on_remote_done, rid, blocks, sizes))

    def read_sync(self, job: GpuJob) -> None:
        sim = self.sim
        per = job.sync_remote_bytes // max(len(job.sync_remote_blocks), 1)
        self.store.read(sim.now, job.sync_remote_blocks, lambda t, _sizes: sim.external(t, sim._compute, job, t), per)

    def read_time(self, nbytes: int) -> float:
        return self.store.transfer_time(nbytes)

    def write(self, b: int, nbytes: int) -> None:
        self.store.write(self.sim.now, self.replica, b, nbytes)


def route(requests: Sequence[SimRequest], replicas: int, routing: str = "round-robin") -> list[list[SimRequest]]:
    """Split `requests` (any order; routed in arrival order) over `replicas` (see the module docstring)."""
    if replicas < 1:
        raise ValueError(f"--replicas must be >= 1, got {replicas}")
    if routing not in ROUTINGS:
        raise ValueError(f"unknown --routing {routing!r}; choose one of {', '.join(ROUTINGS)}")
    parts: list[list[SimRequest]] = [[] for _ in range(replicas)]
    ends: dict[int, int] = {}  # last full block of a routed request -> its replica
    rr = 0
    for r in sorted(requests, key=lambda r: r.arrival):
        target = None
        if routing == "sticky":
            for b in r.blocks:  # a trace block id names its whole prefix: the deepest earlier request continued
                if b in ends:
                    target = ends[b]
        routed = sum(len(p) for p in parts)
        if target is not None and len(parts[target]) >= STICKY_LOAD_BOUND * (routed + 1) / replicas:
            target = None  # bounded load: a replica already past its share takes no more sticky requests
        if target is None:
            target = min(range(replicas), key=lambda i: (len(parts[i]), (i - rr) % replicas))
            rr += 1
        parts[target].append(r)
        full = r.input_tokens // TRACE_BLOCK_TOKENS
        if routing == "sticky" and full:
            ends[r.blocks[min(full, len(r.blocks)) - 1]] = target
    return parts


@dataclass(slots=True)
class ClusterResult:
    """One cluster run: the replicas' requests together, hits per tier, the store's traffic."""

    scheduler: str
    replicas: int
    routing: str
    remote: dict | None  #: the store's configuration (None: local tiers only)
    time_scale: float
    requests: int
    completed: int
    rejected: int
    mean_queue_s: float
    p99_queue_s: float
    max_queue_s: float
    mean_ttft_s: float
    p99_ttft_s: float
    hits: dict[str, int]  #: prompt tokens by tier: gpu, host, ssd (prefetched + synchronous), remote (same), computed
    recomputed_tokens: int
    remote_stats: dict | None
    per_replica: list[SimResult] = field(repr=False, default_factory=list)

    def to_json(self) -> dict:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__ if k != "per_replica"}
        d["per_replica"] = [r.to_json() for r in self.per_replica]
        return d


class Cluster:
    """N replicas on one clock, sharing one store (or none: `remote=None`)."""

    def __init__(self, requests: Sequence[SimRequest], config: SimConfig, replicas: int = 1,
                 routing: str = "round-robin", remote: RemoteConfig | None = None) -> None:
        self.config = config
        self.routing = routing
        self.remote_config = remote if config.scheduler != "recompute" else None  # recompute: no tiers at all
        self.parts = route(requests, replicas, routing)
        self.store = SimRemoteStore(self.remote_config, replicas) if self.remote_config is not None else None
        self.sims: list[Simulator] = []
        seen: set[int] = set()
        for i, part in enumerate(self.parts):
            view = RemoteView(self.store, i) if self.store is not None else None
            sim = Simulator(part, config, remote=view)
            if view is not None:
                view.sim = sim
            sim.seen = seen
            self.sims.append(sim)

    def run(self) -> ClusterResult:
        sims, store = self.sims, self.store
        for s in sims:
            s.begin()
        try:
            while True:
                i, t = min(enumerate(s.next_time() for s in sims), key=lambda x: x[1])
                ts = store.next_time() if store is not None else math.inf
                if t == math.inf and ts == math.inf:
                    break
                if ts <= t:
                    store.fire()
                    continue
                if store is not None:
                    store.advance(t)
                sims[i].step()
        finally:
            for s in sims:
                s._bar.close()
        return self._result([s.finish() for s in sims])

    def _result(self, results: list[SimResult]) -> ClusterResult:
        q = [x for r in results for x in r.queue_s]
        tt = [x for r in results for x in r.ttft_s]
        tok: dict[str, int] = {}
        for r in results:
            for k, v in r.tokens.items():
                tok[k] = tok.get(k, 0) + v
        hits = {"gpu": tok.get("gpu", 0), "host": tok.get("host", 0),
                "ssd": tok.get("ssd_prefetch", 0) + tok.get("ssd_sync", 0),
                "remote": tok.get("remote", 0) + tok.get("remote_sync", 0), "computed": tok.get("computed", 0)}
        span = max((r.makespan_s for r in results), default=0.0)
        return ClusterResult(
            scheduler=self.config.scheduler, replicas=len(self.sims), routing=self.routing,
            remote=asdict(self.remote_config) if self.remote_config is not None else None,
            time_scale=self.config.time_scale, requests=sum(r.requests for r in results),
            completed=sum(r.completed for r in results), rejected=sum(r.rejected for r in results),
            mean_queue_s=sum(q) / len(q) if q else 0.0, p99_queue_s=percentile(q, 99), max_queue_s=max(q, default=0.0),
            mean_ttft_s=sum(tt) / len(tt) if tt else 0.0, p99_ttft_s=percentile(tt, 99), hits=hits,
            recomputed_tokens=sum(r.recomputed_tokens for r in results),
            remote_stats=self.store.stats(span) if self.store is not None else None, per_replica=results)


def run_cluster(requests: Sequence[SimRequest], config: SimConfig, replicas: int = 1, routing: str = "round-robin",
                remote: RemoteConfig | None = None) -> ClusterResult:
    return Cluster(requests, config, replicas, routing, remote).run()
