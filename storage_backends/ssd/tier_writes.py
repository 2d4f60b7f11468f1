"""The SSD tier's write path (`TierWrites`, a part of `SSDTier`): queueing chunks, the writer threads' batches.

`submit_put(s)` checks each chunk (`_unstorable`) and queues it (`WriteQueue`: back-pressure, duplicates). Each writer
thread takes a batch, reserves its slots (evicting through the policy if the tier is full; a full disk lowers the slot
budget, `_reserve`), journals the evicted chunks' FREE records before their slots are overwritten
(`_journal_victims`), seals the chunks when the tier seals, writes data then header, and appends the batch's COMMIT
records; only then are the chunks in the index and `on_done(True)` called. A chunk that fails is dropped alone and
counted (`TierStats`, `kvtier_ssd_dropped_puts_total`). The journal is compacted once dead records dominate it.
"""

from __future__ import annotations

import errno
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

from kvtier.identity.namespace import KeyNamespace
from kvtier.storage_backends import metrics as M
from kvtier.storage_backends.base import ChunkMeta, TierStats
from kvtier.storage_backends.config import KVTierConfig
from kvtier.storage_backends.ssd import journal
from kvtier.storage_backends.ssd.index import Reservation, SlotIndex
from kvtier.storage_backends.ssd.posix_io import bytes_view
from kvtier.storage_backends.ssd.sealing import ChunkSealer
from kvtier.storage_backends.ssd.slot_format import HEADER_SIZE, CommitRecord, header_fits
from kvtier.storage_backends.ssd.slot_io import SlotIO, SlotWrite
from kvtier.storage_backends.ssd.write_queue import PutTask, Submitted, WriteQueue

__all__ = ["COMPACT_PER_CHUNK", "COMPACT_SLACK", "DISK_FULL_RETRY_S", "TierWrites"]

logger = logging.getLogger(__name__)

#: chunks a writer takes per batch (one fdatasync and one journal append each)
_BATCH = 16
#: after a full disk lowered the slot budget, how often a store tries to grow the files again
DISK_FULL_RETRY_S = 10.0
#: the journal is rewritten once it holds more than COMPACT_PER_CHUNK records per live chunk plus COMPACT_SLACK
#: (defined by the journal, whose reserved room on disk covers that size)
COMPACT_PER_CHUNK, COMPACT_SLACK = journal.COMPACT_PER_CHUNK, journal.COMPACT_SLACK


class TierWrites:
    """The write path of `SSDTier` (which sets these attributes up and starts the writer threads on `_write_loop`)."""

    config: KVTierConfig
    namespace: KeyNamespace
    directory: str
    slot_size: int
    seg: int
    io: SlotIO
    index: SlotIndex
    stats: TierStats
    queue: WriteQueue
    sealer: ChunkSealer | None
    _crypto: ThreadPoolExecutor | None
    _last_io: float
    _disk_full_at: float | None
    _commit_lock: threading.Lock  # journal appends + index commits vs. journal compaction
    _cancel_lock: threading.Lock  # remove() vs. a writer committing the same key
    _reserve_lock: threading.Lock  # slot reservation and file growth

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

