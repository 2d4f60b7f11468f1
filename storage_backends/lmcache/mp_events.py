"""The MP-mode L2 adapter's events for LMCache's listeners: chunks stored and chunks deleted.

The SSD tier's callbacks run under the tier's lock, so they only record (`stored`, `deleted`); a thread of the
relay's own hands the records to LMCache's listeners (`L2AdapterInterface._notify_keys_stored` / `_deleted`), in
the order they were recorded (`deliver` also runs on a caller's thread, under the same lock)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

#: an LMCache listener call: (object keys, their sizes in bytes)
Notify = Callable[[list[Any], list[int]], None]


@dataclass
class _Events:
    stored: list[tuple[Any, int]] = field(default_factory=list)  #: (ObjectKey, bytes)
    deleted: list[tuple[Any, int]] = field(default_factory=list)


class EventRelay:
    """Records the adapter's stored/deleted chunks and hands them to LMCache's listeners on its own thread."""

    def __init__(self, notify_stored: Notify, notify_deleted: Notify) -> None:
        self._notify_stored = notify_stored
        self._notify_deleted = notify_deleted
        self._events = _Events()
        self._cond = threading.Condition()
        self._notify_lock = threading.Lock()  # keeps stored/deleted notifications in order
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="kvtier-mp-events", daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def stored(self, items: list[tuple[Any, int]]) -> None:
        """Chunks now stored: (ObjectKey, bytes) each (safe under the tier's lock)."""
        with self._cond:
            self._events.stored.extend(items)
            self._cond.notify()

    def deleted(self, items: list[tuple[Any, int]]) -> None:
        """Chunks no longer stored: (ObjectKey, bytes) each (safe under the tier's lock)."""
        with self._cond:
            self._events.deleted.extend(items)
            self._cond.notify()

    def deliver(self) -> None:
        """Hand what is recorded to LMCache's listeners now (never under the tier's lock)."""
        with self._notify_lock:
            with self._cond:
                ev, self._events = self._events, _Events()
            try:
                if ev.stored:
                    self._notify_stored([k for k, _ in ev.stored], [n for _, n in ev.stored])
                if ev.deleted:
                    self._notify_deleted([k for k, _ in ev.deleted], [n for _, n in ev.deleted])
            except Exception:
                logger.exception("an LMCache L2 listener failed")

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not (self._events.stored or self._events.deleted or self._closed):
                    self._cond.wait()
                if self._closed and not (self._events.stored or self._events.deleted):
                    return
            self.deliver()

    def close(self) -> None:
        """Deliver what is left, then end the thread."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join()
