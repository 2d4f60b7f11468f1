"""The SSD tier: a persistent, capacity-bounded store of KV chunks in fixed-size slots (engine-agnostic core).

Keys are strings (LMCache's `CacheEngineKey.to_string()`, or the MP adapter's object keys); chunk payloads are host
buffers. The LMCache plugin (`lmcache/backend.py`), the MP-mode L2 adapter and vLLM's secondary tier are thin adapters
over this class, through the contract `kvtier.storage_backends.base.ChunkTier`. It composes three parts the way
vLLM's `v1/kv_offload` splits a manager from its workers:
- `index.SlotIndex` (no I/O): entries, pins, generations, free slots, the eviction policy, journal replay;
- `slot_io.SlotIO` (bytes only): slot files, segments, O_DIRECT/kvikio, CRCs, durability, the journal;
- `write_queue.WriteQueue` between them: bounded queued bytes with back-pressure, drained by two writer
  threads here (one's data goes to the disk while the other syncs and commits).
This module opens the tier (directory, O_DIRECT probe, journal replay, foreign namespaces), answers lookups and pins,
and closes it; the write path is `tier_writes.TierWrites`, the read path `tier_reads.TierReads`, and `prepare_slots`
`tier_prepare.SlotPreparation`, each a part of `SSDTier`.

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

from kvtier.identity.namespace import KeyNamespace, namespace_of
from kvtier.identity.request import digest, tenant_of_key
from kvtier.storage_backends.base import ChunkMeta, TierStats
from kvtier.storage_backends.config import ConfigError, KVTierConfig, load_secret
from kvtier.storage_backends.eviction import EvictionPolicy, make_policy
from kvtier.storage_backends.ssd.directory import DirectoryInUse, lock_directory, prepare_directory
from kvtier.storage_backends.ssd.index import Entry, SlotIndex
from kvtier.storage_backends.ssd.posix_io import align_up, probe_o_direct
from kvtier.storage_backends.ssd.sealing import ChunkSealer
from kvtier.storage_backends.ssd.slot_format import HEADER_SIZE
from kvtier.storage_backends.ssd.slot_io import SlotIO
from kvtier.storage_backends.ssd.tier_prepare import SlotPreparation
from kvtier.storage_backends.ssd.tier_reads import TierReads
from kvtier.storage_backends.ssd.tier_writes import TierWrites
from kvtier.storage_backends.ssd.write_queue import WriteQueue

#: `ChunkMeta` and `TierStats` are the shared contracts' (`kvtier.storage_backends.base`), re-exported here
__all__ = ["ChunkMeta", "DirectoryInUse", "SSDTier", "TierStats"]

logger = logging.getLogger(__name__)

#: writer threads: while one syncs and commits its batch, the other's data is already on its way to the disk
_WRITERS = 2


class SSDTier(TierWrites, TierReads, SlotPreparation):
    """The SSD tier (a `kvtier.storage_backends.base.ChunkTier`): opening and recovery, lookups and pins, and the
    lifecycle here; the write path in `tier_writes`, the read path in `tier_reads`, `prepare_slots` in
    `tier_prepare`."""

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
        opened: SlotIO | None = None  # closed again if the start fails
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
                self.io = opened = SlotIO(
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
            if opened is not None:
                opened.close()
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
