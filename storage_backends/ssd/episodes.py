"""Log a recurring condition once per episode: when it starts and when it clears, never once per occurrence.

A full disk or a failing device can drop thousands of chunks; each drop is counted in a metric, while the log says
once that it started (naming the setting or the fix) and once that it is over, with the count in between.
"""

from __future__ import annotations

import logging
import threading


class EpisodeLog:
    def __init__(self, logger: logging.Logger) -> None:
        self._logger = logger
        self._active: dict[str, int] = {}
        self._lock = threading.Lock()

    def occurred(self, kind: str, level: int, msg: str, *args) -> None:
        """One more occurrence of `kind`; logs `msg` only if no episode of `kind` is under way."""
        with self._lock:
            n = self._active.get(kind, 0)
            self._active[kind] = n + 1
        if n == 0:
            self._logger.log(level, msg + " (further occurrences are counted, not logged, until this clears)", *args)

    def cleared(self, kind: str, msg: str, *args) -> None:
        """`kind` is over (an operation of that kind succeeded); logs `msg` once if an episode was under way."""
        with self._lock:
            n = self._active.pop(kind, 0)
        if n:
            self._logger.info(msg + " (%d occurrences)", *args, n)

    def active(self, kind: str) -> bool:
        with self._lock:
            return kind in self._active
