"""The ghost cache: Belady replayed over a sliding window of recent accesses. It learns per reuse-time bucket how
likely a reuse with that reuse time is a hit for the optimal policy at the tier's capacity.

Only the past is used: the window holds accesses that already happened; Belady's "future" is the future *inside*
the window. To keep it cheap and its memory bounded, keys are spatially sampled (one key in `sample_rate`, by a
hash of the key, as in SHARDS) and the ghost capacity is scaled by the same factor. Belady reruns after every
`refresh` sampled accesses (once the window holds two refreshes' worth). Memory: at most `window` sampled accesses
(key, time) plus the per-bucket counters.
"""

from __future__ import annotations

import bisect
import heapq
import logging
import math
from collections import deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

logger = logging.getLogger(__name__)

_MIX = 0x9E3779B97F4A7C15
_MASK = (1 << 64) - 1


_SALT = 0x5851F42D4C957F2D


def key_hash(key: Hashable, salt: int = 0) -> int:
    """A well-mixed 24-bit hash of the key for spatial sampling (`key_hash(k) % rate == 0`: sampled); another
    `salt` gives another, independent sample (salt 0 is the default hash)."""
    x = (hash(key) * _MIX) & _MASK
    if salt:  # re-mixed (an added constant alone would keep neighbouring keys' samples correlated)
        x ^= (x >> 29) ^ ((salt * _SALT) & _MASK)
        x = ((x ^ (x >> 32)) * _MIX) & _MASK
    return x >> 40


def key_sample(key: Hashable, rate: int) -> bool:
    """Deterministic spatial sampling: True for about one key in `rate`."""
    if rate <= 1:
        return True
    return key_hash(key) % rate == 0


@dataclass(frozen=True)
class ReuseBuckets:
    """Geometric reuse-time buckets (seconds): [0, e1), [e1, e2), ..., [e_{K-1}, horizon); beyond = 'never'."""

    edges: tuple[float, ...]  #: upper edges, increasing; the last one is the horizon

    @classmethod
    def geometric(cls, first: float = 2.0, horizon: float = 3600.0, ratio: float = 1.35) -> ReuseBuckets:
        edges = [first]
        while edges[-1] * ratio < horizon:
            edges.append(edges[-1] * ratio)
        edges.append(horizon)
        return cls(tuple(edges))

    def __len__(self) -> int:
        return len(self.edges)

    @property
    def horizon(self) -> float:
        return self.edges[-1]

    def index(self, gap: float) -> int:
        """Bucket of a reuse time; len(self) for gaps at or beyond the horizon."""
        return bisect.bisect_right(self.edges, gap)

    def lower(self, k: int) -> float:
        return 0.0 if k == 0 else self.edges[k - 1]


@dataclass
class GhostStats:
    """What one ghost run saw (for reports and tests)."""

    runs: int
    window: int
    sampled_capacity: int
    reuses: list[float]
    hits: list[float]


def belady_hits(keys: Sequence[Hashable], capacity: int) -> list[bool]:
    """Offline Belady over `keys` with `capacity` slots (unit sizes): hit flag per access. Keys with no next
    access are evicted first (kept in a plain list, not the heap: which of them goes first changes no hit)."""
    n = len(keys)
    inf = math.inf
    nxt = [inf] * n
    last: dict[Hashable, int] = {}
    for i in range(n - 1, -1, -1):
        k = keys[i]
        nxt[i] = last.get(k, inf)
        last[k] = i
    out = [False] * n
    if capacity <= 0:
        return out
    resident: dict[Hashable, float] = {}
    heap: list[tuple[float, int, Hashable]] = []
    dead: list[Hashable] = []  # residents never used again (lazily invalidated)
    push, pop = heapq.heappush, heapq.heappop
    for i, k in enumerate(keys):
        nu = nxt[i]
        if k in resident:
            out[i] = True
        elif len(resident) >= capacity:
            while dead:
                v = dead.pop()
                if resident.get(v) == inf:
                    del resident[v]
                    break
            else:
                while True:
                    negn, _, v = pop(heap)
                    if resident.get(v) == -negn:
                        del resident[v]
                        break
        resident[k] = nu
        if nu == inf:
            dead.append(k)
        else:
            push(heap, (-nu, i, k))
            if len(heap) > 4 * capacity + 64:
                heap = [(-n_, j, kk) for j, (kk, n_) in enumerate(resident.items()) if n_ != inf]
                heapq.heapify(heap)
    return out


