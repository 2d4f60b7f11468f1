"""The simulated SSD of `kvtier simulate`: one device shared by reads and write-back (a fluid model).

- Reads (prefetches into host memory, synchronous reads that stall the GPU) are served one at a time, FIFO.
- Writes (every computed chunk is written through to the SSD tier, as kvtier's inclusive tier does) queue in a
  bounded write buffer (`write_buffer_bytes`, production's `kvtier.max_inflight_write_mb`, 2 GiB by default) and
  drain FIFO. A chunk that does not fit the buffer is dropped from the SSD tier and counted (production first
  waits up to `kvtier.backpressure_timeout_s` for room; the simulator drops at once). A chunk is readable from
  the SSD tier once its write completes.
- Sharing: while a read and writes are both pending, the device gives reads `read_share` of its time (reads at
  `read_share * read_bytes_per_s`, writes at `(1 - read_share) * write_bytes_per_s`); alone, each gets the whole
  device.

`advance(now)` moves the fluid state to `now` and returns what completed, in order; `next_event_time()` is when
the next read or write completes if nothing else arrives. Busy time is accounted per kind (`read_busy_s`,
`write_busy_s`: device-seconds spent on each) and in total (`busy_s`: time with anything pending).
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Hashable
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["SimSSD"]

_EPS_S = 1e-12


class SimSSD:
    def __init__(self, read_bytes_per_s: float, write_bytes_per_s: float, *, read_share: float = 0.5,
                 write_buffer_bytes: int = 2 << 30) -> None:
        if read_bytes_per_s <= 0 or write_bytes_per_s <= 0:
            raise ValueError("SSD bandwidths must be > 0")
        if not 0 < read_share < 1:
            raise ValueError(f"read_share must be in (0, 1), got {read_share}")
        self.read_bps = float(read_bytes_per_s)
        self.write_bps = float(write_bytes_per_s)
        self.read_share = float(read_share)
        self.write_buffer_bytes = int(write_buffer_bytes)
        self.t = 0.0
        self._reads: deque[list[Any]] = deque()  # [job, remaining bytes]
        self._writes: deque[list[Any]] = deque()  # [key, remaining bytes, size]
        self.read_backlog = 0.0  # bytes of queued + in-flight reads not yet transferred
        self.write_backlog = 0.0  # bytes of queued writes not yet transferred
        self.read_busy_s = 0.0
        self.write_busy_s = 0.0
        self.busy_s = 0.0
        self.read_bytes = 0
        self.written_bytes = 0
        self.dropped_writes = 0
        self.dropped_write_bytes = 0

    # --- submissions (call `advance(now)` first) -----------------------------------------------------------------
    def submit_read(self, now: float, job: Any, nbytes: int) -> None:
        self._check(now)
        self._reads.append([job, float(max(nbytes, 0))])
        self.read_backlog += max(nbytes, 0)
        self.read_bytes += max(nbytes, 0)

    def submit_write(self, now: float, key: Hashable, nbytes: int) -> bool:
        """Queue a write; False (dropped, counted) when the write buffer has no room for it."""
        self._check(now)
        if self.write_backlog + nbytes > self.write_buffer_bytes:
            self.dropped_writes += 1
            self.dropped_write_bytes += nbytes
            return False
        self._writes.append([key, float(nbytes), int(nbytes)])
        self.write_backlog += nbytes
        return True

    def _check(self, now: float) -> None:
        if now + 1e-9 < self.t:
            raise RuntimeError(f"SimSSD: time went backwards ({now} < {self.t})")
        if now > self.t + _EPS_S and (self._reads or self._writes):
            raise RuntimeError("SimSSD: advance(now) before submitting")
        self.t = max(self.t, now)

    # --- state ---------------------------------------------------------------------------------------------------
    @property
    def reads_pending(self) -> int:
        return len(self._reads)

    @property
    def writes_pending(self) -> int:
        return len(self._writes)

    def current_read_share(self) -> float:
        """Fraction of the read bandwidth a read gets right now."""
        return self.read_share if self._writes else 1.0

    def _rates(self) -> tuple[float, float]:
        if self._reads and self._writes:
            return self.read_bps * self.read_share, self.write_bps * (1.0 - self.read_share)
        if self._reads:
            return self.read_bps, 0.0
        if self._writes:
            return 0.0, self.write_bps
        return 0.0, 0.0

    def next_event_time(self) -> float | None:
        r, w = self._rates()
        dt = math.inf
        if self._reads:
            dt = min(dt, self._reads[0][1] / r)
        if self._writes:
            dt = min(dt, self._writes[0][1] / w)
        return None if dt == math.inf else self.t + dt

    def advance(self, now: float) -> list[tuple[str, Any]]:
        """Move to `now`; returns ("read", job) and ("write", key) completions in completion order."""
        done: list[tuple[str, Any]] = []
        while self._reads or self._writes:
            r, w = self._rates()
            dt_r = self._reads[0][1] / r if self._reads else math.inf
            dt_w = self._writes[0][1] / w if self._writes else math.inf
            dt = min(dt_r, dt_w)
            if self.t + dt > now + _EPS_S:
                self._progress(max(now - self.t, 0.0), r, w)
                self.t = max(self.t, now)
                return done
            self._progress(dt, r, w)
            self.t += dt
            if self._reads and dt_r <= dt + _EPS_S:
                job, _ = self._reads.popleft()
                done.append(("read", job))
            if self._writes and dt_w <= dt + _EPS_S:
                key, _, size = self._writes.popleft()
                self.written_bytes += size
                done.append(("write", key))
        self.t = max(self.t, now)
        if not self._writes:
            self.write_backlog = 0.0
        if not self._reads:
            self.read_backlog = 0.0
        return done

    def _progress(self, dt: float, r: float, w: float) -> None:
        if dt <= 0:
            return
        both = bool(self._reads) and bool(self._writes)
        if self._reads:
            moved = min(r * dt, self._reads[0][1])
            self._reads[0][1] -= moved
            self.read_backlog -= moved
            self.read_busy_s += dt * (self.read_share if both else 1.0)
        if self._writes:
            moved = min(w * dt, self._writes[0][1])
            self._writes[0][1] -= moved
            self.write_backlog -= moved
            self.write_busy_s += dt * ((1.0 - self.read_share) if both else 1.0)
        self.busy_s += dt
