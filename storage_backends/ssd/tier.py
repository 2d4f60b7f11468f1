"""The SSD tier: a persistent, capacity-bounded store of KV chunks in fixed-size slots (engine-agnostic core).

Keys are strings (LMCache's `CacheEngineKey.to_string()`, or the MP adapter's object keys); chunk payloads are host
buffers. The LMCache plugin (`lmcache_backend.py`) and the MP-mode L2 adapter are thin adapters over this class,
which composes three parts the way vLLM's `v1/kv_offload` splits a manager from its workers:
- `ssd_index.SlotIndex` (no I/O): entries, pins, generations, free slots, the eviction policy, journal replay;
- `ssd_io.SlotIO` (bytes only): slot files, segments, O_DIRECT/kvikio, CRCs, durability, the journal;
- `ssd_write_queue.WriteQueue` between them: bounded queued bytes with back-pressure, drained by two writer
  threads here (one's data goes to the disk while the other syncs and commits).

Write path: `submit_put(s)` queues the chunk(s); a writer reserves a slot (evicting through the policy if the tier is
full), writes data then header, `fdatasync`s, appends the COMMIT record to the journal and fsyncs it; only then is
the chunk in the index (visible to readers) and `on_done(True)` called. Read path: header and segments straight
into the destination, verified against key, generation, metadata and CRCs, or a miss (slot freed, counted).
Never wrong KV; nothing raises into the caller once the tier has started; a full disk or failing device is logged
once per episode and counted per chunk.

`namespace` (a KV identity's, `identity.namespace`) qualifies every key the tier stores: callers see their own keys,
chunks of other namespaces are never found, are reported at start and are reclaimed before any chunk of this one.
With `encryption_key_file` chunks are sealed (`ssd/sealing.py`) on the writer threads and opened after their
checksums passed; the secret's id is part of the namespace.
"""

from __future__ import annotations

import errno
import gc
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kvtier.identity.namespace import KeyNamespace, namespace_of
from kvtier.identity.request import digest, tenant_of_key
from kvtier.storage_backends import metrics as M
from kvtier.storage_backends.config import ConfigError, KVTierConfig, load_secret
from kvtier.storage_backends.eviction import EvictionPolicy, make_policy
from kvtier.storage_backends.ssd import journal
from kvtier.storage_backends.ssd.directory import DirectoryInUse, lock_directory, prepare_directory
from kvtier.storage_backends.ssd.index import ChunkMeta, Entry, Reservation, SlotIndex, TierStats
from kvtier.storage_backends.ssd.posix_io import align_up, bytes_view, probe_o_direct
from kvtier.storage_backends.ssd.sealing import ChunkSealer
from kvtier.storage_backends.ssd.slot_format import HEADER_SIZE, CommitRecord, header_fits
from kvtier.storage_backends.ssd.slot_io import SlotIO, SlotRead, SlotWrite
from kvtier.storage_backends.ssd.write_queue import PutTask, Submitted, WriteQueue

__all__ = ["ChunkMeta", "DirectoryInUse", "SSDTier", "TierStats"]

logger = logging.getLogger(__name__)

#: chunks a writer takes per batch (one fdatasync and one journal append each)
_BATCH = 16
#: writer threads: while one syncs and commits its batch, the other's data is already on its way to the disk
_WRITERS = 2
#: after a full disk lowered the slot budget, how often a store tries to grow the files again
DISK_FULL_RETRY_S = 10.0
#: the journal is rewritten once it holds more than COMPACT_PER_CHUNK records per live chunk plus COMPACT_SLACK
#: (defined by the journal, whose reserved room on disk covers that size)
COMPACT_PER_CHUNK, COMPACT_SLACK = journal.COMPACT_PER_CHUNK, journal.COMPACT_SLACK
#: `prepare_slots`: zeroing starts only after the tier saw no read or write for this long
PREPARE_IDLE_S = 0.2
#: ... and claims this many bytes of slots at a time (it yields between its 8 MiB requests)
PREPARE_STEP_BYTES = 256 << 20


