"""The SSD tier's slot files: a few large files of fixed-size slots that grow in steps as slots are used.

Slot `s` lives in file `s // slots_per_file` at offset `(s % slots_per_file) * slot_size`. Files are extended with
`posix_fallocate` one step at a time (never the whole capacity up front), so a full disk shows up as ENOSPC when
growing, before any data is written. File names come from the slot size and an index, never from keys, and files
are opened without following symbolic links: a link planted in the directory stops the start with a clear error.

Prepared slots (`kvtier.prepare_slots`): a background caller may instead grow a file by writing zeros
(`begin_preparation` / `zero_fill` / `end_preparation`), so that later chunk writes overwrite written blocks rather
than fill unwritten extents, which file systems complete more slowly (ext4 converts each extent as the write ends and
the fdatasync then commits that). While a range is being zeroed it is not allocated: `ensure` on that file waits
until the range is done, so a chunk is never written where zeros are still on their way.
"""

from __future__ import annotations

import os
import stat
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np

from kvtier.storage_backends.config import ConfigError
from kvtier.storage_backends.ssd.posix_io import aligned_buffer, fsync_dir, open_file, pwrite_full

#: More slot files than this per slot size would mean an absurd capacity (16 GiB files: 16 EiB); names beyond it
#: are not kvtier's.
MAX_FILES = 1 << 20
#: zeros are written in requests of this size; between two requests the preparer checks whether it must yield
ZERO_PIECE = 8 << 20


@dataclass(frozen=True)
class Preparation:
    """Slots [first, end) of slot file `file_idx`, past its allocated extent, being zeroed."""

    file_idx: int
    first: int
    end: int


