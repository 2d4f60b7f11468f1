"""Watches LMCache's host pool (`max_local_cpu_size`, LMCache's `LocalCPUBackend`) for exhaustion.

LMCache allocates every chunk it stores, and every chunk kvtier reads from SSD, in that pool, evicting unpinned
chunks first. When nothing is evictable (chunks pinned for loads or prefetches, or held by queued SSD writes)
the allocation fails: a store keeps the chunks placed so far and silently skips the rest (they never reach the
SSD tier either: future misses), an SSD read of that chunk becomes a miss. LMCache itself only prints an
allocator warning for every attempt that found the pool full, also for the ones that then evicted and went on
normally (under load, thousands of lines that say nothing about lost data).

`HostPoolWatch` sits on the pool's `allocate`/`batched_allocate` (installed by the kvtier plugin on its
`local_cpu_backend`) and tells them apart: only allocations that still fail after LMCache's eviction count, in
`kvtier_host_pool_exhausted_total{op}` (`store`: a chunk LMCache could not store; `ssd_read`: an SSD chunk not
staged), and each episode of them (failures less than `QUIET_S` apart) is logged once, naming the setting to
change. LMCache's per-attempt allocator warnings are dropped while a watch is installed (this module reports the
outcome instead). `scope(op)` counts the allocations one caller makes (the connector retries a short store).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from kvtier.storage_backends import metrics as M
from kvtier.storage_backends.base import HostTier
from kvtier.storage_backends.lmcache.engine_access import hook_host_allocators

logger = logging.getLogger(__name__)

#: LMCache loggers and the messages of theirs that a watch replaces (allocator attempts, skipped-store notes)
_LMCACHE_NOISE = {
    "lmcache.v1.memory_management": ("Failed to allocate memory block", "Failed to batched allocate"),
    "lmcache.v1.cache_engine": ("Local cpu memory under pressure",),
}
_OPS = {
    "store": "LMCache skips storing chunks (they reach neither the host nor the SSD tier: later misses)",
    "ssd_read": "chunks on SSD cannot be staged in host memory (recomputed instead)",
}


class _NoiseFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        prefixes = _LMCACHE_NOISE.get(record.name, ())
        return not (prefixes and isinstance(record.msg, str) and record.msg.startswith(prefixes))


_FILTER = _NoiseFilter()


@dataclass
class AllocScope:
    """Allocations made by one caller inside `HostPoolWatch.scope`: placed and failed (after eviction)."""

    op: str
    ok: int = 0
    failed: int = 0


class HostPoolWatch:
    #: failed allocations further apart than this start a new episode (and a new log line)
    QUIET_S = 30.0

    def __init__(self, local_cpu_backend: HostTier, pool_gb: float | None) -> None:
        self.backend = local_cpu_backend
        self.pool_gb = pool_gb
        self.failures = 0
        self.episodes = 0
        self._last_failure: float | None = None
        self._local = threading.local()
        self._lock = threading.Lock()
        # LMCache's storage manager and kvtier's plugin call the pool through these from now on
        self._allocate, self._batched_allocate = hook_host_allocators(local_cpu_backend, self.allocate,
                                                                      self.batched_allocate)
        for name in _LMCACHE_NOISE:
            lg = logging.getLogger(name)
            if _FILTER not in lg.filters:
                lg.addFilter(_FILTER)

    # ------------------------------------------------------------------ the pool's entry points
    def allocate(self, *args: Any, **kwargs: Any) -> Any:
        obj = self._allocate(*args, **kwargs)
        self._record(1 if obj is not None else 0, 0 if obj is not None else 1, kwargs)
        return obj

    def batched_allocate(self, *args: Any, **kwargs: Any) -> list[Any] | None:
        objs = self._batched_allocate(*args, **kwargs)
        n = int(kwargs.get("batch_size", args[2] if len(args) > 2 else 1))
        self._record(n if objs is not None else 0, 0 if objs is not None else n, kwargs)
        return objs

    # ------------------------------------------------------------------ callers
    @contextmanager
    def scope(self, op: str) -> Iterator[AllocScope]:
        """Count this thread's allocations under `op` (`store` or `ssd_read`)."""
        prev = getattr(self._local, "scope", None)
        sc = self._local.scope = AllocScope(op)
        try:
            yield sc
        finally:
            self._local.scope = prev

    def report_lost(self, op: str, chunks: int) -> None:
        """A caller's final word: `chunks` did not make it (after its own retry)."""
        if chunks > 0:
            M.HOST_POOL_LOST.labels(op).inc(chunks)

    # ------------------------------------------------------------------ accounting
    def _record(self, ok: int, failed: int, kwargs: dict[str, Any]) -> None:
        sc = getattr(self._local, "scope", None)
        if sc is not None:
            sc.ok += ok
            sc.failed += failed
        if not failed or kwargs.get("eviction", True) is False:
            return
        op = sc.op if sc is not None else "store"
        M.HOST_POOL_EXHAUSTED.labels(op).inc(failed)
        now = time.monotonic()
        with self._lock:
            self.failures += failed
            new_episode = self._last_failure is None or now - self._last_failure > self.QUIET_S
            self._last_failure = now
            if new_episode:
                self.episodes += 1
        if new_episode:
            self._log_episode(op)

    def _held(self) -> tuple[int, int]:
        """(chunks, bytes) in the pool that LMCache cannot evict right now (pinned or referenced)."""
        n = nbytes = 0
        try:
            for obj in list(self.backend.hot_cache.values()):
                if not obj.can_evict:
                    n += 1
                    nbytes += obj.get_size()
        except Exception:  # a racing mutation of LMCache's mapping: the numbers are only for the message
            pass
        return n, nbytes

    def _log_episode(self, op: str) -> None:
        n, nbytes = self._held()
        size = f"{self.pool_gb:g} GiB" if self.pool_gb else "unknown"
        logger.warning(
            "kvtier: LMCache's host pool is exhausted (max_local_cpu_size = %s; %d chunks, %.1f MiB, pinned for "
            "loads/prefetches or queued for SSD writes): %s. Counted in kvtier_host_pool_exhausted_total{op}; "
            "raise max_local_cpu_size in the LMCache config (or lower the load) to keep them. Logged once per "
            "episode (failures less than %.0f s apart).", size, n, nbytes / 2**20, _OPS.get(op, op), self.QUIET_S)
