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

Room for the journal: before growing, `statvfs` tells what is free, and the files never grow into the room
`keep_free(slots)` names (the journal's reserve, `journal.Journal.reserve_bytes`): a step that does not fit shrinks
to what does, and when not even the slot asked for fits, growing fails with ENOSPC before anything is allocated. A
grow that fails anyway (fallocate or zeros meeting a full disk) is cut back to the slots in use (ext4 keeps the blocks
a failed fallocate got), so a file never holds blocks past its allocated slots and its size always matches them; a
file found longer than its whole slots at start (left so by an older version) is cut back the same way.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np

from kvtier.storage_backends.config import ConfigError
from kvtier.storage_backends.ssd.posix_io import NO_ROOM, aligned_buffer, free_bytes, fsync_dir, open_file, pwrite_full

logger = logging.getLogger(__name__)

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
                 o_direct: bool, keep_free: Callable[[int], int] | None = None) -> None:
        """`keep_free(slots)`: bytes the files leave free on their file system once they hold `slots` slots (the
        journal's reserve; none if not given)."""
        self.directory = directory
        self.keep_free = keep_free or (lambda slots: 0)
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
            size = os.fstat(fd).st_size
            self._extent[idx] = size // slot_size
            if size % slot_size:
                logger.info("slot file %s: cutting %d bytes past its last whole slot (a grow that met a full disk)",
                            self.path(idx), size % slot_size)
                self._cut(fd, self._extent[idx])

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
        want = min(want, have + self._room(want - have, pos + 1 - have))
        fd = self._open(idx)
        try:
            self._fallocate(fd, have, want)
        except OSError as e:
            if e.errno not in NO_ROOM or want == pos + 1:
                raise
            self._fallocate(fd, have, pos + 1)  # the step did not fit after all: only the slot asked for
            want = pos + 1
        self._extent[idx] = want

    def _room(self, wanted: int, needed: int) -> int:
        """How many of `wanted` more slots fit in what is free beside the journal's reserve for the slots there
        would then be; OSError(ENOSPC) when fewer than `needed` do."""
        free, base = free_bytes(self.directory), self.allocated_slots()
        lo, hi = 0, wanted  # the most slots k such that k slots and the reserve for base + k slots fit
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if mid * self.slot_size + self.keep_free(base + mid) <= free:
                lo = mid
            else:
                hi = mid - 1
        if lo < needed:
            raise OSError(errno.ENOSPC, f"No space left on device for another slot under {self.directory}: "
                                        f"{free} bytes free, {self.keep_free(base + needed)} of them kept for the "
                                        "journal")
        return lo

    def _fallocate(self, fd: int, have: int, want: int) -> None:
        """Allocate slots [have, want) of the file `fd`; a failure cuts the file back to `have` slots first."""
        try:
            os.posix_fallocate(fd, have * self.slot_size, (want - have) * self.slot_size)
        except OSError:
            self._cut(fd, have)
            raise

    def _cut(self, fd: int, slots: int) -> None:
        """Cut the file back to `slots` whole slots, durably: a failed grow (ext4 keeps the blocks a failed
        fallocate got) or zeros past the last whole slot hold blocks nothing uses, the journal's room among them.
        Never raises: the extent is right either way (logged)."""
        try:
            if os.fstat(fd).st_size > slots * self.slot_size:
                os.ftruncate(fd, slots * self.slot_size)
                os.fsync(fd)
        except OSError as e:
            logger.warning("cannot cut slot file %s back to %d slots (%s); the blocks past them stay allocated "
                           "until the next start", self.fd_paths.get(fd, fd), slots, e)

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
        """Write zeros over the claimed slots in ZERO_PIECE requests while `keep_going()` and while the journal's
        reserve stays free; returns the end of the whole slots written (job.first when none), the file cut back
        to them. Raises OSError (ENOSPC...) after ending the claim, the whole slots written kept."""
        fd: int | None = None
        off = job.first * self.slot_size
        try:
            if self._zeros is None:
                self._zeros = aligned_buffer(ZERO_PIECE)  # fresh anonymous memory: zeros
            fd = self._open(job.file_idx)
            stop = job.end * self.slot_size
            while off < stop and keep_going():
                n = min(ZERO_PIECE, stop - off)
                with self._grow:
                    self._room(-(-n // self.slot_size), -(-n // self.slot_size))
                pwrite_full(fd, self._zeros[:n], off)
                off += n
        except BaseException:
            if fd is not None:
                self._cut(fd, off // self.slot_size)
            self.end_preparation(job, off // self.slot_size)
            raise
        if off % self.slot_size:
            self._cut(fd, off // self.slot_size)  # stopped inside a slot
        return off // self.slot_size

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
