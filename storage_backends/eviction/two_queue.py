"""2Q-style eviction (after Johnson & Shasha, VLDB'94): admission at the second access, with a bounded memory.

A key stored for the first time goes on *probation*: a FIFO that is always evicted first, so first-seen keys only
use room nothing else needs. A key stored again while a *doorkeeper* still remembers it (the last `ghost_multiple`
times the capacity distinct keys stored, kept as keys only), or hit while on probation, enters the *main* queue, an
LRU. So the main queue holds exactly the keys whose reuse distance was short enough to be seen twice, the filter
vLLM's offloading manager applies with `store_threshold=2`, except that first-seen keys still fill free room and
the doorkeeper forgets (a key seen once long ago is new again).

Cost: O(1) dict operations per access. Memory: the resident keys plus at most `ghost_multiple` x capacity
remembered keys.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator

from kvtier.storage_backends.eviction.base import EvictionPolicy, Key, register_policy


@register_policy
class TwoQueuePolicy(EvictionPolicy):
    name = "2q"

    def __init__(self, clock=None, capacity: int | None = None, ghost_multiple: float = 4.0) -> None:
        super().__init__(clock)
        if not ghost_multiple > 0:
            raise ValueError(f"2q: ghost_multiple must be > 0, got {ghost_multiple}")
        self.ghost_multiple = ghost_multiple
        self._probation: OrderedDict[Key, int] = OrderedDict()  # first-seen keys, oldest first
        self._main: OrderedDict[Key, int] = OrderedDict()  # keys seen twice, least recently used first
        self._seen: OrderedDict[Key, None] = OrderedDict()  # the doorkeeper: keys stored lately, oldest first
        self._high_water = 0
        if capacity is not None:
            self.set_capacity(capacity)

    def _remembered(self) -> int:
        c = self.capacity if self.capacity is not None else max(self._high_water, 1)
        return max(1, round(self.ghost_multiple * c))

    def on_insert(self, key: Key, size: int = 1) -> None:
        if key in self._main or key in self._probation:
            self.on_access(key)
            return
        if key in self._seen:
            self._seen.move_to_end(key)
            self._main[key] = size
        else:
            self._seen[key] = None
            limit = self._remembered()
            while len(self._seen) > limit:
                self._seen.popitem(last=False)
            self._probation[key] = size
        self._high_water = max(self._high_water, len(self._main) + len(self._probation))

    def on_access(self, key: Key) -> None:
        size = self._probation.pop(key, None)
        if size is not None:
            self._main[key] = size  # hit while on probation: seen twice
        elif key in self._main:
            self._main.move_to_end(key)

    def on_remove(self, key: Key) -> None:
        if self._probation.pop(key, None) is None:
            self._main.pop(key, None)

    def victims(self, need: int, evictable: Callable[[Key], bool]) -> Iterator[Key]:
        # Probation first (oldest first), then the main queue's least recently used. The caller removes each yielded
        # key before asking for the next, so each scan starts afresh at the front.
        freed = 0
        taken: set[Key] = set()
        for queue in (self._probation, self._main):
            while freed < need:
                key = next((k for k in queue if k not in taken and evictable(k)), None)
                if key is None:
                    break
                taken.add(key)
                freed += queue[key]
                yield key
        return

    def __len__(self) -> int:
        return len(self._probation) + len(self._main)

    def __contains__(self, key: Key) -> bool:
        return key in self._probation or key in self._main

    def memory_items(self) -> dict[str, int]:
        return {"probation": len(self._probation), "main": len(self._main), "doorkeeper": len(self._seen)}


__all__ = ["TwoQueuePolicy"]
