"""`prepare_slots` (`SlotPreparation`, a part of `SSDTier`): zeroing the slot files up to the capacity while idle.

The preparer thread claims a step of slots at a time and writes zeros into them between the tier's own reads and
writes: it starts only after the tier saw no read or write for `PREPARE_IDLE_S`, and stops between its requests as
soon as one arrives. A full disk or an I/O error ends it (logged once; the tier grows with fallocate as without it).
"""

from __future__ import annotations

import logging
import threading
import time

from kvtier.storage_backends import metrics as M
from kvtier.storage_backends.ssd.index import SlotIndex
from kvtier.storage_backends.ssd.slot_io import SlotIO
from kvtier.storage_backends.ssd.write_queue import WriteQueue

__all__ = ["PREPARE_IDLE_S", "PREPARE_STEP_BYTES", "SlotPreparation"]

logger = logging.getLogger(__name__)

#: `prepare_slots`: zeroing starts only after the tier saw no read or write for this long
PREPARE_IDLE_S = 0.2
#: ... and claims this many bytes of slots at a time (it yields between its 8 MiB requests)
PREPARE_STEP_BYTES = 256 << 20


class SlotPreparation:
    """The slot preparer of `SSDTier` (which sets these attributes up and starts `_prepare_loop` on its thread)."""

    directory: str
    slot_size: int
    io: SlotIO
    index: SlotIndex
    queue: WriteQueue
    prepared_event: threading.Event
    _preparer: threading.Thread | None
    _wake: threading.Event
    _closed: bool
    _reads_active: int
    _last_io: float

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

