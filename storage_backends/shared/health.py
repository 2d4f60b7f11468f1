"""Whether the shared store answers: one state machine per store, plain Python (no LMCache import).

A store is `up` until an operation fails with a connection-level error; it is then `down`: the transition is
logged once (warning, naming the store and the error) and counted, and every caller skips the store (a miss,
so requests recompute or use the local tiers) without waiting on the network. While it is down, at most one
caller every `retry_s` seconds is let through as a probe (`attempt()` says whether to try); the first success
marks it up again and logs the outage's length once (info). Errors while up are counted one by one; errors of
probes are not logged again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)


@dataclass
class HealthCounters:
    errors: int = 0  #: operations that failed at the connection level
    outages: int = 0  #: up -> down transitions
    recoveries: int = 0  #: down -> up transitions
    skipped: int = 0  #: operations not tried because the store was down
    down_seconds: float = 0.0  #: total time of finished outages

    def as_dict(self) -> dict[str, float]:
        return dict(self.__dict__)


@dataclass
class StoreHealth:
    """Up/down state of one store. Thread-safe; `clock` is injectable for tests."""

    name: str
    retry_s: float = 5.0
    clock: Callable[[], float] = time.monotonic
    on_change: Callable[[bool], None] | None = None
    counters: HealthCounters = field(default_factory=HealthCounters)

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._up = True
        self._since = self.clock()
        self._next_probe = 0.0
        self._probing = False

    @property
    def up(self) -> bool:
        return self._up

    def attempt(self) -> bool:
        """Whether a caller should talk to the store now: always while up; while down, one probe per `retry_s`
        (the caller must then report `succeeded()` or `failed()`)."""
        with self._lock:
            if self._up:
                return True
            now = self.clock()
            if not self._probing and now >= self._next_probe:
                self._probing = True
                return True
            self.counters.skipped += 1
            return False

    def succeeded(self) -> None:
        with self._lock:
            self._probing = False
            if self._up:
                return
            now = self.clock()
            self._up = True
            outage = now - self._since
            self._since = now
            self.counters.recoveries += 1
            self.counters.down_seconds += outage
        logger.info("kvtier: shared store %s answers again after %.1f s; it is used again", self.name, outage)
        if self.on_change is not None:
            self.on_change(True)

    def failed(self, error: BaseException | str, op: str = "") -> None:
        with self._lock:
            self.counters.errors += 1
            now = self.clock()
            self._probing = False
            self._next_probe = now + self.retry_s
            if not self._up:
                return
            self._up = False
            self._since = now
            self.counters.outages += 1
        what = f"{type(error).__name__}: {error}" if isinstance(error, BaseException) else str(error)
        logger.warning("kvtier: shared store %s is unreachable%s (%s): its chunks count as misses (recomputed, "
                       "or served by the local tiers) until it answers again; retrying every %.0f s",
                       self.name, f" during {op}" if op else "", what, self.retry_s)
        if self.on_change is not None:
            self.on_change(False)

    def mark_down(self, error: BaseException | str, op: str = "start") -> None:
        """Start in the down state (the store did not answer at start and the user chose to degrade)."""
        self.failed(error, op)
