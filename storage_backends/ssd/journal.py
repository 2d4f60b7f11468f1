"""The SSD tier's commit journal: an append-only file of framed COMMIT/FREE records, replayed on start.

Rebuilding the index from the journal reads one small sequential file instead of one header per slot, which
keeps a restart with 100k slots around half a second. A damaged record is skipped and the records after it are
kept (`slot_format.decode_records` resynchronises); only damage with nothing valid after it (a torn tail: a crash in
the middle of an append) is cut off. `compact` rewrites the live state atomically (write, fsync, rename, fsync the
directory). Every file is opened without following symbolic links.

The journal needs room on the disk it shares with the slot files: `reserve_bytes` is what the slot files leave free
for it (`slot_files.SlotFiles` never grows into it). The tier compacts the journal once it holds more than
COMPACT_PER_CHUNK records per live chunk plus COMPACT_SLACK (`tier._maybe_compact`); up to then it only grows, and a
compaction writes the live records beside it before the rename. Twice the journal's size at that threshold covers
both: 2 x (4 x slots + 10 000) records of at least RECORD_BYTES_GUESS bytes (a COMMIT record of an LMCache key is
about 180), so about 5 MB plus 2 KiB per slot, never less than MIN_RESERVE_BYTES.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvtier.storage_backends.ssd.posix_io import fsync_dir, open_nofollow
from kvtier.storage_backends.ssd.slot_format import JournalRecord, decode_records, encode_record

#: the tier's compaction threshold (`tier.COMPACT_SLACK`, `tier._maybe_compact`), which `reserve_bytes` covers
COMPACT_PER_CHUNK = 4
COMPACT_SLACK = 10_000
#: bytes per record that `reserve_bytes` assumes until it sees larger ones
RECORD_BYTES_GUESS = 256
#: the least room kept free for the journal (and the file system's own metadata)
MIN_RESERVE_BYTES = 4 << 20


@dataclass
class JournalLoad:
    """The journal as found on start."""

    records: list[JournalRecord] = field(default_factory=list)
    damaged_bytes: int = 0  #: bytes skipped between valid records
    damaged_ranges: int = 0
    tail_cut_bytes: int = 0  #: bytes cut from the end (torn tail)


class Journal:
    def __init__(self, path: str) -> None:
        self.path = path
        self._fd = open_nofollow(path, os.O_RDWR | os.O_CREAT | os.O_APPEND)
        self.records_written = 0
        self.record_bytes = RECORD_BYTES_GUESS  #: the largest record seen (at least the guess)

    def load(self) -> JournalLoad:
        size = os.fstat(self._fd).st_size
        data = os.pread(self._fd, size, 0) if size else b""
        dec = decode_records(data)
        cut = len(data) - dec.valid_end
        if cut:
            os.ftruncate(self._fd, dec.valid_end)  # nothing valid follows: a torn (or damaged) tail
        self.records_written = len(dec.records)
        if dec.records:
            self.record_bytes = max(self.record_bytes, -(-dec.valid_end // len(dec.records)))
        return JournalLoad(dec.records, sum(b - a for a, b in dec.damaged), len(dec.damaged), cut)

    def append(self, records: Sequence[JournalRecord], *, sync: bool) -> None:
        """Append records (one write) and fsync them if `sync`. Raises OSError (ENOSPC...)."""
        if not records:
            return
        framed = [encode_record(r) for r in records]
        self.record_bytes = max(self.record_bytes, max(map(len, framed)))
        data = b"".join(framed)
        start = os.fstat(self._fd).st_size
        done = 0
        try:
            while done < len(data):
                done += os.write(self._fd, data[done:])
        except OSError:
            self._cut_back(start)
            raise
        self.records_written += len(records)
        if sync:
            os.fsync(self._fd)

    def compact(self, live: Sequence[JournalRecord]) -> None:
        """Replace the journal by `live` atomically. Raises OSError; the old journal then stays as it was."""
        tmp = self.path + ".tmp"
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)  # a leftover (or a planted link: unlink never follows it)
        fd = open_nofollow(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        try:
            data = b"".join(encode_record(r) for r in live)
            done = 0
            while done < len(data):
                done += os.write(fd, data[done:])
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            os.unlink(tmp)
            raise
        os.close(fd)
        os.replace(tmp, self.path)
        fsync_dir(os.path.dirname(self.path))
        os.close(self._fd)
        self._fd = open_nofollow(self.path, os.O_RDWR | os.O_APPEND)
        self.records_written = len(live)

    def _cut_back(self, size: int) -> None:
        """After an append that wrote part of its records (ENOSPC half-way): cut the journal back to where the
        append began, so the next restart finds whole records only (never raises; a partial record left behind
        is skipped as damage at the next start)."""
        try:
            if os.fstat(self._fd).st_size > size:
                os.ftruncate(self._fd, size)
        except OSError:
            pass

    def reserve_bytes(self, slots: int) -> int:
        """Room to keep free for the journal of a tier of `slots` slots: twice its size at the compaction threshold
        (appends until then, plus the compaction's rewrite beside the old file), at least MIN_RESERVE_BYTES."""
        threshold = (COMPACT_PER_CHUNK * max(0, slots) + COMPACT_SLACK) * self.record_bytes
        return max(MIN_RESERVE_BYTES, 2 * threshold)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