class GhostBelady:
    """Sampled sliding-window Belady that estimates P(hit | reuse-time bucket)."""

    def __init__(
        self,
        buckets: ReuseBuckets,
        sample_rate: int = 8,
        window: int = 16384,
        refresh: int = 2048,
        smoothing: float = 0.5,
    ) -> None:
        if window < 2 or refresh < 1:
            raise ValueError("ghost window must be >= 2 and refresh >= 1")
        self.buckets = buckets
        self.sample_rate = max(1, int(sample_rate))
        self.window = int(window)
        self.refresh = int(refresh)
        #: sampled accesses before the first run (default: two refreshes' worth, or the window if smaller)
        self.first_run = min(self.window, 2 * self.refresh)
        self.smoothing = smoothing
        self._trace: deque[tuple[Hashable, float]] = deque(maxlen=self.window)  # (key, time)
        self._since = 0
        self.runs = 0
        K = len(buckets)
        self._reuses = [0.0] * K
        self._hits = [0.0] * K
        #: P(hit | bucket); optimistic 1.0 until the first run
        self.hit_prob: list[float] = [1.0] * K
        self.last_capacity = 0

    def memory_items(self) -> int:
        return len(self._trace)

    def record(self, key: Hashable, now: float, capacity_blocks: int) -> bool:
        """Record one access; reruns Belady when due. True when it reran."""
        if not key_sample(key, self.sample_rate):
            return False
        return self.record_sampled(key, now, capacity_blocks)

    def record_sampled(self, key: Hashable, now: float, capacity_blocks: int) -> bool:
        """`record` for a key the caller already knows is sampled (`key_sample(key, sample_rate)`)."""
        self._trace.append((key, now))
        self._since += 1
        if (len(self._trace) >= self.first_run if not self.runs
                else self._since >= self.refresh and len(self._trace) >= min(self.window, 2 * self.refresh)):
            self._since = 0
            self.rerun(capacity_blocks)
            return True
        return False

    def rerun(self, capacity_blocks: int) -> None:
        cap = max(1, int(round(capacity_blocks / self.sample_rate)))
        self.last_capacity = cap
        trace = list(self._trace)
        keys = [e[0] for e in trace]
        hits = belady_hits(keys, cap)
        K = len(self.buckets)
        reuses = [0.0] * K
        hit_n = [0.0] * K
        prev: dict[Hashable, float] = {}
        idx = self.buckets.index
        for (k, t), h in zip(trace, hits):
            p = prev.get(k)
            prev[k] = t
            if p is None:
                continue
            b = idx(t - p)
            if b >= K:
                continue
            reuses[b] += 1
            if h:
                hit_n[b] += 1
        a = self.smoothing if self.runs else 0.0
        self._reuses = [a * o + (1 - a) * n for o, n in zip(self._reuses, reuses)]
        self._hits = [a * o + (1 - a) * n for o, n in zip(self._hits, hit_n)]
        self.runs += 1
        # Belady's hit chance falls with the reuse time: fill empty buckets from the left, keep it non-increasing.
        out: list[float] = []
        cur = 1.0
        span = trace[-1][1] - trace[0][1] if trace else 0.0
        for b in range(K):
            if self._reuses[b] >= 1.0:
                cur = min(cur, self._hits[b] / self._reuses[b])
            elif self.buckets.lower(b) > span:
                cur = 0.0  # beyond what the window can show
            out.append(cur)
        self.hit_prob = out
        logger.debug("ghost belady run %d: cap=%d window=%d hit_prob=%s", self.runs, cap, len(trace), out)

    def stats(self) -> GhostStats:
        return GhostStats(self.runs, len(self._trace), self.last_capacity, list(self._reuses), list(self._hits))
