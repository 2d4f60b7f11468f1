"""The SSD tier: a persistent, capacity-bounded store of KV chunks in fixed-size slots (engine-agnostic core).

Keys are strings (LMCache's `CacheEngineKey.to_string()`); chunk payloads are host buffers (memoryviews). The
LMCache plugin (`lmcache_backend.py`) is a thin adapter over this class.

Write path (off the caller's thread): `submit_put` queues the chunk (bounded by `max_inflight_bytes`, with
back-pressure); the writer thread reserves a slot (evicting through the policy if full), writes data segments in
parallel with one CRC32 each, then the header, `fdatasync`s, appends a COMMIT record to the journal and fsyncs
it; only then is the chunk in the index (visible to readers). Read path: header and data segments are read in
parallel straight into the destination; the header must name the same key, generation, sizes, dtype, format and
every segment's CRC must match, or the chunk is a miss (slot freed, counted). Never wrong KV. CRCs run on their
own threads beside the I/O threads, which go straight on to their next request.
"""

from __future__ import annotations

import collections
import dataclasses
import errno
import fcntl
import heapq
import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Sequence

from kvtier.storage_backends.kvikio_io import KvikioFiles, select_engine
from kvtier.storage_backends.posix_io import (
    ALIGN,
    aligned_buffer,
    is_aligned,
    pread_full,
    preadv_full,
    probe_o_direct,
    pwrite_full,
)
from kvtier.storage_backends import metrics as M
from kvtier.storage_backends import session_signals
from kvtier.storage_backends.config import ConfigError, KVTierConfig
from kvtier.storage_backends.eviction import EvictionPolicy, make_policy
from kvtier.storage_backends.journal import Journal
from kvtier.storage_backends.slot_files import SlotFiles
from kvtier.storage_backends.slot_format import (
    FORMAT_VERSION,
    HEADER_SIZE,
    CommitRecord,
    CorruptSlot,
    FreeRecord,
    SlotHeader,
    checksum,
    decode_header,
    encode_header,
)

logger = logging.getLogger(__name__)

#: threads computing segment checksums beside the I/O threads
_CRC_THREADS = 2


@dataclass(frozen=True)
class ChunkMeta:
    """What the tier records about a chunk besides its bytes."""

    nbytes: int
    shape: tuple[int, ...]
    dtype: str
    fmt: str
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class _Entry:
    slot: int
    gen: int
    meta: ChunkMeta | CommitRecord
    seg: int
    pins: list[float] = field(default_factory=list)  # expiry times
    readers: int = 0
    removed: bool = False


@dataclass
class TierStats:
    """Exact per-tier counters (tests read these; Prometheus gets the same increments)."""

    committed: int = 0
    duplicate_puts: int = 0
    dropped_backpressure: int = 0
    dropped_no_space: int = 0
    dropped_io_error: int = 0
    dropped_too_large: int = 0
    hits: int = 0
    misses: int = 0
    corrupt: int = 0
    layout_mismatch: int = 0
    evictions: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    pins_expired: int = 0

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


@dataclass
class _PutTask:
    key: str
    meta: ChunkMeta
    buf: memoryview
    on_done: Callable[[bool], None]
    submitted: float


class DirectoryInUse(RuntimeError):
    pass


