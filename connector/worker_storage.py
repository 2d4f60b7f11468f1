"""A worker rank's storage side, as the scheduler side sees it over the RPC: where a request's chunks are, what is
pinned for it in host memory, and its prefetches into host memory; and the narrow handle on kvtier's SSD tier that
the worker uses.

- `SSDTierHandle`: what the worker side uses of the SSD tier and of the LMCache plugin (`KVTierBackend`) that owns
  it (membership, chunk size, reads into host objects, flush, the host pool's watch, counters), built once when
  the engine has started.
- `WorkerStorage.lookup` walks a request's chunk keys: host tier (LMCache's `LocalCPUBackend`), then the SSD tier
  (the walk's rule: `kvtier.scheduler_hooks.prefix_walk`), then the shared tier when there is one
  (`connector/shared_side.py`: local tiers always first). With `pin`, the
  host-resident prefix is pinned for the request until its load (or `release`).
- `WorkerStorage.submit_prefetch` reads SSD-only and shared-only chunks into the host tier on a background thread
  (never inside a forward pass) and pins them for the request until its load. Where the load's SSD stream reads
  straight into device memory (`direct_ssd`: kvikio), SSD-only chunks are left to it, never staged in host
  memory. A chunk another prefetch is reading from the SSD is not read again: the second prefetch waits for that
  read (after issuing its own) and pins the chunk when it lands (reading it itself only if that read failed);
  counted in kvtier_connector_prefetch_shared_chunks_total. `take_results` hands finished prefetches to the poll.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch

from kvtier.compat import lmcache_retrieve_pins
from kvtier.connector import metrics as M
from kvtier.connector.config import ConnectorOptions
from kvtier.connector.messages import LookupResult, PrefetchResult
from kvtier.connector.rpc import StatsReply
from kvtier.connector.transfer_timing import AT_ONCE, TransferTiming
from kvtier.scheduler_hooks.prefix_walk import HOST, RESIDENT, SSD, walk_chunks
from kvtier.storage_backends.eviction import session_signals
from kvtier.storage_backends.lmcache.engine_access import report_host_hits

if TYPE_CHECKING:
    from lmcache.utils import CacheEngineKey
    from lmcache.v1.memory_management import MemoryObj

    from kvtier.connector.shared_side import SharedSide
    from kvtier.storage_backends.base import ChunkMeta, HostTier, TierStats
    from kvtier.storage_backends.lmcache.backend import KVTierBackend
    from kvtier.storage_backends.lmcache.host_pool import HostPoolWatch

logger = logging.getLogger(__name__)

__all__ = ["SSDTierHandle", "WorkerStorage"]

#: the chunks of a request's key tokens, with its identity tag: (start, end, LMCache key), in order
Chunks = Callable[[list[int], str], list[tuple[int, int, Any]]]
#: the LMCache key tag that carries a request's identity tag (`CacheEngineKey` tags: part of the key's equality,
#: hash and string)
IDENTITY_TAG = "lmcache.tag.kvtier_id"


def request_configs(tag: str) -> dict[str, str] | None:
    """LMCache's `request_configs` for a request with identity tag `tag` (None: a plain request, plain keys)."""
    return {IDENTITY_TAG: tag} if tag else None


