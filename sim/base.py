"""The types the simulator's modules share: a trace request, a run's configuration and result, one GPU job, the
plug-in point of a tier shared by replicas (`SharedTierView`), and the trace reader.

Everything in `kvtier.sim` imports this module; it imports nothing of `kvtier.sim` but the cost model.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Protocol

from kvtier.scheduler_hooks.dual_queue_policy import DualQueueConfig
from kvtier.scheduler_hooks.hint_derivation import PrefixResidency
from kvtier.sim.cost_model import DEFAULT_PROFILE
from kvtier.storage_backends.admission.base import ADMIT_ALL, Decision

__all__ = ["TRACE_BLOCK_TOKENS", "GpuJob", "SharedTierView", "SimConfig", "SimRequest", "SimResult", "load_trace",
           "percentile"]

TRACE_BLOCK_TOKENS = 512
#: event kinds of the engine's queue (ties at equal times are broken by push order, never by kind)
EV_ARRIVAL, EV_SSD, EV_LANDING, EV_PREFILL_DONE, EV_GPU_FREE, EV_DECODE_DONE = range(6)


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
    #: the SSD tier's write admission (`kvtier.ssd_admission`'s policies: all, continuing, second-sight, none)
    ssd_admission: str = "all"


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
    ssd_admission: str = "all"  #: the SSD tier's write admission
    ssd_refused_blocks: int = 0  #: computed full blocks the admission kept off the SSD (host tier only)

    @property
    def ssd_hit_blocks(self) -> float:
        """Prompt blocks (of the trace's block size) served from the SSD tier (prefetched or read in the step)."""
        return (self.tokens.get("ssd_prefetch", 0) + self.tokens.get("ssd_sync", 0)) / TRACE_BLOCK_TOKENS

    def to_json(self) -> dict:
        d = asdict(self)
        for k in ("queue_s", "ttft_s", "arrival_s"):
            d.pop(k)
        return d


@dataclass(slots=True)
class GpuJob:
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
    #: which of its blocks the SSD tier writes (the SSD admission's verdict at its admission)
    ssd: Decision = ADMIT_ALL


class SharedTierView(Protocol):
    """A tier shared by several replicas, as one replica's `Simulator` uses it (its `remote`;
    `kvtier.sim.remote.RemoteView` implements it). The replicas layer plugs in here: the engine never imports it."""

    def __contains__(self, block: int) -> bool:
        """Whether the store holds `block` now."""

    def prefix(self, blocks: Sequence[int]) -> list[int]:
        """The leading run of `blocks` the store holds (what a prefetch reads from it)."""

    def extend_walk(self, r: SimRequest, res: PrefixResidency, stop: int,
                    staged: Collection[int]) -> tuple[PrefixResidency, int]:
        """The local prefix walk `res` ended at block `stop` (resident in no local tier): (the walk with the store's
        run after it, the index of the first block past that run)."""

    def read(self, rid: str, blocks: list[int]) -> None:
        """Prefetch `blocks` for waiting request `rid`; once they arrived, the engine's `_on_remote_done` takes them."""

    def read_sync(self, job: GpuJob) -> None:
        """Read `job`'s shared-tier part with the GPU stalled; when it arrived the engine's `_compute` runs the job."""

    def read_time(self, nbytes: int) -> float:
        """Seconds one read of `nbytes` takes on an idle link."""

    def write(self, block: int, nbytes: int) -> None:
        """Write a computed chunk through to the store."""


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


def percentile(xs: Sequence[float], q: float) -> float:
    """The `q`-th percentile of `xs` (0 when empty), interpolated linearly between closest ranks."""
    if not xs:
        return 0.0
    s = sorted(xs)
    k = (len(s) - 1) * q / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)