class SlotFiles:
    def __init__(self, directory: str, slot_size: int, slots_per_file: int, grow_step_slots: int,
                 o_direct: bool) -> None:
        self.directory = directory
        self.slot_size = slot_size
        self.slots_per_file = slots_per_file
        self.grow_step_slots = max(1, grow_step_slots)
        self.o_direct = o_direct
        self._fds: dict[int, int] = {}
        self.fd_paths: dict[int, str] = {}  # fd -> path (kvikio opens files by path)
        self._extent: dict[int, int] = {}  # file index -> slots allocated on disk
        self._grow = threading.Condition()  # guards _extent changes and _preparing
        self._preparing: Preparation | None = None
        self._zeros: memoryview | None = None
        prefix = self._prefix()
        for name in os.listdir(directory):
            if not (name.startswith(prefix) and name.endswith(".dat")):
                continue
            digits = name[len(prefix):-4]
            if not (digits.isdigit() and int(digits) < MAX_FILES and name == os.path.basename(self.path(int(digits)))):
                continue  # not a name this tier writes
            idx = int(digits)
            st = os.lstat(self.path(idx))
            if not stat.S_ISREG(st.st_mode):
                raise ConfigError(f"kvtier.ssd_path: {self.path(idx)} is not a regular file (a symbolic link or "
                                  "something planted?); kvtier never follows links there: remove it")
            fd = self._open(idx)
            self._extent[idx] = os.fstat(fd).st_size // slot_size

    def _prefix(self) -> str:
        return f"slots-{self.slot_size // 1024}k-"

    def path(self, file_idx: int) -> str:
        return os.path.join(self.directory, f"{self._prefix()}{file_idx:04d}.dat")

    def _open(self, idx: int) -> int:
        fd = self._fds.get(idx)
        if fd is None:
            if not 0 <= idx < MAX_FILES:
                raise ValueError(f"slot file index {idx} out of range")
            existed = os.path.lexists(self.path(idx))
            fd = open_file(self.path(idx), o_direct=self.o_direct)
            self._fds[idx] = fd
            self.fd_paths[fd] = self.path(idx)
            if not existed:  # make the new file's directory entry durable before any commit refers to it
                fsync_dir(self.directory)
        return fd

    def allocated_slots(self) -> int:
        return sum(self._extent.values())

    def _split(self, slot: int) -> tuple[int, int]:
        if slot < 0:
            raise ValueError(f"negative slot {slot}")
        return divmod(slot, self.slots_per_file)

    def locate(self, slot: int) -> tuple[int, int]:
        """(fd, byte offset) of a slot; the slot must be within the allocated extent for writes."""
        idx, pos = self._split(slot)
        return self._open(idx), pos * self.slot_size

    def locate_path(self, slot: int) -> tuple[str, int]:
        idx, pos = self._split(slot)
        return self.path(idx), pos * self.slot_size

    def is_allocated(self, slot: int) -> bool:
        idx, pos = self._split(slot)
        return pos < self._extent.get(idx, 0)

    def unallocated(self, slots: Iterable[int]) -> set[int]:
        """The slots among `slots` that are not allocated on disk (negative ones included), in one numpy pass: a
        restart checks 100k slots in a few ms, not the quarter second of `is_allocated` per slot."""
        arr = np.fromiter(slots, dtype=np.int64)
        if not len(arr):
            return set()
        idx, pos = np.divmod(arr, self.slots_per_file)  # a negative slot gets a negative file index
        extent = np.zeros(max(int(idx.max()), 0) + 1, dtype=np.int64)
        for i, n in self._extent.items():
            if i < len(extent):
                extent[i] = n
        bad = (idx < 0) | (pos >= extent[np.maximum(idx, 0)])
        return set(arr[bad].tolist())

    def ensure(self, slot: int, limit: int | None = None) -> None:
        """Grow the slot's file (by whole steps, never past slot `limit - 1`, the tier's capacity) so that the
        slot exists on disk. Raises OSError (ENOSPC...)."""
        idx, pos = self._split(slot)
        if pos < self._extent.get(idx, 0):
            return
        with self._grow:
            while self._preparing is not None and self._preparing.file_idx == idx:
                self._grow.wait()  # zeros are being written past this file's extent: never fallocate under them
            self._grow_file(idx, pos, limit)

    def _grow_file(self, idx: int, pos: int, limit: int | None) -> None:
        have = self._extent.get(idx, 0)
        if pos < have:
            return
        want = min(self.slots_per_file, max(pos + 1, have + self.grow_step_slots))
        if limit is not None:
            want = max(pos + 1, min(want, limit - idx * self.slots_per_file))
        fd = self._open(idx)
        os.posix_fallocate(fd, have * self.slot_size, (want - have) * self.slot_size)
        self._extent[idx] = want

    # ------------------------------------------------------------------ prepared slots
    def begin_preparation(self, limit: int, step_slots: int) -> Preparation | None:
        """Claim the next slots to zero: past the allocated extent of the first file not yet grown to its share of
        the `limit` slots, at most `step_slots` of them. None when every file holds its share."""
        with self._grow:
            if self._preparing is not None:
                return None
            for idx in range(-(-limit // self.slots_per_file)):
                share = min(self.slots_per_file, limit - idx * self.slots_per_file)
                have = self._extent.get(idx, 0)
                if have < share:
                    self._preparing = Preparation(idx, have, min(share, have + max(1, step_slots)))
                    return self._preparing
            return None

    def zero_fill(self, job: Preparation, keep_going: Callable[[], bool]) -> int:
        """Write zeros over the claimed slots in ZERO_PIECE requests while `keep_going()`; returns the end of the
        whole slots written (job.first when none). Raises OSError (ENOSPC...) after ending the claim."""
        try:
            if self._zeros is None:
                self._zeros = aligned_buffer(ZERO_PIECE)  # fresh anonymous memory: zeros
            fd = self._open(job.file_idx)
            off, stop = job.first * self.slot_size, job.end * self.slot_size
            while off < stop and keep_going():
                n = min(ZERO_PIECE, stop - off)
                pwrite_full(fd, self._zeros[:n], off)
                off += n
            return off // self.slot_size
        except BaseException:
            self.end_preparation(job, job.first)
            raise

    def end_preparation(self, job: Preparation, reached: int) -> None:
        """Slots [job.first, reached) are zeroed and become allocated; the claim ends (waiting growers go on)."""
        with self._grow:
            if self._preparing is job:
                self._preparing = None
                if reached > self._extent.get(job.file_idx, 0):
                    self._extent[job.file_idx] = reached
                self._grow.notify_all()

    def sync(self, fd: int) -> None:
        os.fdatasync(fd)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