class SSDTierHandle:
    """The worker side's narrow view of kvtier's SSD tier (through the LMCache plugin that owns it)."""

    def __init__(self, plugin: KVTierBackend) -> None:
        from kvtier.storage_backends.lmcache.engine_access import plugin_ssd_tier

        self._plugin = plugin
        self._tier = plugin_ssd_tier(plugin)

    @property
    def directory(self) -> str:
        return self._tier.directory

    @property
    def chunk_bytes(self) -> int:
        """Bytes of one chunk's KV (what a chunk read moves)."""
        return self._tier.chunk_bytes

    @property
    def pool_watch(self) -> HostPoolWatch:
        """LMCache's host pool, watched for allocations that found it full (a store's retry and its losses)."""
        return self._plugin.pool_watch

    @property
    def stats(self) -> TierStats:
        """The tier's counters (hits, misses, bytes, ...)."""
        return self._tier.stats

    def __len__(self) -> int:
        """Chunks stored."""
        return len(self._tier)

    def contains(self, key: CacheEngineKey) -> bool:
        return self._tier.contains(key.to_string())

    def read(self, keys: Sequence[CacheEngineKey]) -> list[MemoryObj | None]:
        """Read chunks into LMCache host objects; a chunk that is missing, or finds the host pool full, is None
        (never waits for room: a prefetch must not hold the pool it is filling)."""
        return self._plugin.read(keys, wait_for_memory=False)

    @staticmethod
    def _positions(keys: Sequence[CacheEngineKey]) -> dict[str, int]:
        """Each chunk's tier key -> its position in `keys` (a chunk asked twice in one read is refused)."""
        index = {k.to_string(): i for i, k in enumerate(keys)}
        if len(index) != len(keys):
            raise ValueError("the same chunk twice in one read")
        return index

    def read_into(self, keys: Sequence[CacheEngineKey], dest: Callable[[int, ChunkMeta], memoryview | None]
                  ) -> list[bool]:
        """Read chunks into buffers the caller owns: `dest(i, meta)` is the i-th chunk's destination (None: not
        read). Verified as every read of the tier is (a torn, flipped or foreign slot is a miss); True where the
        chunk arrived whole."""
        index = self._positions(keys)

        def alloc(key: str, meta: ChunkMeta) -> tuple[memoryview, int] | None:
            buf = dest(index[key], meta)
            return None if buf is None else (buf, index[key])

        got = self._tier.read_batch(list(index), alloc, lambda _i: None)
        return [h is not None for h in got]

    @property
    def reads_into_device(self) -> bool:
        """Whether the tier reads straight into device memory (kvikio: GDS, or its compat mode)."""
        return self._tier.reads_into_device

    def read_into_device(self, keys: Sequence[CacheEngineKey], dest: Callable[[int, ChunkMeta], torch.Tensor | None]
                         ) -> list[bool]:
        """`read_into` for device buffers: `dest(i, meta)` is the i-th chunk's device tensor (None: not read); each
        chunk goes from the SSD into it through kvikio, verified."""
        index = self._positions(keys)
        return self._tier.read_batch_into_device(list(index), lambda key, meta: dest(index[key], meta))

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until the queued SSD writes are committed (False: not within `timeout` seconds)."""
        return self._plugin.flush(timeout)

    def policy_stats(self) -> dict[str, Any]:
        """The eviction policy's name and counters (`EvictionPolicy.stats`: empty for most policies)."""
        policy = self._tier.policy
        return {"name": policy.name, **policy.stats()}


