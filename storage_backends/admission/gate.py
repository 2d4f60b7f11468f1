"""`RefusedKeys`: the worker's hand-over of admission verdicts to the SSD tier. The connector's scheduler side
decides which chunks of a save the SSD tier does not write (`SaveSpec.ssd_refused`); the worker names their keys
here before the save runs, and the LMCache plugin's put (`KVTierBackend.batched_submit_put_task`) takes each one it
meets out again and skips its SSD write (the chunk stays in LMCache's host tier).

Bounded: keys whose put never comes (LMCache found the chunk stored already, or the store failed) are forgotten
oldest first, so a later put of the same key could be kept off the SSD once (a future SSD miss, never an error).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Iterable

logger = logging.getLogger(__name__)


class RefusedKeys:
    def __init__(self, capacity: int = 1 << 16) -> None:
        self.capacity = capacity
        self._keys: OrderedDict[str, None] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._keys)

    def refuse(self, keys: Iterable[str]) -> None:
        with self._lock:
            for k in keys:
                self._keys[k] = None
                self._keys.move_to_end(k)
            while len(self._keys) > self.capacity:
                self._keys.popitem(last=False)

    def take(self, key: str) -> bool:
        """Whether `key`'s SSD write was refused (forgotten here once asked)."""
        if not self._keys:
            return False
        with self._lock:
            return self._keys.pop(key, 0) is None
