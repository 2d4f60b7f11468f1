"""The SSD tier's write queue: chunks waiting for the writer thread, bounded in bytes, with back-pressure.

`submit` / `submit_many` queue chunks unless the same key is already stored or queued (checked again after every
wait, so two threads storing one key never both get through); when the queued bytes would exceed the bound they
wait up to the timeout for the writers to drain, then drop the chunk (counted, never silent). Writers `take`
batches and mark them `done`; `flush` waits until nothing is queued or being written. `cancel` marks a queued (or
being written) chunk as cancelled: the writer does not commit it, and the key may be queued again at once.
"""

from __future__ import annotations

import collections
import enum
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass
class PutTask:
    key: str
    meta: Any  # ChunkMeta
    buf: memoryview
    on_done: Callable[[bool], None]
    submitted: float
    cancelled: bool = False  #: set by `WriteQueue.cancel` (the key was removed): never committed


class Submitted(enum.Enum):
    QUEUED = "queued"
    DUPLICATE = "duplicate"
    BACKPRESSURE = "backpressure"
    CLOSED = "closed"


class WriteQueue:
    def __init__(self, max_bytes: int, timeout_s: float, is_stored: Callable[[str], bool]) -> None:
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s
        self._is_stored = is_stored
        self._cond = threading.Condition()
        self._pending: dict[str, PutTask] = {}  # queued or being written
        self._queue: collections.deque[PutTask] = collections.deque()
        self.inflight_bytes = 0
        self.closed = False

    def submit(self, task: PutTask) -> Submitted:
        return self.submit_many([task])[0]

    def submit_many(self, tasks: list[PutTask]) -> list[Submitted]:
        """Queue tasks in order. The writer sees them together (one wake-up), except where one waits for room:
        a store of several chunks then becomes one batch for the writer instead of a first chunk alone."""
        deadline = time.monotonic() + self.timeout_s
        out: list[Submitted] = []
        with self._cond:
            for task in tasks:
                out.append(self._enqueue(task, deadline))
            self._cond.notify_all()
        return out

    def _enqueue(self, task: PutTask, deadline: float) -> Submitted:
        n = task.meta.nbytes
        while True:
            if self.closed:
                return Submitted.CLOSED
            if task.key in self._pending or self._is_stored(task.key):
                return Submitted.DUPLICATE
            if not self.inflight_bytes or self.inflight_bytes + n <= self.max_bytes:
                break
            left = deadline - time.monotonic()
            if left <= 0:
                return Submitted.BACKPRESSURE
            self._cond.notify_all()  # let the writers take what is already queued before this waits
            self._cond.wait(left)
        self._pending[task.key] = task
        self._queue.append(task)
        self.inflight_bytes += n
        return Submitted.QUEUED

    def take(self, max_tasks: int) -> list[PutTask]:
        """The next batch for the writer (waits for one); [] once closed and drained."""
        with self._cond:
            while not self._queue and not self.closed:
                self._cond.wait()
            return [self._queue.popleft() for _ in range(min(len(self._queue), max_tasks))]

    def done(self, tasks: list[PutTask]) -> None:
        with self._cond:
            for t in tasks:
                if self._pending.get(t.key) is t:
                    del self._pending[t.key]
                self.inflight_bytes -= t.meta.nbytes
            self._cond.notify_all()

    def cancel(self, key: str) -> bool:
        """Cancel the queued or in-progress write of `key` (True if there was one). Its bytes stay counted until
        the writer is done with it; `is_pending(key)` is False from now on."""
        with self._cond:
            task = self._pending.pop(key, None)
            if task is None:
                return False
            task.cancelled = True
            self._cond.notify_all()
            return True

    def is_pending(self, key: str) -> bool:
        with self._cond:
            return key in self._pending

    def flush(self, timeout: float | None = None) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: not self._pending, timeout)

    def close(self) -> None:
        with self._cond:
            self.closed = True
            self._cond.notify_all()

    def abandon(self) -> list[PutTask]:
        """Close, and take back every chunk not yet taken by a writer (returned, no longer pending or counted):
        the writers finish only the batches they hold."""
        with self._cond:
            self.closed = True
            dropped = list(self._queue)
            self._queue.clear()
            for t in dropped:
                if self._pending.get(t.key) is t:
                    del self._pending[t.key]
                self.inflight_bytes -= t.meta.nbytes
            self._cond.notify_all()
            return dropped
