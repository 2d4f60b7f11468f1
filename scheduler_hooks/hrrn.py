"""Disk-HRRN: the order in which SSD reads of waiting requests are issued (Bidaw's preparing queue).

Highest response ratio next, with the ratio of a waiting request defined as

    ratio = 1 + waiting_time / kv_size        (waiting_time in seconds, kv_size in `byte_unit`s, default GiB)

Small reads go first (a host-memory-sized read should not wait behind a 10 GB one) and waiting time grows every
ratio, so a large read is eventually issued. The `1 +` and the units do not change the order between two requests
(it is the order of waiting_time / kv_size); they only make the number readable. Ties: smaller read first, then
earlier arrival, then insertion order.

Because ratios of different requests grow at different rates, the order changes over time: there is no static heap
order, and `peek` scans the queue (O(n); about 0.1 ms for 1,000 entries in CPython). The scheduler's preparing
queue (`DualQueuePolicy`) and the connector's SSD prefetcher use this same object. Plain Python.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass

logger = logging.getLogger(__name__)

__all__ = ["DiskHRRNQueue", "HRRNEntry", "response_ratio"]

GiB = 1 << 30


def response_ratio(now: float, arrival: float, nbytes: int, byte_unit: int = GiB) -> float:
    """1 + waiting time / size; a request that has not arrived yet (clock skew) counts zero waiting."""
    size = max(int(nbytes), 1) / byte_unit
    return 1.0 + max(0.0, now - arrival) / size


@dataclass(frozen=True, slots=True)
class HRRNEntry:
    """One queued read: which request, when it arrived, how many bytes it must read."""

    request_id: str
    arrival: float
    nbytes: int
    seq: int


class DiskHRRNQueue:
    """Requests waiting for an SSD read, served highest response ratio first.

    `starve_after_s`, when given to `peek`/`pop`/`ordered`, puts every entry that has waited longer than that in
    front, oldest first (the policy's starvation bound), before the HRRN order of the others.
    """

    def __init__(self, byte_unit: int = GiB) -> None:
        if byte_unit <= 0:
            raise ValueError("byte_unit must be > 0")
        self.byte_unit = byte_unit
        self._entries: dict[str, HRRNEntry] = {}
        self._seq = 0

    # --- content -------------------------------------------------------------------------------------------------
    def push(self, request_id: str, arrival: float, nbytes: int) -> None:
        """Queue a read, or update the size of an already queued one (its position in time is kept)."""
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        old = self._entries.get(request_id)
        if old is not None:
            self._entries[request_id] = HRRNEntry(request_id, old.arrival, int(nbytes), old.seq)
            return
        self._seq += 1
        self._entries[request_id] = HRRNEntry(request_id, float(arrival), int(nbytes), self._seq)

    def remove(self, request_id: str) -> bool:
        return self._entries.pop(request_id, None) is not None

    def get(self, request_id: str) -> HRRNEntry | None:
        return self._entries.get(request_id)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._entries

    def __iter__(self) -> Iterator[HRRNEntry]:
        return iter(list(self._entries.values()))

    def ids(self) -> list[str]:
        """Queued request ids, in insertion order (no ratio arithmetic)."""
        return list(self._entries)

    def ratio(self, request_id: str, now: float) -> float:
        e = self._entries[request_id]
        return response_ratio(now, e.arrival, e.nbytes, self.byte_unit)

    # --- order ---------------------------------------------------------------------------------------------------
    def peek(
        self,
        now: float,
        eligible: Callable[[str], bool] | None = None,
        starve_after_s: float | None = None,
    ) -> str | None:
        """The request whose read should be issued next (not removed), or None."""
        best: HRRNEntry | None = None
        best_key = 0.0
        oldest: HRRNEntry | None = None
        starve_cut = None if starve_after_s is None else now - starve_after_s
        for e in self._entries.values():
            if eligible is not None and not eligible(e.request_id):
                continue
            if starve_cut is not None and e.arrival < starve_cut:
                if oldest is None or (e.arrival, e.seq) < (oldest.arrival, oldest.seq):
                    oldest = e
                continue
            if oldest is not None:
                continue  # a starving entry wins anyway: skip the ratio arithmetic
            # order of (now - arrival) / nbytes == order of the response ratio
            key = max(0.0, now - e.arrival) / max(e.nbytes, 1)
            if best is None or key > best_key or (key == best_key and _tiebreak(e, best)):
                best, best_key = e, key
        if oldest is not None:
            return oldest.request_id
        return None if best is None else best.request_id

    def pop(
        self,
        now: float,
        eligible: Callable[[str], bool] | None = None,
        starve_after_s: float | None = None,
    ) -> str | None:
        rid = self.peek(now, eligible, starve_after_s)
        if rid is not None:
            del self._entries[rid]
        return rid

    def ordered(self, now: float, starve_after_s: float | None = None) -> list[str]:
        """All queued request ids in service order at time `now` (starving first, then highest ratio)."""
        starve_cut = None if starve_after_s is None else now - starve_after_s
        starving = sorted(
            (e for e in self._entries.values() if starve_cut is not None and e.arrival < starve_cut),
            key=lambda e: (e.arrival, e.seq),
        )
        taken = {e.request_id for e in starving}
        rest = sorted(
            (e for e in self._entries.values() if e.request_id not in taken),
            key=lambda e: (-(max(0.0, now - e.arrival) / max(e.nbytes, 1)), e.nbytes, e.arrival, e.seq),
        )
        return [e.request_id for e in starving] + [e.request_id for e in rest]


def _tiebreak(a: HRRNEntry, b: HRRNEntry) -> bool:
    """True if `a` goes before `b` at equal ratio."""
    return (a.nbytes, a.arrival, a.seq) < (b.nbytes, b.arrival, b.seq)