class SSDTier:
    def __init__(self, config: KVTierConfig, chunk_bytes: int,
                 layout_ok: Callable[[ChunkMeta], bool] | None = None,
                 policy: EvictionPolicy | None = None, subdir: str = "",
                 max_inflight_bytes: int | None = None) -> None:
        self.config = config
        #: bytes queued writes may hold before stores wait: the config's cap, or less where the caller's memory
        #: pool is smaller (the LMCache plugin passes half its host pool)
        self.max_inflight_bytes = min(config.max_inflight_write_mb << 20, max_inflight_bytes or (1 << 62))
        self.layout_ok = layout_ok or (lambda meta: True)
        self.slot_size = HEADER_SIZE + _align(chunk_bytes)
        self.chunk_bytes = chunk_bytes
        self.max_slots = config.capacity_bytes // self.slot_size
        if self.max_slots < 1:
            raise ConfigError(
                f"kvtier.ssd_capacity_gb={config.ssd_capacity_gb:g} is smaller than one chunk slot "
                f"({self.slot_size / (1 << 20):.1f} MiB for this model's {chunk_bytes}-byte chunks); raise it"
            )
        self.seg = config.io_block_mb << 20
        self.directory = os.path.join(config.ssd_path, subdir) if subdir else config.ssd_path
        _prepare_directory(config.ssd_path)
        if subdir:
            _prepare_directory(self.directory)
        self._lock_fd = _lock_directory(self.directory)
        if config.o_direct:
            try:
                probe_o_direct(self.directory)
            except OSError as e:
                os.close(self._lock_fd)
                raise ConfigError(
                    f"kvtier.o_direct: the file system of {self.directory} refuses O_DIRECT ({e.strerror}); "
                    "put kvtier.ssd_path on a real disk, or set kvtier.o_direct: false"
                ) from None

        self.policy = policy or make_policy(config.eviction_policy)

        self.stats = TierStats()
        self._lock = threading.RLock()
        session_signals.register(self.policy, _key_string, self._lock)
        self._index: dict[str, _Entry] = {}
        self._slot_owner: dict[int, str] = {}
        self._free: list[int] = []  # heap of free slot numbers below _next_slot
        self._next_slot = 0
        self._gen = 0
        self._pending: dict[str, _PutTask] = {}
        self._queue: collections.deque[_PutTask] = collections.deque()
        self._cond = threading.Condition(self._lock)
        self._inflight_bytes = 0
        self._closed = False
        self._disk_full_logged = False
        self._drop_listeners: list[Callable[[str, int, str], None]] = []

        spf = max(1, int(config.file_size_gb * (1 << 30)) // self.slot_size)
        grow = max(1, (config.grow_step_mb << 20) // self.slot_size)
        self.files = SlotFiles(self.directory, self.slot_size, spf, grow, config.o_direct)
        self._fd_paths = self.files.fd_paths
        self.journal = Journal(os.path.join(self.directory, f"journal-{self.slot_size // 1024}k.log"))
        t0 = time.perf_counter()
        self._rebuild()
        self.rebuild_seconds = time.perf_counter() - t0
        logger.info("SSD tier at %s: %d committed chunks found (index rebuilt in %.3f s), capacity %d slots of "
                    "%.1f MiB", self.directory, len(self._index), self.rebuild_seconds, self.max_slots,
                    self.slot_size / (1 << 20))

        self.io_engine = select_engine(config.io_engine)
        self._kvikio = KvikioFiles(config.io_threads) if self.io_engine == "kvikio" else None
        self._io = ThreadPoolExecutor(max_workers=config.io_threads, thread_name_prefix="kvtier-io")
        # Checksums run beside the I/O threads, not on them: an I/O thread issues its next request while the
        # segment it just read (or is writing) is being checked, so the disk never waits on the CPU.
        self._crc = ThreadPoolExecutor(max_workers=_CRC_THREADS, thread_name_prefix="kvtier-crc")
        self._tls = threading.local()
        self._writer = threading.Thread(target=self._write_loop, name="kvtier-ssd-writer", daemon=True)
        self._writer.start()

    # ------------------------------------------------------------------ index rebuild
    def _rebuild(self) -> None:
        records = self.journal.load()
        index, owner = self._index, self._slot_owner
        for rec in records:
            if type(rec) is CommitRecord:
                old = owner.get(rec.slot)
                if old is not None:
                    del index[old]
                prev = index.pop(rec.key, None)
                if prev is not None:
                    del owner[prev.slot]
                index[rec.key] = _Entry(rec.slot, rec.gen, rec, rec.seg)  # the record doubles as ChunkMeta
                owner[rec.slot] = rec.key
            else:
                key = owner.get(rec.slot)
                if key is not None and index[key].gen == rec.gen:
                    del index[key]
                    del owner[rec.slot]
            if rec.gen > self._gen:
                self._gen = rec.gen
        # Capacity may have shrunk since the last run (or a file was cut short): drop what no longer fits.
        top = max(owner, default=-1)
        if top >= self.max_slots or len(index) > self.max_slots or (top >= 0 and not self.files.is_allocated(top)):
            for key, e in list(index.items()):  # oldest first
                if e.slot >= self.max_slots or len(index) > self.max_slots or not self.files.is_allocated(e.slot):
                    del index[key]
                    del owner[e.slot]
        self._next_slot = max(owner, default=-1) + 1
        self._free = sorted(set(range(self._next_slot)).difference(owner))
        self.policy.set_capacity(self.max_slots)
        for key in index:  # journal order = commit order: oldest first, as LRU wants
            self.policy.on_insert(key, 1)
        if len(records) > 2 * len(index) + 1024:
            self.journal.compact([self._commit_record(k, e) for k, e in index.items()])
        M.SSD_USED_BYTES.set(len(index) * self.slot_size)

    @staticmethod
    def _commit_record(key: str, e: "_Entry") -> CommitRecord:
        m = e.meta
        if type(m) is CommitRecord:
            return m
        return CommitRecord(e.slot, e.gen, key, m.nbytes, m.shape, m.dtype, m.fmt, e.seg, m.extra)

    # ------------------------------------------------------------------ lookups and pins
    def _pinned(self, e: _Entry, now: float) -> bool:
        if e.pins and e.pins[0] <= now:
            alive = [t for t in e.pins if t > now]
            self.stats.pins_expired += len(e.pins) - len(alive)
            e.pins = alive
        return bool(e.pins)

    def _usable(self, key: str) -> _Entry | None:
        e = self._index.get(key)
        if e is None:
            return None
        if not self.layout_ok(e.meta):
            self._drop(key, e, "layout")
            return None
        return e

    def contains(self, key: str, pin: bool = False) -> bool:
        with self._lock:
            e = self._usable(key)
            if e is None:
                return False
            if pin:
                e.pins.append(time.monotonic() + self.config.pin_timeout_s)
            return True

    def prefix_contains(self, keys: Sequence[str], pin: bool = False, *, request: bool = False) -> int:
        """How many leading keys are stored. `request=True` marks a request's lookup of its whole prefix chain,
        which session-aware policies use to infer conversations (LMCache-only use)."""
        with self._lock:
            if request and keys:
                self.policy.on_request(list(keys), time.monotonic())
            n = 0
            for key in keys:
                if not self.contains(key, pin):
                    break
                n += 1
            return n

    def pin(self, key: str) -> bool:
        return self.contains(key, pin=True)

    def unpin(self, key: str) -> bool:
        with self._lock:
            e = self._index.get(key)
            if e is None or not e.pins:
                return False
            e.pins.pop(0)
            return True

    def is_pinned(self, key: str) -> bool:
        with self._lock:
            e = self._index.get(key)
            return e is not None and self._pinned(e, time.monotonic())

    def exists_in_put_tasks(self, key: str) -> bool:
        with self._lock:
            return key in self._pending

    def remove(self, key: str) -> bool:
        with self._lock:
            e = self._index.get(key)
            if e is None:
                return False
            self._drop(key, e, None)
            return True

    def keys(self) -> list[str]:
        with self._lock:
            return list(self._index)

    def add_drop_listener(self, fn: Callable[[str, int, str], None]) -> None:
        """Call `fn(key, nbytes, reason)` whenever a committed chunk leaves the tier (`reason`: evicted, removed,
        corrupt or layout). It runs under the tier's lock: keep it short and never block in it."""
        with self._lock:
            self._drop_listeners.append(fn)

    def __len__(self) -> int:
        return len(self._index)

    def used_bytes(self) -> int:
        return len(self._index) * self.slot_size

    def _drop(self, key: str, e: _Entry, corrupt_reason: str | None, evicted: bool = False) -> None:
        """Remove an entry from the index; its slot is freed now, or when its last reader finishes."""
        if self._index.get(key) is e:
            del self._index[key]
            self.policy.on_remove(key)
            reason = "evicted" if evicted else ("removed" if corrupt_reason is None else
                                                 ("layout" if corrupt_reason == "layout" else "corrupt"))
            for fn in self._drop_listeners:
                try:
                    fn(key, e.meta.nbytes, reason)
                except Exception:
                    logger.exception("SSD tier drop listener failed for %s", key)
        e.removed = True
        if corrupt_reason == "layout":
            self.stats.layout_mismatch += 1
            M.SSD_CORRUPT.labels("layout").inc()
        elif corrupt_reason is not None:
            self.stats.corrupt += 1
            M.SSD_CORRUPT.labels(corrupt_reason).inc()
        if e.readers == 0:
            self._release_slot(e)
        M.SSD_USED_BYTES.set(len(self._index) * self.slot_size)

    def _release_slot(self, e: _Entry) -> None:
        owner = self._slot_owner.get(e.slot)
        if owner is not None and self._index.get(owner) is not e:
            del self._slot_owner[e.slot]
            heapq.heappush(self._free, e.slot)
            self.journal.append([FreeRecord(e.slot, e.gen)], sync=False)

    # ------------------------------------------------------------------ writes
    def submit_put(self, key: str, meta: ChunkMeta, buf: memoryview, on_done: Callable[[bool], None]) -> bool:
        """Queue a chunk for writing. Returns False (and never calls on_done) when the chunk is not queued:
        already stored or queued, too large for a slot, or dropped after back-pressure timed out."""
        buf = _bytes_view(buf)
        if meta.nbytes > self.slot_size - HEADER_SIZE or len(buf) < meta.nbytes:
            with self._lock:
                self.stats.dropped_too_large += 1
            M.SSD_DROPPED.labels("too_large").inc()
            logger.warning("chunk %s of %d bytes does not fit a %d-byte slot; not stored on SSD", key,
                           meta.nbytes, self.slot_size - HEADER_SIZE)
            return False
        deadline = time.monotonic() + self.config.backpressure_timeout_s
        limit = self.max_inflight_bytes
        with self._cond:
            if self._closed:
                return False
            if key in self._index or key in self._pending:
                self.stats.duplicate_puts += 1
                return False
            while self._inflight_bytes and self._inflight_bytes + meta.nbytes > limit:
                left = deadline - time.monotonic()
                if left <= 0 or self._closed:
                    self.stats.dropped_backpressure += 1
                    M.SSD_DROPPED.labels("backpressure").inc()
                    if self.stats.dropped_backpressure == 1:
                        logger.warning("SSD writes cannot keep up: dropped a chunk after waiting %.1f s "
                                       "(kvtier.backpressure_timeout_s); counted in "
                                       "kvtier_ssd_dropped_puts_total{reason=backpressure}",
                                       self.config.backpressure_timeout_s)
                    return False
                self._cond.wait(left)
            task = _PutTask(key, meta, buf, on_done, time.monotonic())
            self._pending[key] = task
            self._queue.append(task)
            self._inflight_bytes += meta.nbytes
            M.SSD_INFLIGHT_WRITE_BYTES.set(self._inflight_bytes)
            self._cond.notify_all()
        return True

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued write has committed or failed."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._pending:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def _write_loop(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    return
                batch = [self._queue.popleft() for _ in range(min(len(self._queue), 16))]
            try:
                self._write_batch(batch)
            except Exception:  # never let the writer die: fail the batch, keep serving
                logger.exception("SSD tier writer failed on a batch of %d chunks", len(batch))
                self._finish(batch, [None] * len(batch), ["io_error"] * len(batch))
            self._maybe_compact()

    def _maybe_compact(self) -> None:
        """Rewrite the journal as a snapshot once dead records dominate it (writer thread, between batches, so
        no COMMIT record is on its way to the index)."""
        with self._lock:
            if self.journal.records_written <= 4 * len(self._index) + 10_000:
                return
            try:
                self.journal.compact([self._commit_record(k, e) for k, e in self._index.items()])
            except OSError as e:
                logger.error("journal compaction failed (%s); will retry", e)

    def _reserve_slot(self) -> int | None:
        """Under the lock: a free slot (allocated on disk), evicting unpinned chunks if the tier is full."""
        if self._free:
            return heapq.heappop(self._free)
        if self._next_slot < self.max_slots:
            slot = self._next_slot
            try:
                self.files.ensure(slot, limit=self.max_slots)
            except OSError as e:
                if e.errno not in (errno.ENOSPC, errno.EDQUOT):
                    raise
                self.max_slots = self.files.allocated_slots() if self.files.is_allocated(slot - 1) else slot
                self.max_slots = max(self.max_slots, len(self._index))
                self.policy.set_capacity(max(1, self.max_slots))
                if not self._disk_full_logged:
                    self._disk_full_logged = True
                    logger.error("disk full under %s: the SSD tier stays at %d slots (%.1f GiB) and evicts "
                                 "within them; the host tier keeps serving", self.directory, self.max_slots,
                                 self.max_slots * self.slot_size / (1 << 30))
                if self.max_slots == 0:
                    return None
                return self._reserve_slot()
            self._next_slot += 1
            return slot
        now = time.monotonic()

        def evictable(k: Hashable) -> bool:
            e = self._index.get(k)  # type: ignore[arg-type]
            return e is not None and e.readers == 0 and not self._pinned(e, now)

        for victim in self.policy.victims(1, evictable):
            e = self._index[victim]  # type: ignore[index]
            self._drop(victim, e, None, evicted=True)  # type: ignore[arg-type]
            self.stats.evictions += 1
            M.SSD_EVICTIONS.inc()
            if self._free:
                return heapq.heappop(self._free)
        return None

    def _write_batch(self, batch: list[_PutTask]) -> None:
        slots: list[int | None] = []
        gens: list[int] = []
        with self._lock:
            for _ in batch:
                try:
                    slot = self._reserve_slot()
                except OSError:
                    logger.exception("cannot allocate an SSD slot")
                    slot = None
                if slot is not None:
                    self._gen += 1
                slots.append(slot)
                gens.append(self._gen)
        # Data segments of every chunk in the batch in parallel; then each header (the slot's last write).
        seg_futures = []
        for t, slot in zip(batch, slots):
            if slot is None:
                seg_futures.append(None)
                continue
            fd, base = self.files.locate(slot)
            data = t.buf[:t.meta.nbytes]
            seg_futures.append([self._io.submit(self._write_segment, fd, base, data, rng)
                                for rng in _segments(t.meta.nbytes, self.seg)])
        hdr_futures = []
        for t, slot, gen, futs in zip(batch, slots, gens, seg_futures):
            if futs is None:
                hdr_futures.append(None)
                continue
            try:
                crcs = tuple(f.result().result() for f in futs)
            except OSError as e:
                logger.error("SSD write failed (%s); chunk %s not stored", e, t.key)
                hdr_futures.append(None)
                continue
            hdr = aligned_buffer(HEADER_SIZE)
            encode_header(SlotHeader(FORMAT_VERSION, t.key, gen, t.meta.nbytes, t.meta.shape, t.meta.dtype,
                                     t.meta.fmt, self.seg, crcs, t.meta.extra), hdr)
            fd, base = self.files.locate(slot)  # type: ignore[arg-type]
            hdr_futures.append(self._io.submit(pwrite_full, fd, hdr, base))
        results: list[int | None] = []
        fds: set[int] = set()
        for t, slot, f in zip(batch, slots, hdr_futures):
            ok = False
            if f is not None:
                try:
                    f.result()
                    ok = True
                    fds.add(self.files.locate(slot)[0])  # type: ignore[arg-type]
                except OSError as e:
                    logger.error("SSD header write failed (%s); chunk %s not stored", e, t.key)
            results.append(slot if ok else None)
            if slot is not None and not ok:
                with self._lock:
                    heapq.heappush(self._free, slot)
        if self.config.durable_writes:
            self.files.sync(fds)
        reasons = ["no_space" if s is None else "io_error" for s in slots]
        self._finish(batch, results, reasons, gens)

    def _finish(self, batch: list[_PutTask], slots: list[int | None], reasons: list[str],
                gens: list[int] | None = None) -> None:
        commits = []
        for t, slot, gen in zip(batch, slots, gens or [0] * len(batch)):
            if slot is not None:
                commits.append(CommitRecord(slot, gen, t.key, t.meta.nbytes, t.meta.shape, t.meta.dtype,
                                            t.meta.fmt, self.seg, t.meta.extra))
        ok_journal = True
        if commits:
            try:
                self.journal.append(commits, sync=self.config.durable_writes)
            except OSError as e:
                logger.error("SSD journal append failed (%s); %d chunks not stored", e, len(commits))
                ok_journal = False
        with self._cond:
            for t, slot, gen, reason in zip(batch, slots, gens or [0] * len(batch), reasons):
                ok = slot is not None and ok_journal
                if ok:
                    self._index[t.key] = _Entry(slot, gen, t.meta, self.seg)
                    self._slot_owner[slot] = t.key
                    self.policy.on_insert(t.key, 1)
                    self.stats.committed += 1
                    self.stats.bytes_written += t.meta.nbytes
                    M.SSD_PUTS.inc()
                    M.SSD_BYTES_WRITTEN.inc(t.meta.nbytes)
                    M.SSD_WRITE_SECONDS.observe(time.monotonic() - t.submitted)
                else:
                    if slot is not None:
                        heapq.heappush(self._free, slot)
                        reason = "io_error"
                    if reason == "no_space":
                        self.stats.dropped_no_space += 1
                    else:
                        self.stats.dropped_io_error += 1
                    M.SSD_DROPPED.labels(reason).inc()
                self._pending.pop(t.key, None)
                self._inflight_bytes -= t.meta.nbytes
                try:
                    t.on_done(ok)
                except Exception:
                    logger.exception("put completion callback failed for %s", t.key)
            M.SSD_INFLIGHT_WRITE_BYTES.set(self._inflight_bytes)
            M.SSD_USED_BYTES.set(len(self._index) * self.slot_size)
            self._cond.notify_all()

    def _bounce(self) -> memoryview:
        b = getattr(self._tls, "buf", None)
        if b is None or len(b) < self.seg + ALIGN:
            b = self._tls.buf = aligned_buffer(self.seg + ALIGN)
        return b

    def _write_segment(self, fd: int, base: int, data: memoryview, rng: tuple[int, int]) -> "Future[int]":
        """Write one data segment; returns the future of its CRC32, computed while the write runs."""
        lo, hi = rng
        part = data[lo:hi]
        crc = self._crc.submit(checksum, part)
        off = base + HEADER_SIZE + lo
        if not self.config.o_direct:
            pwrite_full(fd, part, off)
            return crc
        direct = (hi - lo) // ALIGN * ALIGN if is_aligned(part) else 0
        if direct:
            pwrite_full(fd, part[:direct], off)
        if direct < hi - lo:
            rest = hi - lo - direct
            b = self._bounce()[:_align(rest)]
            b[:rest] = part[direct:]
            b[rest:] = b"\0" * (len(b) - rest)
            pwrite_full(fd, b, off + direct)
        return crc

    # ------------------------------------------------------------------ reads
    def read_batch(self, keys: Sequence[str], alloc: Callable[[str, ChunkMeta], tuple[memoryview, Any] | None],
                   release: Callable[[Any], None]) -> list[Any]:
        """Read chunks into destinations from `alloc(key, meta) -> (buffer, handle)`; returns the handles (None
        for a miss). A chunk that fails any check is released, dropped from the tier and counted."""
        t0 = time.monotonic()
        entries: list[_Entry | None] = []
        with self._lock:
            for key in keys:
                e = self._usable(key)
                if e is not None:
                    e.readers += 1
                entries.append(e)
        dests: list[tuple[memoryview, Any] | None] = []
        for key, e in zip(keys, entries):
            d = None
            if e is not None:
                try:
                    d = alloc(key, e.meta)
                    if d is not None:
                        d = (_bytes_view(d[0]), d[1])
                        if len(d[0]) < e.meta.nbytes:
                            release(d[1])
                            raise ValueError(f"destination of {len(d[0])} bytes for a {e.meta.nbytes}-byte chunk")
                except Exception:
                    logger.exception("cannot stage SSD chunk %s; treated as a miss", key)
                    d = None
            dests.append(d)
        jobs = []  # (entry index, future)
        for i, (key, e, d) in enumerate(zip(keys, entries, dests)):
            if e is None or d is None:
                continue
            fd, base = self.files.locate(e.slot)
            hdr = aligned_buffer(HEADER_SIZE)
            # The header travels with the first data segment (one request), the other segments in parallel.
            parts = [self._io.submit(self._read_segment, fd, base, d[0], rng, hdr if j == 0 else None)
                     for j, rng in enumerate(_segments(e.meta.nbytes, e.seg))]
            jobs.append((i, hdr, parts))
        out: list[Any] = [None] * len(keys)
        verdicts: dict[int, str | None] = {}
        for i, hdr, parts in jobs:
            try:
                crcs = [p.result().result() for p in parts]
                self._verify(keys[i], entries[i], hdr, crcs)  # type: ignore[arg-type]
                verdicts[i] = None
                out[i] = dests[i][1]  # type: ignore[index]
            except (CorruptSlot, EOFError, OSError) as exc:
                verdicts[i] = "torn" if isinstance(exc, EOFError) else ("io_error" if isinstance(exc, OSError)
                                                                        else "checksum")
                logger.warning("SSD chunk %s is unusable (%s); treated as a miss", keys[i], exc)
        for i, d in enumerate(dests):
            if d is not None and out[i] is None:
                release(d[1])
        with self._lock:
            for i, (key, e) in enumerate(zip(keys, entries)):
                if e is None:
                    continue
                e.readers -= 1
                if i in verdicts and verdicts[i] is not None:
                    self._drop(key, e, verdicts[i])
                elif e.removed and e.readers == 0:
                    self._release_slot(e)
                if out[i] is not None:
                    self.stats.hits += 1
                    self.stats.bytes_read += e.meta.nbytes
                    M.SSD_HITS.inc()
                    M.SSD_BYTES_READ.inc(e.meta.nbytes)
                    if not e.removed:
                        self.policy.on_access(key)
            misses = sum(o is None for o in out)
            self.stats.misses += misses
            M.SSD_MISSES.inc(misses)
        M.SSD_READ_SECONDS.observe(time.monotonic() - t0)
        return out

    def _read_segment(self, fd: int, base: int, dest: memoryview, rng: tuple[int, int],
                      hdr: memoryview | None = None) -> "Future[int]":
        """Read one data segment into `dest` (and the slot header just before it, if `hdr` is given); returns
        the future of the segment's CRC32, so this I/O thread can go on to its next request."""
        lo, hi = rng
        part = dest[lo:hi]
        off = base + HEADER_SIZE + lo
        lead = 0  # bytes of the segment read in the same request as the header
        if hdr is not None:
            if self._kvikio is None:
                lead = (hi - lo) if not self.config.o_direct else ((hi - lo) // ALIGN * ALIGN if is_aligned(part)
                                                                    else 0)
            if lead:
                preadv_full(fd, [hdr, part[:lead]], base)
            else:
                pread_full(fd, hdr, base)
        if lead < hi - lo:
            self._read_range(fd, part[lead:], off + lead)
        return self._crc.submit(checksum, part)

    def _read_range(self, fd: int, part: memoryview, off: int) -> None:
        if self._kvikio is not None:
            import numpy as np

            self._kvikio.pread(self._fd_paths[fd], np.frombuffer(part, dtype=np.uint8), len(part), off)
            return
        if not self.config.o_direct:
            pread_full(fd, part, off)
            return
        n = len(part)
        direct = n // ALIGN * ALIGN if is_aligned(part) else 0
        if direct:
            pread_full(fd, part[:direct], off)
        while direct < n:  # unaligned destination or tail: through the bounce buffer
            step = min(n - direct, self.seg)
            b = self._bounce()[:_align(step)]
            pread_full(fd, b, off + direct)
            part[direct:direct + step] = b[:step]
            direct += step

    def read_into_device(self, key: str, dest) -> bool:
        """Read a chunk straight into a GPU tensor through kvikio (GDS or compat mode). The data is verified
        against the slot's checksums (through a host copy) before True is returned; False is a miss."""
        if self._kvikio is None:
            raise RuntimeError("read_into_device needs kvtier.io_engine kvikio (a CUDA machine)")
        with self._lock:
            e = self._usable(key)
            if e is None:
                self.stats.misses += 1
                return False
            e.readers += 1
        verdict = None
        try:
            path, base = self.files.locate_path(e.slot)
            flat = dest.view(-1).view(__import__("torch").uint8)
            if flat.numel() < e.meta.nbytes:
                raise ValueError(f"destination for {key} is smaller than the chunk")
            hdr = aligned_buffer(HEADER_SIZE)
            pread_full(self.files.locate(e.slot)[0], hdr, base)
            self._kvikio.pread(path, flat[:e.meta.nbytes], e.meta.nbytes, base + HEADER_SIZE)
            host = _bytes_view(flat[:e.meta.nbytes].cpu().numpy())
            self._verify(key, e, hdr, [checksum(host[lo:hi]) for lo, hi in _segments(e.meta.nbytes, e.seg)])
        except (CorruptSlot, EOFError, OSError) as exc:
            verdict = "checksum" if isinstance(exc, CorruptSlot) else "torn"
            logger.warning("SSD chunk %s is unusable (%s); treated as a miss", key, exc)
        with self._lock:
            e.readers -= 1
            if verdict is not None:
                self._drop(key, e, verdict)
                self.stats.misses += 1
                return False
            if e.removed and e.readers == 0:
                self._release_slot(e)
            self.stats.hits += 1
            self.stats.bytes_read += e.meta.nbytes
            self.policy.on_access(key)
        return True

    def _verify(self, key: str, e: _Entry, hdr: memoryview, crcs: list[int]) -> None:
        h = decode_header(hdr)
        m = e.meta
        if h.key != key:
            raise CorruptSlot(f"slot {e.slot} holds {h.key!r}, not the requested chunk")
        if h.gen != e.gen:
            raise CorruptSlot(f"slot {e.slot} was overwritten (generation {h.gen}, expected {e.gen})")
        if (h.nbytes, tuple(h.shape), h.dtype, h.fmt, h.seg) != (m.nbytes, m.shape, m.dtype, m.fmt, e.seg):
            raise CorruptSlot(f"slot {e.slot} header disagrees with the index on size/shape/dtype/format")
        if list(h.crcs) != crcs:
            raise CorruptSlot(f"slot {e.slot} data checksum mismatch")

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
        self._writer.join()
        self._io.shutdown(wait=True)
        self._crc.shutdown(wait=True)
        with self._lock:
            self.files.close()
            self.journal.close()
            if self._kvikio is not None:
                self._kvikio.close()
            if self._lock_fd >= 0:
                os.close(self._lock_fd)
                self._lock_fd = -1


def _key_string(key: Any) -> str:
    """LMCache keys -> the tier's string keys (strings pass through)."""
    return key if isinstance(key, str) else key.to_string()


def _bytes_view(buf) -> memoryview:
    """A flat unsigned-byte view of any C-contiguous buffer (ctypes arrays, numpy, mmap...)."""
    mv = memoryview(buf)
    return mv if mv.format == "B" and mv.ndim == 1 else mv.cast("B")


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _segments(nbytes: int, seg: int) -> list[tuple[int, int]]:
    return [(lo, min(lo + seg, nbytes)) for lo in range(0, nbytes, seg)] or [(0, 0)]


def _prepare_directory(path: str) -> None:
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"kvtier.ssd_path: cannot create {path} ({e.strerror}); choose a writable "
                          "directory") from None
    if not os.path.isdir(path):
        raise ConfigError(f"kvtier.ssd_path: {path} exists and is not a directory")
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(f"kvtier.ssd_path: {path} is not writable by this user; fix its permissions or "
                          "choose another directory")


def _lock_directory(path: str) -> int:
    fd = os.open(os.path.join(path, "lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 64, 0).decode(errors="replace").strip()
        os.close(fd)
        raise DirectoryInUse(f"kvtier.ssd_path: {path} is in use by another kvtier process ({holder}); give "
                             "each engine its own directory") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()}".encode(), 0)
    return fd
