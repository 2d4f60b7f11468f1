"""The SSD tier's I/O engine: slot files, segments, O_DIRECT or kvikio, checksums, durability and the journal.

It moves bytes and says whether they are good; it decides nothing about which chunk goes where (`ssd_index`).
- `write`: each chunk's data segments are written in parallel on the I/O threads (O_DIRECT straight from the
  caller's buffer where aligned, else through a per-thread bounce buffer) while their CRC-32s are computed on the
  checksum threads; then the header (key, generation, sizes, dtype, shape, format, CRCs) is written; then every file
  touched is `fdatasync`ed. Only after that may the caller append the chunks' COMMIT records (`commit`, fsync'd).
- `read`: every segment is read in pieces of at most `read_piece` bytes (`kvtier.read_piece_mb`), in parallel
  (as many requests at once as `read_threads` allows), straight into the destination (the header travels with the first
  piece, one request); each piece's CRC-32 is computed by the thread that read it, as soon as it lands, and the
  pieces' CRCs are combined into the segment's, so checking a batch trails its last byte by one piece; the header
  must name the expected key, generation and metadata and every segment's CRC must match, or the read's verdict is
  the reason it failed (never wrong bytes reported as good).
- `free`: FREE records are appended without fsync and never raise (a lost FREE record costs nothing: the slot's
  next COMMIT supersedes it, and a resurrected chunk is still verified on read).
Errors are per chunk: one chunk's failure never fails the others of its batch.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from kvtier.storage_backends.ssd.episodes import EpisodeLog
from kvtier.storage_backends.ssd.index import NOT_READ
from kvtier.storage_backends.ssd.journal import Journal, JournalLoad
from kvtier.storage_backends.ssd.kvikio_io import DeviceReader, KvikioFiles, select_engine
from kvtier.storage_backends.ssd.posix_io import (
    ALIGN,
    align_up,
    aligned_buffer,
    is_aligned,
    pread_full,
    preadv_full,
    pwrite_full,
)
from kvtier.storage_backends.ssd.slot_files import SlotFiles
from kvtier.storage_backends.ssd.slot_format import (
    FORMAT_VERSION,
    HEADER_SIZE,
    CommitRecord,
    CorruptSlot,
    FreeRecord,
    SlotHeader,
    checksum,
    combine_checksums,
    decode_header,
    encode_header,
    pieces,
    segments,
)

logger = logging.getLogger(__name__)

#: threads computing the checksums of written segments beside the I/O threads
_CRC_THREADS = 2
#: small pieces of large blocks queue beyond this many concurrent read requests instead of adding threads
_MAX_READ_THREADS = 64


@dataclass(frozen=True)
class SlotWrite:
    """One chunk to write into a reserved slot."""

    key: str
    slot: int
    gen: int
    meta: Any  # ChunkMeta
    data: memoryview


@dataclass(frozen=True)
class SlotRead:
    """One committed chunk to read into `dest` (at least `meta.nbytes` bytes)."""

    key: str
    slot: int
    gen: int
    meta: Any  # ChunkMeta or CommitRecord
    seg: int
    dest: memoryview


class SlotIO:
    def __init__(self, directory: str, slot_size: int, *, seg: int, o_direct: bool, io_threads: int,
                 io_engine: str, durable: bool, slots_per_file: int, grow_step_slots: int, read_piece: int) -> None:
        self.directory = directory
        self.slot_size = slot_size
        self.seg = seg
        self.o_direct = o_direct
        self.durable = durable
        # The slot files never grow into the room the journal needs (its reserve for a tier of that many slots).
        self.files = SlotFiles(directory, slot_size, slots_per_file, grow_step_slots, o_direct,
                               keep_free=lambda slots: self.journal.reserve_bytes(slots))
        self.journal = Journal(os.path.join(directory, f"journal-{slot_size // 1024}k.log"))
        self.engine = select_engine(io_engine)
        self._kvikio: DeviceReader | None = KvikioFiles(io_threads) if self.engine == "kvikio" else None
        self._io = ThreadPoolExecutor(max_workers=io_threads, thread_name_prefix="kvtier-io")
        # Reads cut each segment into pieces of at most `read_piece` bytes, each its own request, checked as soon
        # as it lands (the checksums of a batch trail its last byte by one piece, not by a whole segment), on as
        # many threads as keep `io_threads` whole segments in flight (twice as many where a chunk is two or more
        # full pieces), at most _MAX_READ_THREADS.
        self.read_piece = min(align_up(max(ALIGN, read_piece)), max(ALIGN, seg))
        self._rd = ThreadPoolExecutor(max_workers=read_threads(io_threads, seg, self.read_piece,
                                                               slot_size - HEADER_SIZE),
                                      thread_name_prefix="kvtier-read")
        # A write's checksums run beside the I/O threads, not on them: an I/O thread issues its next request
        # while the segment it is writing is being checked. A read's piece is checked by the thread that read it
        # (no hand-off, the bytes still in its cache) while the other read threads keep the disk busy.
        self._crc = ThreadPoolExecutor(max_workers=_CRC_THREADS, thread_name_prefix="kvtier-crc")
        self._tls = threading.local()
        self._journal_lock = threading.Lock()
        self.episodes = EpisodeLog(logger)

    # ------------------------------------------------------------------ journal
    def load_journal(self) -> JournalLoad:
        return self.journal.load()

    def commit(self, records: list[CommitRecord]) -> None:
        """Append COMMIT records (fsync'd when writes are durable). Raises OSError: then none counts as stored."""
        with self._journal_lock:
            self.journal.append(records, sync=self.durable)

    def free(self, rec: FreeRecord) -> None:
        """Journal a freed slot. Never raises (see the module docstring)."""
        try:
            with self._journal_lock:
                self.journal.append([rec], sync=False)
        except OSError as e:
            self.episodes.occurred("journal-free", logging.WARNING, "SSD journal: cannot record freed slots "
                                   "(%s); the tier keeps serving, and a restart may find such chunks again "
                                   "(verified before use)", e.strerror)
            return
        self.episodes.cleared("journal-free", "SSD journal: freed slots are recorded again")

    def journal_frees(self, records: list[FreeRecord]) -> None:
        """Journal the slots a batch's reservations took by eviction, before their data is overwritten (no
        fsync: a crash before the COMMIT leaves a header that no longer matches, a miss). Raises OSError: the
        evicted chunks are then still intact and go back into the index."""
        with self._journal_lock:
            self.journal.append(records, sync=False)

    def compact(self, live: list[CommitRecord]) -> None:
        with self._journal_lock:
            self.journal.compact(live)

    @property
    def records_written(self) -> int:
        return self.journal.records_written

    # ------------------------------------------------------------------ writes
    def write(self, items: list[SlotWrite]) -> list[str | None]:
        """Write chunks into their slots; per item None (durable: its COMMIT record may follow) or the reason it
        is not stored (`io_error`, `too_large`). Never raises."""
        out: list[str | None] = [None] * len(items)
        seg_futures: list[list[Future] | None] = []
        for i, it in enumerate(items):
            try:
                fd, base = self.files.locate(it.slot)
                seg_futures.append([self._io.submit(self._write_segment, fd, base, it.data, rng)
                                    for rng in segments(it.meta.nbytes, self.seg)])
            except Exception as e:  # noqa: BLE001 - one chunk's failure is that chunk's
                self._write_failed(it, e)
                out[i] = "io_error"
                seg_futures.append(None)
        hdr_futures: list[Future | None] = []
        for i, (it, futs) in enumerate(zip(items, seg_futures)):
            hdr_futures.append(None)
            if futs is None:
                continue
            try:
                crcs = tuple(f.result().result() for f in futs)
            except Exception as e:  # noqa: BLE001
                self._write_failed(it, e)
                out[i] = "io_error"
                continue
            hdr = aligned_buffer(HEADER_SIZE)
            try:
                m = it.meta
                encode_header(SlotHeader(FORMAT_VERSION, it.key, it.gen, m.nbytes, tuple(m.shape), m.dtype, m.fmt,
                                         self.seg, crcs, m.extra), hdr)
            except (ValueError, TypeError) as e:
                self.episodes.occurred("header", logging.WARNING, "SSD chunk %s: %s; not stored on SSD", it.key, e)
                out[i] = "too_large"
                continue
            fd, base = self.files.locate(it.slot)
            hdr_futures[i] = self._io.submit(pwrite_full, fd, hdr, base)
        fds: dict[int, list[int]] = {}
        for i, (it, f) in enumerate(zip(items, hdr_futures)):
            if f is None:
                continue
            try:
                f.result()
                fds.setdefault(self.files.locate(it.slot)[0], []).append(i)
            except Exception as e:  # noqa: BLE001
                self._write_failed(it, e)
                out[i] = "io_error"
        if self.durable:
            for fd, idxs in fds.items():
                try:
                    self.files.sync(fd)
                except Exception as e:  # noqa: BLE001 - after a failed fdatasync nothing on that file is durable
                    for i in idxs:
                        self._write_failed(items[i], e)
                        out[i] = "io_error"
        if fds and all(out[i] is None for idxs in fds.values() for i in idxs):
            self.episodes.cleared("write", "SSD writes succeed again")
            self.episodes.cleared("header", "SSD slot headers encode again")
        return out

    def _write_failed(self, it: SlotWrite, e: BaseException) -> None:
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            self.episodes.occurred("write", logging.ERROR, "SSD write failed: disk full under %s (%s); chunks are "
                                   "dropped (kvtier_ssd_dropped_puts_total) while the host tier keeps serving",
                                   self.directory, e)
        else:
            self.episodes.occurred("write", logging.ERROR, "SSD write of chunk %s failed (%s: %s); chunks are "
                                   "dropped (kvtier_ssd_dropped_puts_total)", it.key, type(e).__name__, e)

    def _bounce(self, nbytes: int) -> memoryview:
        """This thread's page-aligned staging buffer of at least `nbytes` (rounded up to ALIGN)."""
        b = getattr(self._tls, "buf", None)
        if b is None or len(b) < align_up(nbytes):
            b = self._tls.buf = aligned_buffer(align_up(nbytes))
        return b

    def _write_segment(self, fd: int, base: int, data: memoryview, rng: tuple[int, int]) -> Future[int]:
        """Write one data segment; returns the future of its CRC32, computed while the write runs."""
        lo, hi = rng
        part = data[lo:hi]
        crc = self._crc.submit(checksum, part)
        off = base + HEADER_SIZE + lo
        if not self.o_direct:
            pwrite_full(fd, part, off)
            return crc
        direct = (hi - lo) // ALIGN * ALIGN if is_aligned(part) else 0
        if direct:
            pwrite_full(fd, part[:direct], off)
        if direct < hi - lo:
            rest = hi - lo - direct
            b = self._bounce(rest)[:align_up(rest)]
            b[:rest] = part[direct:]
            b[rest:] = b"\0" * (len(b) - rest)
            pwrite_full(fd, b, off + direct)
        return crc

    # ------------------------------------------------------------------ reads
    def read(self, items: list[SlotRead], on_whole: Callable[[int], None] | None = None) -> list[str | None]:
        """Read and verify chunks; per item None (the destination holds the chunk, bit-exact) or the reason the
        chunk is unusable (`checksum`, `header`, `torn`, `io_error`, or NOT_READ). `on_whole(i)` is called as soon
        as item i is verified, while later items may still be reading (the tier opens sealed chunks there). Never
        raises."""
        jobs: list[tuple[memoryview, list[list[tuple[Future, int]]]] | str] = []
        for it in items:
            try:
                fd, base = self.files.locate(it.slot)
                hdr = aligned_buffer(HEADER_SIZE)
                # Each segment is read as pieces, all in parallel, each checked as soon as it lands; the header
                # travels with the first piece (one request).
                segs = [[(self._rd.submit(self._read_piece, fd, base, it.dest, rng,
                                          hdr if j == 0 and k == 0 else None), rng[1] - rng[0])
                         for k, rng in enumerate(pieces(lo, hi, self.read_piece))]
                        for j, (lo, hi) in enumerate(segments(it.meta.nbytes, it.seg))]
                jobs.append((hdr, segs))
            except Exception as e:  # noqa: BLE001
                jobs.append(_verdict_of(e))
        out: list[str | None] = []
        for it, job in zip(items, jobs):
            if isinstance(job, str):
                out.append(job)
                continue
            hdr, segs = job
            try:
                crcs = [combine_checksums([(p.result(), n) for p, n in seg]) for seg in segs]
                self._verify(it, hdr, crcs)
                out.append(None)
            except Exception as e:  # noqa: BLE001
                out.append(_verdict_of(e))
                logger.warning("SSD chunk %s is unusable (%s); treated as a miss", it.key, e)
                continue
            if on_whole is not None:
                on_whole(len(out) - 1)
        return out

    def _read_piece(self, fd: int, base: int, dest: memoryview, rng: tuple[int, int],
                    hdr: memoryview | None = None) -> int:
        """Read bytes `rng` of the chunk into `dest` (and the slot header just before them, if `hdr` is given);
        returns their CRC32, computed here while the bytes are hot in this core's cache (no hand-off: the other
        read threads keep the disk busy meanwhile)."""
        lo, hi = rng
        part = dest[lo:hi]
        off = base + HEADER_SIZE + lo
        lead = 0  # bytes of the piece read in the same request as the header
        if hdr is not None:
            if self._kvikio is None:
                lead = (hi - lo) if not self.o_direct else ((hi - lo) // ALIGN * ALIGN if is_aligned(part) else 0)
            if lead:
                preadv_full(fd, [hdr, part[:lead]], base)
            else:
                pread_full(fd, hdr, base)
        if lead < hi - lo:
            self._read_range(fd, part[lead:], off + lead)
        return checksum(part)

    def _read_range(self, fd: int, part: memoryview, off: int) -> None:
        if self._kvikio is not None:
            import numpy as np

            self._kvikio.pread(self.files.fd_paths[fd], np.frombuffer(part, dtype=np.uint8), len(part), off)
            return
        if not self.o_direct:
            pread_full(fd, part, off)
            return
        n = len(part)
        direct = n // ALIGN * ALIGN if is_aligned(part) else 0
        if direct:
            pread_full(fd, part[:direct], off)
        while direct < n:  # unaligned destination or tail: through the bounce buffer
            step = min(n - direct, self.seg)
            b = self._bounce(step)[:align_up(step)]
            pread_full(fd, b, off + direct)
            part[direct:direct + step] = b[:step]
            direct += step

    @property
    def device_reads(self) -> bool:
        """Reads can go straight into device memory (kvikio, or a reader set with `set_device_reader`)."""
        return self._kvikio is not None

    def set_device_reader(self, reader: DeviceReader) -> None:
        """Read device destinations with `reader` (kvikio's interface): the host stand-in the CPU tests drive the
        device read path with."""
        if self._kvikio is not None and self._kvikio is not reader:
            self._kvikio.close()
        self._kvikio = reader

    def read_into_device(self, it: SlotRead, dest: Any) -> str | None:
        """Read a chunk straight into a GPU tensor through kvikio (GDS or compat mode), verified against the slot's
        checksums computed on the device (`kvtier.kernels.crc32`: never a host copy of the chunk); None on
        success, else the reason. Never raises."""
        try:
            if self._kvikio is None:
                raise _NotRead("reading into device memory needs kvtier.io_engine kvikio (a CUDA machine)")
            import torch

            from kvtier.kernels.crc32 import segment_crcs

            flat = dest.view(-1).view(torch.uint8)
            if flat.numel() < it.meta.nbytes:
                raise _NotRead(f"the destination ({flat.numel()} bytes) is smaller than the chunk")
            path, base = self.files.locate_path(it.slot)
            hdr = aligned_buffer(HEADER_SIZE)
            pread_full(self.files.locate(it.slot)[0], hdr, base)
            self._kvikio.pread(path, flat[:it.meta.nbytes], it.meta.nbytes, base + HEADER_SIZE)
            # checksummed where the bytes landed (a GPU kernel on a GPU): only 4 bytes a piece reach the host
            self._verify(it, hdr, segment_crcs(flat[:it.meta.nbytes], it.seg))
            return None
        except Exception as e:  # noqa: BLE001
            logger.warning("SSD chunk %s is unusable on device (%s); treated as a miss", it.key, e)
            return _verdict_of(e)

    @staticmethod
    def _verify(it: SlotRead, hdr: memoryview, crcs: list[int]) -> None:
        h = decode_header(hdr)
        m = it.meta
        if h.key != it.key:
            raise CorruptSlot(f"slot {it.slot} holds {h.key!r}, not the requested chunk")
        if h.gen != it.gen:
            raise CorruptSlot(f"slot {it.slot} was overwritten (generation {h.gen}, expected {it.gen})")
        if (h.nbytes, tuple(h.shape), h.dtype, h.fmt, h.seg) != (m.nbytes, tuple(m.shape), m.dtype, m.fmt, it.seg):
            raise CorruptSlot(f"slot {it.slot} header disagrees with the index on size/shape/dtype/format")
        if list(h.crcs) != crcs:
            raise CorruptSlot(f"slot {it.slot} data checksum mismatch", "checksum")

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        self._io.shutdown(wait=True)
        self._rd.shutdown(wait=True)
        self._crc.shutdown(wait=True)
        self.files.close()
        self.journal.close()
        if self._kvikio is not None:
            self._kvikio.close()


def read_threads(io_threads: int, seg: int, piece: int, chunk_bytes: int) -> int:
    """Read requests in flight at once: `io_threads` whole segments' pieces, doubled where a chunk is read as
    two or more full pieces, at most _MAX_READ_THREADS. A thread checksums its piece before it takes the next, and
    with large pieces that left the disk's queue short while the checksums ran (32 MiB chunks, 8 MiB pieces,
    2 busy threads: 0.93-0.97x raw O_DIRECT with 16 requests in flight, 0.99-1.04x with 32); chunks of one piece
    (2-4 MiB) read slower with twice the requests in 17 of 18 paired runs
    (docs/results/2026-12-06-read-requests-in-flight.md)."""
    blocks = io_threads * (2 if chunk_bytes // piece >= 2 else 1)
    return min(_MAX_READ_THREADS, blocks * -(-seg // piece))


class _NotRead(Exception):
    """The chunk was not read (the caller's destination or engine cannot take it): a miss, the slot is fine."""


def _verdict_of(e: BaseException) -> str:
    """The metric label of a failed read (NOT_READ: nothing is wrong with the slot)."""
    if isinstance(e, _NotRead):
        return NOT_READ
    if isinstance(e, CorruptSlot):
        return e.reason
    if isinstance(e, EOFError):
        return "torn"
    if isinstance(e, OSError):
        return "io_error"
    return "io_error"