class SSDTier:
    def __init__(self, config: KVTierConfig, chunk_bytes: int,
                 layout_ok: Callable[[ChunkMeta], bool] | None = None,
                 policy: EvictionPolicy | None = None, subdir: str = "",
                 max_inflight_bytes: int | None = None, namespace: str = "") -> None:
        self.config = config
        #: AES-GCM sealing of chunk bytes (None: chunks are stored in the clear)
        self.sealer: ChunkSealer | None = None
        if config.encryption_key_file:
            self.sealer = ChunkSealer(load_secret(config.encryption_key_file), tenant_of_key)
            namespace = "m" + digest([namespace, "sealed", self.sealer.key_id])[:20]
        self.namespace = ns = KeyNamespace(namespace)
        #: the chunks of one write batch are sealed, and those of one read opened, side by side
        self._crypto = (ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvtier-ssd-crypto")
                        if self.sealer is not None else None)
        #: bytes queued writes may hold before stores wait: the config's cap, or less where the caller's memory
        #: pool is smaller (the LMCache plugin passes half its host pool)
        self.max_inflight_bytes = min(config.max_inflight_write_mb << 20, max_inflight_bytes or (1 << 62))
        self.slot_size = HEADER_SIZE + align_up(chunk_bytes)
        self.chunk_bytes = chunk_bytes
        max_slots = config.capacity_bytes // self.slot_size
        if max_slots < 1:
            raise ConfigError(
                f"kvtier.ssd_capacity_gb={config.ssd_capacity_gb:g} is smaller than one chunk slot "
                f"({self.slot_size / (1 << 20):.1f} MiB for this model's {chunk_bytes}-byte chunks); raise it"
            )
        self.seg = config.io_block_mb << 20
        self.directory = os.path.join(config.ssd_path, subdir) if subdir else config.ssd_path
        prepare_directory(config.ssd_path)
        if subdir:
            prepare_directory(self.directory)
        self._lock_fd = lock_directory(self.directory)
        self.io: SlotIO | None = None
        try:
            if config.o_direct:
                try:
                    untold = probe_o_direct(self.directory)  # needs no free space: a full disk still starts
                except OSError as e:
                    raise ConfigError(
                        f"kvtier.o_direct: the file system of {self.directory} refuses O_DIRECT ({e.strerror}); "
                        "put kvtier.ssd_path on a real disk, or set kvtier.o_direct: false") from None
                if untold is not None:
                    logger.warning("kvtier.o_direct: cannot check that the file system of %s takes O_DIRECT: %s; "
                                   "starting with O_DIRECT as configured (chunks are dropped and counted while the "
                                   "disk is full)", self.directory, untold)
            self.stats = TierStats()
            try:
                self.io = SlotIO(
                    self.directory, self.slot_size, seg=self.seg, o_direct=config.o_direct,
                    io_threads=config.io_threads, io_engine=config.io_engine, durable=config.durable_writes,
                    read_piece=config.read_piece_mb << 20,
                    slots_per_file=max(1, int(config.file_size_gb * (1 << 30)) // self.slot_size),
                    grow_step_slots=max(1, (config.grow_step_mb << 20) // self.slot_size))
            except OSError as e:
                what = ("is a symbolic link (planted?); kvtier never follows links there: remove it"
                        if e.errno == errno.ELOOP else f"cannot be opened ({e.strerror})")
                raise ConfigError(f"kvtier.ssd_path: {e.filename or self.directory} {what}") from None
            self.index = SlotIndex(max_slots, policy or make_policy(config.eviction_policy),
                                   slot_size=self.slot_size, pin_timeout_s=config.pin_timeout_s,
                                   layout_ok=layout_ok, on_slot_freed=self.io.free, stats=self.stats,
                                   own=ns.owns)
            if ns.name:  # session signals arrive in the adapters' keys
                from kvtier.storage_backends.eviction import session_signals
                from kvtier.storage_backends.ssd.index import _key_string

                session_signals.register(self.index.policy, lambda k: ns.qualify(_key_string(k)), self.index.lock)
            t0 = time.perf_counter()
            # The replay allocates an index entry per chunk: with the cyclic collector on, its passes over a large
            # process heap (an engine's) doubled the time (100k slots: 1.3-1.7 s against 0.6-0.8 s). Nothing the
            # replay builds is cyclic garbage, so the collector waits until it is done.
            collecting = gc.isenabled()
            gc.disable()
            try:
                self._rebuild()
            finally:
                if collecting:
                    gc.enable()
            self.rebuild_seconds = time.perf_counter() - t0
        except BaseException:
            if self.io is not None:
                self.io.close()
            os.close(self._lock_fd)
            raise
        self.io_engine = self.io.engine
        self.policy = self.index.policy
        self.queue = WriteQueue(self.max_inflight_bytes, config.backpressure_timeout_s, self.index.is_stored)
        if self.sealer is not None:  # sealed copies of the queued chunks' bytes, kept for reuse up to that bound
            self.sealer.keep_bytes = self.max_inflight_bytes
        self._disk_full_at: float | None = None
        self._closed = False
        logger.info("SSD tier at %s: %d committed chunks found (index rebuilt in %.3f s), capacity %d slots of "
                    "%.1f MiB, I/O engine %s", self.directory, len(self.index), self.rebuild_seconds, max_slots,
                    self.slot_size / (1 << 20), self.io_engine)
        self._commit_lock = threading.Lock()  # journal appends + index commits vs. journal compaction
        self._cancel_lock = threading.Lock()  # remove() vs. a writer committing the same key
        self._reserve_lock = threading.Lock()  # slot reservation and file growth
        self._writers = [threading.Thread(target=self._write_loop, name=f"kvtier-ssd-writer-{i}", daemon=True)
                         for i in range(_WRITERS)]
        for w in self._writers:
            w.start()
        self._reads_active = 0
        self._activity = threading.Lock()
        self._last_io = time.monotonic()
        self._wake = threading.Event()  # close() ends the preparer's waits
        self.prepared_event = threading.Event()  # set once every slot file holds its share of the capacity
        self._preparer: threading.Thread | None = None
        if config.prepare_slots:
            self._preparer = threading.Thread(target=self._prepare_loop, name="kvtier-ssd-prepare", daemon=True)
            self._preparer.start()

    # ------------------------------------------------------------------ start-up
    def _rebuild(self) -> None:
        load = self.io.load_journal()
        report = self.index.replay(load.records, max_nbytes=self.slot_size - HEADER_SIZE,
                                   unallocated=self.io.files.unallocated)
        self.stats.journal_damaged_records += load.damaged_ranges
        if load.damaged_ranges or report.dropped_invalid or report.stale:
            logger.warning("SSD journal %s: skipped %d damaged byte range(s) (%d bytes), %d record(s) out of range "
                           "(a chunk larger than a slot, or a generation beyond 2^61) and %d stale record(s); the "
                           "records after them were kept (%d chunks)",
                           self.io.journal.path, load.damaged_ranges, load.damaged_bytes, report.dropped_invalid,
                           report.stale, report.chunks)
        if load.tail_cut_bytes:
            logger.info("SSD journal %s: cut a torn tail of %d bytes", self.io.journal.path, load.tail_cut_bytes)
        if report.foreign:
            self._report_foreign()
        if load.damaged_ranges or report.stale or len(load.records) > 2 * report.chunks + 1024:
            try:
                self.io.compact(self.index.live_records())
            except OSError as e:
                logger.warning("SSD journal compaction failed (%s); the journal stays as it is", e)

    def _report_foreign(self) -> None:
        """Log the chunks of other namespaces found at start: their count and size, per namespace."""
        counts: dict[str, list[int]] = {}
        for key in self.index.foreign_keys():
            e = self.index.get(key)
            c = counts.setdefault(namespace_of(key), [0, 0])
            c[0] += 1
            c[1] += e.meta.nbytes if e is not None else 0
        total = sum(c[0] for c in counts.values())
        logger.warning("SSD tier at %s: %d chunk(s) (%.1f MiB) of other KV identities (%s) are not this engine's "
                       "(namespace %s: other weights, config, KV dtype, layout, parallelism or chunk size); they are "
                       "never served and are reclaimed before any chunk of this one", self.directory, total,
                       sum(c[1] for c in counts.values()) / (1 << 20),
                       ", ".join(f"{ns}: {c[0]}" for ns, c in sorted(counts.items())), self.namespace.name or "-")

    def foreign_chunks(self) -> int:
        """Committed chunks of other namespaces still in the tier (reclaimed first)."""
        return len(self.index.foreign_keys())

    def demote(self, keys: Sequence[str]) -> int:
        """Treat these chunks as another identity's from now on (an adapter found them stale): never served again,
        reclaimed first. Returns how many were stored."""
        return self.index.demote([self.namespace.qualify(k) for k in keys])

    # ------------------------------------------------------------------ lookups and pins
    def contains(self, key: str, pin: bool = False) -> bool:
        return self.index.contains(self.namespace.qualify(key), pin)

    def prefix_contains(self, keys: Sequence[str], pin: bool = False, *, request: bool = False) -> int:
        """How many leading keys are stored. `request=True` marks a request's lookup of its whole prefix chain,
        which session-aware policies use to infer conversations (LMCache-only use)."""
        return self.index.prefix_contains([self.namespace.qualify(k) for k in keys], pin, request=request)

    def pin(self, key: str) -> bool:
        return self.index.contains(self.namespace.qualify(key), pin=True)

    def unpin(self, key: str) -> bool:
        return self.index.unpin(self.namespace.qualify(key))

    def is_pinned(self, key: str) -> bool:
        return self.index.is_pinned(self.namespace.qualify(key))

    def exists_in_put_tasks(self, key: str) -> bool:
        return self.queue.is_pending(self.namespace.qualify(key))

    def remove(self, key: str) -> bool:
        """Remove a chunk: the stored copy, and a write of it still queued or in progress (never committed after
        this returns). True if there was either."""
        key = self.namespace.qualify(key)
        with self._cancel_lock:
            cancelled = self.queue.cancel(key)
            return self.index.remove(key) or cancelled

    def entry(self, key: str) -> Entry | None:
        """The index entry of a committed chunk (its slot, generation, metadata), None if not stored."""
        return self.index.get(self.namespace.qualify(key))

    def keys(self) -> list[str]:
        """The keys of this namespace's committed chunks."""
        ns = self.namespace
        return [ns.strip(k) for k in self.index.keys() if ns.owns(k)]

    def __len__(self) -> int:
        return len(self.index)

    def used_bytes(self) -> int:
        return self.index.used_bytes()

    @property
    def max_slots(self) -> int:
        """The slot budget in force (the configured capacity, lower while the disk is full)."""
        return self.index.limit

    def add_drop_listener(self, fn: Callable[[str, int, str], None]) -> None:
        """Call `fn(key, nbytes, reason)` whenever a committed chunk of this namespace leaves the tier (`reason`:
        evicted, removed, corrupt or layout). It runs under the index's lock: keep it short and never block in it."""
        ns = self.namespace

        def own_drops(key: str, nbytes: int, reason: str) -> None:
            if ns.owns(key):
                fn(ns.strip(key), nbytes, reason)

        self.index.add_drop_listener(own_drops)

    # ------------------------------------------------------------------ writes
    def submit_put(self, key: str, meta: ChunkMeta, buf: memoryview, on_done: Callable[[bool], None]) -> bool:
        """Queue a chunk for writing. Returns False (and never calls on_done) when the chunk is not queued:
        already stored or queued, too large for a slot, or dropped after back-pressure timed out."""
        return self.submit_puts([(key, meta, buf, on_done)])[0]

    def submit_puts(self, puts: Sequence[tuple[str, ChunkMeta, memoryview, Callable[[bool], None]]]) -> list[bool]:
        """`submit_put` for several chunks at once (one store of LMCache): the writers see them together."""
        now = time.monotonic()
        tasks: list[PutTask | None] = []
        for key, meta, buf, on_done in puts:
            key = self.namespace.qualify(key)
            buf = bytes_view(buf)
            why = _unstorable(key, meta, buf, self.slot_size - HEADER_SIZE, self.seg)
            if why is not None:
                self._count_drop("invalid" if why.startswith("invalid") else "too_large")
                self.io.episodes.occurred("too_large", logging.WARNING, "chunk %r (%d bytes) is not stored on SSD: "
                                          "%s", key, meta.nbytes, why)
                tasks.append(None)
                continue
            tasks.append(PutTask(key, meta, buf, on_done, now))
        self._last_io = time.monotonic()
        verdicts = iter(self.queue.submit_many([t for t in tasks if t is not None]))
        out = []
        for t in tasks:
            verdict = Submitted.CLOSED if t is None else next(verdicts)
            out.append(verdict is Submitted.QUEUED)
            if verdict is Submitted.QUEUED:
                self.io.episodes.cleared("backpressure", "SSD writes keep up again (no chunk waited past "
                                         "kvtier.backpressure_timeout_s)")
                self.io.episodes.cleared("too_large", "SSD chunks fit their slots again")
            if verdict is Submitted.DUPLICATE:
                with self.index.lock:
                    self.stats.duplicate_puts += 1
            elif verdict is Submitted.BACKPRESSURE:
                self._count_drop("backpressure")
                self.io.episodes.occurred("backpressure", logging.WARNING, "SSD writes cannot keep up: dropping "
                                          "chunks after waiting %.1f s (kvtier.backpressure_timeout_s); counted in "
                                          "kvtier_ssd_dropped_puts_total{reason=backpressure}",
                                          self.config.backpressure_timeout_s)
        M.SSD_INFLIGHT_WRITE_BYTES.set(self.queue.inflight_bytes)
        return out

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued write has committed or failed."""
        return self.queue.flush(timeout)

    def _count_drop(self, reason: str, n: int = 1) -> None:
        with self.index.lock:
            if reason == "no_space":
                self.stats.dropped_no_space += n
            elif reason == "backpressure":
                self.stats.dropped_backpressure += n
            elif reason == "too_large":
                self.stats.dropped_too_large += n
            elif reason == "invalid":
                self.stats.dropped_invalid += n
            elif reason == "shutdown":
                self.stats.dropped_shutdown += n
            else:
                self.stats.dropped_io_error += n
        M.SSD_DROPPED.labels(reason).inc(n)

    def _write_loop(self) -> None:
        while True:
            batch = self.queue.take(_BATCH)
            if not batch:
                return
            try:
                results = self._write_batch(batch)
            except Exception:  # a bug, not an I/O error (those are per chunk): fail the batch, keep serving
                logger.exception("SSD tier writer failed on a batch of %d chunks", len(batch))
                results = [False] * len(batch)
            # Completion callbacks first, then the queue's room: a callback releases the chunk's buffer (the LMCache
            # plugin's ref_count_down), and the queue's byte bound stands for buffers the queued writes hold. Freed
            # the other way round, a store waiting for room got in (and LMCache allocated its next store) while this
            # batch's buffers were still held, so more than the bound was held: with the plugin's cap at half of
            # LMCache's host pool that left no room for a store's last chunk, and LMCache skipped it.
            for t, ok in zip(batch, results):
                if ok:
                    M.SSD_WRITE_SECONDS.observe(time.monotonic() - t.submitted)
                try:
                    t.on_done(ok)
                except Exception:
                    logger.exception("put completion callback failed for %s", t.key)
            self.queue.done(batch)
            M.SSD_INFLIGHT_WRITE_BYTES.set(self.queue.inflight_bytes)
            self._maybe_compact()

    def _write_batch(self, batch: list[PutTask]) -> list[bool]:
        reservations: list[Reservation | None] = []
        held: list[memoryview] = []  # sealing buffers taken for this batch
        settled: set[int] = set()  # reservations committed or given back
        try:
            with self._reserve_lock:
                for t in batch:
                    reservations.append(None if t.cancelled else self._reserve())
            self._log_blocked(batch, reservations)
            if not self._journal_victims(reservations):
                settled.update(range(len(batch)))
                for t in batch:
                    if not t.cancelled:
                        self._count_drop("io_error")
                return [False] * len(batch)
            stored = self._stored_forms(batch, reservations, held)
            writes = [SlotWrite(t.key, r.slot, r.gen, m, b[:m.nbytes])
                      for t, r, (m, b) in zip(batch, reservations, stored) if r is not None and b is not None]
            verdicts = iter(self.io.write(writes))
            reasons = [("cancelled" if t.cancelled else "no_space") if r is None else
                       ("invalid" if b is None else next(verdicts))
                       for t, r, (_m, b) in zip(batch, reservations, stored)]
            commits = [CommitRecord(r.slot, r.gen, t.key, m.nbytes, tuple(m.shape), m.dtype, m.fmt, self.seg, m.extra)
                       for t, r, why, (m, _b) in zip(batch, reservations, reasons, stored)
                       if r is not None and why is None]
            results = [False] * len(batch)
            with self._commit_lock:  # a compaction's snapshot never misses a COMMIT already in the journal
                if commits:
                    try:
                        self.io.commit(commits)
                        self.io.episodes.cleared("journal", "SSD journal appends succeed again")
                    except OSError as e:
                        self.io.episodes.occurred("journal", logging.ERROR, "SSD journal append failed under %s "
                                                  "(%s); chunks are not stored (kvtier_ssd_dropped_puts_total)",
                                                  self.directory, e)
                        with self.index.lock:
                            self.stats.journal_write_errors += 1
                        reasons = ["io_error" if why is None else why for why in reasons]
                for i, (t, r, why) in enumerate(zip(batch, reservations, reasons)):
                    if r is not None and why is None:
                        with self._cancel_lock:  # a remove() of this key either came first or comes after
                            if t.cancelled:
                                continue
                            self.index.commit(t.key, r, stored[i][0], self.seg)
                        settled.add(i)
                        results[i] = True
            for i, (t, r, why) in enumerate(zip(batch, reservations, reasons)):
                if results[i]:
                    continue
                if r is not None:
                    self.index.unreserve(r)
                    settled.add(i)
                if t.cancelled:
                    with self.index.lock:
                        self.stats.cancelled_puts += 1
                else:
                    self._count_drop(why or "io_error")
            return results
        except BaseException:
            for i, r in enumerate(reservations):  # never leak a reserved slot
                if r is not None and i not in settled:
                    self.index.unreserve(r)
            raise
        finally:
            for buf in held:  # the sealed copies were written (or abandoned): their buffers serve the next batch
                self.sealer.give_buffer(buf)  # type: ignore[union-attr]

    def _stored_forms(self, batch: list[PutTask], reservations: list[Reservation | None], held: list[memoryview]
                      ) -> list[tuple[ChunkMeta, memoryview | None]]:
        """What each chunk of a batch is written as (sealed side by side on the crypto threads when the tier seals:
        AES-GCM releases the GIL)."""
        if self._crypto is None or len(batch) < 2:
            return [self._sealed(t, held) if r is not None else (t.meta, t.buf) for t, r in zip(batch, reservations)]
        return list(self._crypto.map(lambda tr: self._sealed(tr[0], held) if tr[1] is not None else
                                     (tr[0].meta, tr[0].buf), zip(batch, reservations)))

    def _sealed(self, t: PutTask, held: list[memoryview]) -> tuple[ChunkMeta, memoryview | None]:
        """What a chunk is stored as: itself, or sealed into a buffer added to `held` (None: sealing failed, the
        chunk is not stored)."""
        if self.sealer is None:
            return t.meta, t.buf
        try:
            buf = self.sealer.take_buffer(t.meta.nbytes)
            held.append(buf)
            return self.sealer.seal(t.key, t.meta, t.buf, buf)
        except Exception:  # noqa: BLE001 - that chunk is not stored, the writer goes on
            logger.exception("SSD tier: sealing chunk %s failed; not stored", t.key)
            return t.meta, None

    def _log_blocked(self, batch: list[PutTask], reservations: list[Reservation | None]) -> None:
        """Chunks that got no slot while the disk is fine: every slot is pinned or being read (logged once per
        episode; a full disk or a failed grow logs its own episode)."""
        if any(r is None and not t.cancelled for t, r in zip(batch, reservations)):
            ep = self.io.episodes
            if not (ep.active("disk-full") or ep.active("grow")):
                ep.occurred("no-slot", logging.WARNING, "SSD tier: no slot for new chunks under %s, every slot is "
                            "pinned or being read; chunks are dropped (kvtier_ssd_dropped_puts_total{reason="
                            "no_space}); raise kvtier.ssd_capacity_gb or lower kvtier.pin_timeout_s",
                            self.directory)
        elif reservations:
            self.io.episodes.cleared("no-slot", "SSD tier: slots are free for new chunks again")

    def _journal_victims(self, reservations: list[Reservation | None]) -> bool:
        """Journal the FREE records of the chunks evicted for these reservations before their slots are
        overwritten. False when the append failed: the evicted chunks are back in the index and every
        reservation has ended (the batch is not written)."""
        frees = self.index.victim_frees(reservations)
        if not frees:
            return True
        try:
            self.io.journal_frees(frees)
        except OSError as e:
            self.index.restore_victims(reservations)
            self.io.episodes.occurred("journal", logging.ERROR, "SSD journal append failed under %s (%s); chunks "
                                      "are not stored (kvtier_ssd_dropped_puts_total)", self.directory, e)
            with self.index.lock:
                self.stats.journal_write_errors += 1
            return False
        self.index.settle_victims(reservations)
        return True

    def _reserve(self) -> Reservation | None:
        """A slot for the next chunk, allocated on disk; on a full disk the budget shrinks to what exists (logged
        once per episode) and is tried again every DISK_FULL_RETRY_S."""
        idx = self.index
        if self._disk_full_at is not None and time.monotonic() - self._disk_full_at >= DISK_FULL_RETRY_S:
            idx.restore_limit()
            self._disk_full_at = None
        while True:
            res = idx.reserve()
            if res is None or self.io.files.is_allocated(res.slot):
                return res
            try:
                self.io.files.ensure(res.slot, limit=idx.capacity)
            except OSError as e:
                if e.errno not in (errno.ENOSPC, errno.EDQUOT):
                    idx.unreserve(res)
                    self.io.episodes.occurred("grow", logging.ERROR, "cannot grow the SSD tier's files under %s "
                                              "(%s)", self.directory, e)
                    return None
                # No room (the files never take the journal's): the slot is given back, or kept out of use if it
                # is a hole below the highest one, and the budget stays at the slots that exist.
                idx.disk_full(res)
                self._disk_full_at = time.monotonic()
                self.io.episodes.occurred("disk-full", logging.ERROR, "disk full under %s: the SSD tier stays at %d "
                                          "slots (%.1f GiB) and evicts within them; the host tier keeps serving; "
                                          "growth is retried every %.0f s", self.directory, idx.limit,
                                          idx.limit * self.slot_size / (1 << 30), DISK_FULL_RETRY_S)
                if idx.limit == 0:
                    return None
                continue
            self.io.episodes.cleared("grow", "the SSD tier's files grow again under %s", self.directory)
            if self._disk_full_at is None:
                self.io.episodes.cleared("disk-full", "the SSD tier's disk has room again under %s",
                                         self.directory)
            return res

    def _maybe_compact(self) -> None:
        """Rewrite the journal as a snapshot once dead records dominate it (under the commit lock, so no COMMIT
        record is on its way from the journal to the index)."""
        if self.io.records_written <= COMPACT_PER_CHUNK * len(self.index) + COMPACT_SLACK:
            return
        try:
            with self._commit_lock:
                if self.io.records_written > COMPACT_PER_CHUNK * len(self.index) + COMPACT_SLACK:
                    self.io.compact(self.index.live_records())
        except OSError as e:
            self.io.episodes.occurred("compact", logging.WARNING, "SSD journal compaction failed (%s); will retry",
                                      e)
            return
        self.io.episodes.cleared("compact", "SSD journal compaction succeeds again")

    # ------------------------------------------------------------------ reads
    def read_batch(self, keys: Sequence[str], alloc: Callable[[str, ChunkMeta], tuple[memoryview, Any] | None],
                   release: Callable[[Any], None]) -> list[Any]:
        """Read chunks into destinations from `alloc(key, meta) -> (buffer, handle)`; returns the handles (None
        for a miss). A chunk that fails any check is released, dropped from the tier and counted. Never raises
        (an `alloc` or `release` that raises makes that chunk a miss)."""
        t0 = time.monotonic()
        self._reading(1)
        asked, keys = keys, [self.namespace.qualify(k) for k in keys]
        entries = self.index.begin_read(keys)
        verdicts: list[str | None] = [None] * len(keys)
        served = [False] * len(keys)
        out: list[Any] = [None] * len(keys)
        try:
            dests: list[tuple[memoryview, Any] | None] = [self._stage(k, e, alloc, release)
                                                          for k, e in zip(asked, entries)]
            todo = [i for i, d in enumerate(dests) if d is not None]
            reads = [SlotRead(keys[i], entries[i].slot, entries[i].gen, entries[i].meta, entries[i].seg,
                              dests[i][0]) for i in todo]  # type: ignore[union-attr,index]
            opening: dict[int, Any] = {}  # sealed chunks are opened as each arrives, while later ones still read

            def open_now(j: int) -> None:
                i = todo[j]
                opening[i] = self._crypto.submit(  # type: ignore[union-attr]
                    self._opened, keys[i], entries[i].meta, dests[i][0])  # type: ignore[index,union-attr]

            results = list(zip(todo, self.io.read(reads, open_now if self._crypto is not None else None)))
            for i, verdict in results:
                if verdict is None:
                    ok = opening[i].result() if i in opening else self._opened(
                        keys[i], entries[i].meta, dests[i][0])  # type: ignore[index,union-attr]
                    verdict = None if ok else "auth"
                verdicts[i] = verdict
                if verdict is None:
                    out[i] = dests[i][1]  # type: ignore[index]
                    served[i] = True
                else:
                    _safe_release(release, dests[i][1])  # type: ignore[index]
        finally:
            self.index.end_read(keys, entries, verdicts, served)
            self._reading(-1)
        M.SSD_READ_SECONDS.observe(time.monotonic() - t0)
        return out

    def _opened(self, key: str, meta: Any, dest: memoryview) -> bool:
        """A chunk read whole: decrypted in place when the tier seals chunks (False: not sealed, or it fails
        authentication); a sealed chunk in a tier without the secret is refused too."""
        sealed = isinstance(meta.extra, dict) and "sealed" in meta.extra
        if self.sealer is None:
            return not sealed
        try:
            return sealed and self.sealer.open(key, meta, dest)
        except Exception:  # noqa: BLE001 - a chunk that cannot be opened is a miss, never an error for the caller
            logger.exception("SSD tier: opening sealed chunk %s failed; treated as a miss", key)
            return False

    @staticmethod
    def _stage(key: str, e: Entry | None, alloc, release) -> tuple[memoryview, Any] | None:
        if e is None:
            return None
        try:
            d = alloc(key, e.meta)
            if d is None:
                return None
            buf = bytes_view(d[0])
            if len(buf) < e.meta.nbytes:
                _safe_release(release, d[1])
                logger.warning("destination of %d bytes for the %d-byte SSD chunk %s; treated as a miss",
                               len(buf), e.meta.nbytes, key)
                return None
            return buf, d[1]
        except Exception:
            logger.exception("cannot stage SSD chunk %s; treated as a miss", key)
            return None

    def read_into_device(self, key: str, dest) -> bool:
        """Read a chunk straight into a GPU tensor through kvikio (GDS or compat mode). The data is verified
        against the slot's checksums before True is returned; False is a miss. Never raises."""
        return self.read_batch_into_device([key], lambda _k, _m: dest)[0]

    @property
    def reads_into_device(self) -> bool:
        """Whether reads can go straight into device memory (`kvtier.io_engine` resolved to kvikio, and chunks are not
        sealed: they are opened in host memory)."""
        return self.io is not None and self.io.device_reads and self.sealer is None

    def read_batch_into_device(self, keys: Sequence[str], dest: Callable[[str, ChunkMeta], Any]) -> list[bool]:
        """Read chunks straight into the device tensors `dest(key, meta)` names (None: not read) through kvikio,
        each verified against its slot's checksums; True where the chunk arrived whole. Never raises."""
        if self.sealer is not None:  # sealed chunks are opened in host memory (`reads_into_device` is False)
            return [False] * len(keys)
        t0 = time.monotonic()
        self._reading(1)
        asked, keys = keys, [self.namespace.qualify(k) for k in keys]
        entries = self.index.begin_read(keys)
        verdicts: list[str | None] = [None] * len(keys)
        served = [False] * len(keys)
        try:
            for i, (key, e) in enumerate(zip(keys, entries)):
                if e is None or self.io is None:
                    continue
                try:
                    d = dest(asked[i], e.meta)
                except Exception:
                    logger.exception("cannot place SSD chunk %s in device memory; treated as a miss", key)
                    d = None
                if d is None:
                    continue
                verdicts[i] = self.io.read_into_device(SlotRead(key, e.slot, e.gen, e.meta, e.seg, memoryview(b"")), d)
                served[i] = verdicts[i] is None
        finally:
            self.index.end_read(keys, entries, verdicts, served)
            self._reading(-1)
        M.SSD_READ_SECONDS.observe(time.monotonic() - t0)
        return served

    # ------------------------------------------------------------------ prepared slots
    def _reading(self, delta: int) -> None:
        with self._activity:
            self._reads_active += delta
            self._last_io = time.monotonic()

    def _idle(self) -> bool:
        return (not self._closed and self._reads_active <= 0 and self.queue.inflight_bytes == 0
                and time.monotonic() - self._last_io >= PREPARE_IDLE_S)

    def _prepare_loop(self) -> None:
        """`prepare_slots`: zero the slot files up to the capacity while the tier is idle, one claimed step at a
        time, stopping between requests as soon as a read or write arrives. A full disk or an I/O error ends it
        (logged once; the tier grows with fallocate as without it)."""
        files = self.io.files
        step = max(1, PREPARE_STEP_BYTES // self.slot_size)
        t0, before, zeroed = time.monotonic(), files.allocated_slots(), 0
        try:
            while True:
                if self._closed:
                    return
                if not self._idle():
                    self._wake.wait(PREPARE_IDLE_S / 2)
                    continue
                job = files.begin_preparation(self.index.capacity, step)
                if job is None:
                    break  # every file holds its share of the capacity
                reached = files.zero_fill(job, self._idle)
                files.end_preparation(job, reached)
                zeroed += reached - job.first
                M.SSD_PREPARED_BYTES.inc((reached - job.first) * self.slot_size)
        except OSError as e:
            logger.warning("SSD tier: preparing slot files under %s stopped after %.1f GiB (%s); new slots are "
                           "fallocated as they are needed", self.directory, zeroed * self.slot_size / (1 << 30), e)
            return
        except Exception:
            logger.exception("SSD tier: preparing slot files failed; new slots are fallocated as they are needed")
            return
        self.prepared_event.set()
        if zeroed:
            logger.info("SSD tier at %s: slot files prepared (%.1f GiB of zeros written in %.0f s while idle; %d "
                        "slots were there before)", self.directory, zeroed * self.slot_size / (1 << 30),
                        time.monotonic() - t0, before)

    def wait_prepared(self, timeout: float | None = None) -> bool:
        """With `prepare_slots`: wait until the slot files hold the whole capacity (True) or `timeout` passes."""
        return self._preparer is not None and self.prepared_event.wait(timeout)

    # ------------------------------------------------------------------ lifecycle
    def close(self, *, drain: bool = True) -> None:
        """Stop the tier. `drain`: every queued write is written first; otherwise the writes no writer holds yet
        are dropped (counted, their `on_done(False)` called) and only the batches being written finish, so that
        once this returns nothing reads the callers' buffers any more (LMCache is about to free its host pool)."""
        if self._closed:
            return
        self._closed = True
        self._wake.set()
        if self._preparer is not None:
            self._preparer.join()
        if drain:
            self.queue.close()
        else:
            dropped = self.queue.abandon()
            if dropped:
                self._count_drop("shutdown", len(dropped))
                logger.warning("SSD tier at %s closing: %d queued chunk(s) not written (their host memory is "
                               "being freed)", self.directory, len(dropped))
            for t in dropped:
                try:
                    t.on_done(False)
                except Exception:
                    logger.exception("put completion callback failed for %s", t.key)
        for w in self._writers:
            w.join()
        if self._crypto is not None:
            self._crypto.shutdown(wait=True)
        self.io.close()
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1


def _unstorable(key: str, meta: ChunkMeta, buf: memoryview, room: int, seg: int) -> str | None:
    """Why a chunk cannot be stored (None: it can): too large for a slot or its header, or invalid (a key that
    is not valid UTF-8, such as a lone surrogate; metadata msgpack cannot encode). Never raises."""
    try:
        key.encode("utf-8")
    except UnicodeEncodeError as e:
        return f"invalid key ({e.reason} at character {e.start})"
    if meta.nbytes > room:
        return f"larger than a {room}-byte slot"
    if len(buf) < meta.nbytes:
        return f"invalid buffer ({len(buf)} bytes for a {meta.nbytes}-byte chunk)"
    try:
        fits = header_fits(key, tuple(meta.shape), meta.dtype, meta.fmt, meta.nbytes, seg, meta.extra)
    except (TypeError, ValueError, OverflowError) as e:
        return f"invalid metadata ({type(e).__name__}: {e})"
    return None if fits else f"its key and shape do not fit the {HEADER_SIZE}-byte slot header"


def _safe_release(release: Callable[[Any], None], handle: Any) -> None:
    try:
        release(handle)
    except Exception:
        logger.exception("releasing a staging buffer failed")