class WorkerStorage:
    """Lookups, host-memory pins and prefetches of one worker rank (thread-safe: the RPC thread, the prefetch
    threads and the engine thread call it)."""

    def __init__(self, host: HostTier, ssd: SSDTierHandle, shared: SharedSide | None, chunks: Chunks, chunk_size: int,
                 options: ConnectorOptions, stat: Callable[..., None], on_progress: Callable[[], None],
                 *, direct_ssd: bool = False, timing: TransferTiming = AT_ONCE) -> None:
        self.host = host  # LMCache LocalCPUBackend
        self.ssd = ssd
        #: SSD-only chunks are not prefetched into the host tier: the load's stream reads them straight into
        #: device memory (kvikio) instead, never through the host pool
        self.direct_ssd = direct_ssd
        self.shared = shared
        self._chunks = chunks
        self.chunk_size = chunk_size
        self.options = options
        #: when a prefetch starts (at once; tests slow it: `connector/transfer_timing.py`)
        self.timing = timing
        self._stat = stat  # adds to the worker's interval counters
        self._on_progress = on_progress  # a prefetch ended (an idle step's wait wakes on it)
        self._lock = threading.RLock()
        self._pins: dict[str, dict[Any, None]] = {}
        self._retrieve_pins = lmcache_retrieve_pins.for_installed()
        self._prefetch_done: dict[str, PrefetchResult] = {}
        self._prefetching: set[str] = set()
        #: chunk key -> set when the prefetch reading it from SSD has put it into the host tier (or failed): a
        #: second prefetch of the same chunk waits for that read instead of issuing its own
        self._reading: dict[Any, threading.Event] = {}
        self._cancelled: set[str] = set()
        #: request -> the chunks its own prefetch put into the host tier: its load reading them is the SSD tier's
        #: hit, not the host tier's (`after_retrieve` does not report them to the host tier's policy)
        self._staged: dict[str, set[Any]] = {}
        self._prefetch_pool = ThreadPoolExecutor(max_workers=options.prefetch_concurrency,
                                                 thread_name_prefix="kvtier-prefetch")

    def prefetching(self) -> bool:
        """A prefetch is queued or running."""
        return bool(self._prefetching)

    def has_results(self) -> bool:
        """A prefetch ended that no poll has taken yet."""
        return bool(self._prefetch_done)

    def take_results(self, rids: Sequence[str]) -> dict[str, PrefetchResult]:
        """The outcomes of those of `rids`' prefetches that ended (each handed out once)."""
        with self._lock:
            return {rid: self._prefetch_done.pop(rid) for rid in rids if rid in self._prefetch_done}

    def flush(self, timeout: float) -> bool:
        """The SSD tier's queued writes, then the shared tier's, landed within `timeout` seconds (each)."""
        ok = bool(self.ssd.flush(timeout))
        if self.shared is not None:
            ok = bool(self.shared.flush(timeout)) and ok
        return ok

    def stats(self) -> StatsReply:
        return StatsReply(ssd=self.ssd.stats.as_dict(), ssd_chunks=len(self.ssd),
                          host_chunks=len(self.host.hot_cache), ssd_policy=self.ssd.policy_stats(),
                          shared=self.shared.stats() if self.shared is not None else None)

    def _pin(self, rid: str, key: Any) -> bool:
        pins = self._pins.setdefault(rid, {})
        if key in pins:
            return self.host.contains(key)
        if self.host.pin(key):
            pins[key] = None
            return True
        return False

    def lookup(self, rid: str, tokens: list[int], pin: bool = False, first: bool = False, tag: str = ""
               ) -> LookupResult:
        ssd, chunk_bytes = self.ssd, self.ssd.chunk_bytes
        chunks = self._chunks(tokens, tag)

        def locate(chunk: tuple[int, int, Any], in_host_run: bool) -> tuple[str | None, int, int]:
            start, end, key = chunk  # with `pin`, the host run is pinned for the request
            if in_host_run and (self._pin(rid, key) if pin else self.host.contains(key)):
                return HOST, end - start, 0
            if self.host.contains(key):
                return RESIDENT, end - start, 0
            if ssd.contains(key):
                return SSD, end - start, chunk_bytes
            return None, end - start, 0

        with self._lock:
            walk = walk_chunks(chunks, locate)
        res, missing = walk.residency, walk.stop  # missing: the first chunk in neither local tier
        hit_end, remote_tokens = res.hit_end, 0
        if missing is not None and self.shared is not None:  # the network only for what the local tiers lack
            rest = chunks[missing:]
            for start, end, _key in rest[:self.shared.prefix(rid, [k for _, _, k in rest])]:
                remote_tokens += end - start
                hit_end = end
        if first:
            session_signals.request_arrived([k for s, e, k in chunks if e - s == self.chunk_size])
        return LookupResult(res.host_end, hit_end, res.ssd_tokens, res.ssd_bytes, self.chunk_size, remote_tokens,
                            remote_tokens // self.chunk_size * ssd.chunk_bytes)

    def release(self, rid: str) -> None:
        with self._lock:
            for key in self._pins.pop(rid, {}):
                self.host.unpin(key)
            self._prefetch_done.pop(rid, None)
            self._staged.pop(rid, None)
            if self.shared is not None:
                self.shared.forget(rid)
            if rid in self._prefetching:
                self._cancelled.add(rid)  # the prefetch releases its pins when it ends

    def submit_prefetch(self, rid: str, tokens: list[int], tag: str = "") -> None:
        with self._lock:
            self._prefetching.add(rid)
            self._cancelled.discard(rid)
        self._prefetch_pool.submit(self._prefetch, rid, tokens, tag)

    def _prefetch(self, rid: str, tokens: list[int], tag: str = "") -> None:
        t0 = time.monotonic()
        delay = self.timing.prefetch_delay_s(rid)
        if delay > 0:
            time.sleep(delay)
        own: dict[Any, threading.Event] = {}  # chunks this prefetch reads for every prefetch that needs them
        acc: list[Any] = [0, 0, True]  # bytes and tokens put into the host tier, whether every chunk arrived
        try:
            todo, waits, chunks, missing = [], [], self._chunks(tokens, tag), None
            with self._lock:
                for i, (start, end, key) in enumerate(chunks):
                    # Pin what is already in host memory: the chunks this prefetch brings in must not evict it.
                    if self._pin(rid, key):
                        continue
                    landing = self._reading.get(key)
                    if landing is not None:  # another prefetch is reading it: wait for that read, not a second
                        waits.append((start, end, key, landing))
                        continue
                    if not self.ssd.contains(key):
                        missing = i
                        break
                    if self.direct_ssd:  # the load streams it from the SSD straight into device memory
                        continue
                    todo.append((start, end, key))
                    self._reading[key] = own[key] = threading.Event()
            objs = self.ssd.read([k for _, _, k in todo]) if todo else []
            if waits:
                M.PREFETCH_SHARED_CHUNKS.inc(len(waits))
                self._stat(prefetch_shared_chunks=len(waits))
                # our own reads first (above), so two prefetches waiting for each other's chunks cannot deadlock
                self._land(rid, todo, objs, acc)
                with self._lock:
                    self._signal(own)
                todo, objs = [], []
                deadline = t0 + self.options.prefetch_timeout_s
                again = []
                for start, end, key, landing in waits:
                    landing.wait(max(deadline - time.monotonic(), 0.0))
                    with self._lock:
                        if not self._pin(rid, key) and self.ssd.contains(key):
                            again.append((start, end, key))  # that read failed or was evicted: read it here
                if again:
                    todo, objs = again, self.ssd.read([k for _, _, k in again])
            if missing is not None and self.shared is not None and all(o is not None for o in objs):
                rest = chunks[missing:]
                remote = rest[:self.shared.prefix(rid, [k for _, _, k in rest])]
                if remote:  # the chunks only the shared tier holds, after the local ones
                    todo += remote
                    objs += self.shared.read([k for _, _, k in remote])
            self._land(rid, todo, objs, acc)
            with self._lock:
                self._signal(own)
                host_end = 0
                for _, end, key in self._chunks(tokens, tag):
                    if not self._pin(rid, key):
                        break
                    host_end = end
            dt = time.monotonic() - t0
            M.PREFETCH_SECONDS.observe(dt)
            nbytes, ntok, ok = acc
            M.PREFETCH_BYTES.inc(nbytes)
            self._stat(prefetches=1, prefetched_tokens=ntok, prefetch_seconds=dt)
            res = PrefetchResult(ok, host_end, nbytes, dt, "" if ok else "a chunk could not be read (SSD or shared "
                                 "tier)")
        except Exception as e:  # the request then recomputes what is not in host memory
            logger.exception("kvtier: prefetch of %s failed", rid)
            res = PrefetchResult(False, 0, 0, time.monotonic() - t0, f"{type(e).__name__}: {e}")
        with self._lock:
            self._signal(own)
            self._prefetching.discard(rid)
            if rid in self._cancelled:
                self._cancelled.discard(rid)
                self.release(rid)
            else:
                self._prefetch_done[rid] = res
        self._on_progress()

    def _land(self, rid: str, todo: list[tuple[int, int, Any]], objs: list[Any], acc: list[Any]) -> None:
        """Put a prefetch's read chunks into the host tier pinned for `rid`, in order up to the first that did not
        arrive (`acc`: bytes, tokens, all arrived)."""
        with self._lock:
            for (start, end, key), obj in zip(todo, objs):
                if obj is None:
                    acc[2] = False
                    break
                self.host.submit_put_task(key, obj)
                self._pin(rid, key)
                self._staged.setdefault(rid, set()).add(key)
                acc[0] += obj.get_size()
                acc[1] += end - start
            for obj in objs:
                if obj is not None:
                    obj.ref_count_down()

    def _signal(self, own: dict[Any, threading.Event]) -> None:
        """(under self._lock) A prefetch's own reads ended: prefetches waiting for those chunks go on (and read a
        chunk themselves if it did not arrive)."""
        for key, landing in own.items():
            if self._reading.get(key) is landing:
                del self._reading[key]
            landing.set()
        own.clear()

    def after_retrieve(self, rid: str, tokens: list[int], ret: torch.Tensor, skip: int, tag: str = "") -> None:
        """A load of `rid` retrieved `tokens` (`ret`: which arrived; the first `skip` were not asked for) from the
        host tier. The chunks it read are hits for the host tier's eviction policy (`report_host_hits`: LMCache
        tells its policy only on its own pinned lookups, which kvtier's connector does not make), but for those
        `rid`'s own prefetch staged from the SSD (or shared) tier: the policy heard their put, and reading them
        is no reuse of host memory (a put then a hit for every SSD hit made recency look like reuse: adaptive
        followed its LRU expert, docs/results/2026-12-07-replay-engine-gap.md). LMCache <= 0.5.5
        released one pin of each chunk its retrieve returned (`kvtier.compat.lmcache_retrieve_pins`): those are no
        longer this request's to release."""
        try:
            retrieved = [k for start, end, k in self._chunks(tokens, tag)
                         if start >= skip and bool(ret[start:end].all())]
        except Exception:  # then they are released twice: LMCache logs it and clamps the count at 0
            logger.exception("kvtier: cannot tell which chunks the retrieve of %s read", rid)
            return
        with self._lock:
            staged = set(self._staged.get(rid, ()))  # (`release` forgets them)
        report_host_hits(self.host, [k for k in retrieved if k not in staged])
        if not self._retrieve_pins.consumes_pins:
            return
        with self._lock:
            pins = self._pins.get(rid)
            if pins:
                self._pins[rid] = dict.fromkeys(self._retrieve_pins.still_pinned(pins, retrieved))

    def close(self) -> None:
        self._prefetch_pool.shutdown(wait=True, cancel_futures=True)
