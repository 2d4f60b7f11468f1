"""The SSD tier's commit journal: an append-only file of framed COMMIT/FREE records, replayed on start.

Rebuilding the index from the journal reads one small sequential file instead of one header per slot, which
keeps a restart with 100k slots around half a second. A damaged record is skipped and the records after it are
kept (`slot_format.decode_records` resynchronises); only damage with nothing valid after it (a torn tail: a crash in
the middle of an append) is cut off. `compact` rewrites the live state atomically (write, fsync, rename, fsync the
directory). Every file is opened without following symbolic links.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from kvtier.storage_backends.ssd.posix_io import fsync_dir, open_nofollow
from kvtier.storage_backends.ssd.slot_format import JournalRecord, decode_records, encode_record


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

    def load(self) -> JournalLoad:
        size = os.fstat(self._fd).st_size
        data = os.pread(self._fd, size, 0) if size else b""
        dec = decode_records(data)
        cut = len(data) - dec.valid_end
        if cut:
            os.ftruncate(self._fd, dec.valid_end)  # nothing valid follows: a torn (or damaged) tail
        self.records_written = len(dec.records)
        return JournalLoad(dec.records, sum(b - a for a, b in dec.damaged), len(dec.damaged), cut)

    def append(self, records: list[JournalRecord], *, sync: bool) -> None:
        """Append records (one write) and fsync them if `sync`. Raises OSError (ENOSPC...)."""
        if not records:
            return
        data = b"".join(encode_record(r) for r in records)
        done = 0
        while done < len(data):
            done += os.write(self._fd, data[done:])
        self.records_written += len(records)
        if sync:
            os.fsync(self._fd)

    def compact(self, live: list[JournalRecord]) -> None:
        """Replace the journal by `live` atomically. Raises OSError; the old journal then stays as it was."""
        tmp = self.path + ".tmp"
        try:
            os.unlink(tmp)  # a leftover (or a planted link: unlink never follows it)
        except FileNotFoundError:
            pass
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

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
