"""Log a recurring condition once per episode: when it starts and when it clears, never once per occurrence.

A full disk or a failing device can drop thousands of chunks; each drop is counted in a metric, while the log says
once that it started (naming the setting or the fix) and once that it is over, with the count in between. An episode
is over only once operations have succeeded for SETTLE_S seconds after its last occurrence: a disk that is nearly full
lets an append through now and then (a block freed by a cut-back), and without the settling time one outage would be
logged as several.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

#: seconds without a new occurrence before a success ends an episode
SETTLE_S = 5.0


class EpisodeLog:
    def __init__(self, logger: logging.Logger, clock: Callable[[], float] = time.monotonic) -> None:
        self._logger = logger
        self._clock = clock
        self._active: dict[str, int] = {}
        self._last: dict[str, float] = {}  # kind -> time of its last occurrence
        self._lock = threading.Lock()

    def occurred(self, kind: str, level: int, msg: str, *args) -> None:
        """One more occurrence of `kind`; logs `msg` only if no episode of `kind` is under way."""
        with self._lock:
            n = self._active.get(kind, 0)
            self._active[kind] = n + 1
            self._last[kind] = self._clock()
        if n == 0:
            self._logger.log(level, "%s (further occurrences are counted, not logged, until this clears)",
                             msg % args if args else msg)

    def cleared(self, kind: str, msg: str, *args) -> None:
        """An operation of `kind` succeeded; ends the episode under way (logging `msg` once) if its last
        occurrence is SETTLE_S or more ago."""
        with self._lock:
            n = self._active.get(kind, 0)
            if not n or self._clock() - self._last.get(kind, 0.0) < SETTLE_S:
                return
            del self._active[kind]
        self._logger.info("%s (%d occurrences)", msg % args if args else msg, n)

    def active(self, kind: str) -> bool:
        with self._lock:
            return kind in self._active
