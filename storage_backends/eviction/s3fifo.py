"""S3-FIFO (Yang et al., SOSP'23): a small probationary FIFO S (10% of the capacity), a main FIFO M and a ghost FIFO
G of keys recently evicted from S. New keys enter S (or M when G remembers them); a key leaving S that was hit at
least `move_to_main_threshold` times moves to M instead of being evicted; M is a FIFO with lazy promotion
(reinsertion while the 2-bit hit counter is positive, decrementing it).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator

from kvtier.storage_backends.eviction.base import EvictionPolicy, Key, register_policy


@register_policy
class S3FIFOPolicy(EvictionPolicy):
    name = "s3fifo"

    def __init__(
        self,
        clock=None,
        capacity: int | None = None,
        small_fraction: float = 0.1,
        move_to_main_threshold: int = 1,
        max_freq: int = 3,
    ) -> None:
        super().__init__(clock)
        self.capacity = capacity
        self.small_fraction = small_fraction
        self.move_to_main_threshold = move_to_main_threshold
        self.max_freq = max_freq
        self._small: OrderedDict[Key, int] = OrderedDict()
        self._main: OrderedDict[Key, int] = OrderedDict()
        self._ghost: OrderedDict[Key, int] = OrderedDict()
        self._freq: dict[Key, int] = {}
        self._small_size = 0
        self._main_size = 0
        self._ghost_size = 0
        self._hwm = 0
        self._evicting: set[Key] = set()

    def _c(self) -> int:
        return self.capacity or max(self._hwm, 1)

    def on_insert(self, key: Key, size: int = 1) -> None:
        if key in self._freq:
            self.on_access(key)
            return
        self._freq[key] = 0
        if key in self._ghost:
            self._ghost_size -= self._ghost.pop(key)
            self._main[key] = size
            self._main_size += size
        else:
            self._small[key] = size
            self._small_size += size
        self._hwm = max(self._hwm, self._small_size + self._main_size)

    def on_access(self, key: Key) -> None:
        f = self._freq.get(key)
        if f is not None and f < self.max_freq:
            self._freq[key] = f + 1

    def on_remove(self, key: Key) -> None:
        if self._freq.pop(key, None) is None:
            return
        ghost = key in self._evicting
        self._evicting.discard(key)
        if key in self._small:
            size = self._small.pop(key)
            self._small_size -= size
            if ghost:
                self._ghost[key] = size
                self._ghost_size += size
                limit = self._c() * (1.0 - self.small_fraction)
                while self._ghost and self._ghost_size > limit:
                    _, sz = self._ghost.popitem(last=False)
                    self._ghost_size -= sz
        else:
            self._main_size -= self._main.pop(key)

    def victims(self, need: int, evictable: Callable[[Key], bool]) -> Iterator[Key]:
        self._evicting.clear()
        freed = 0
        pend_small = 0
        budget = 4 * (len(self._small) + len(self._main)) + 4  # no endless loop when nothing is evictable
        while freed < need and budget > 0:
            budget -= 1
            small_live = self._small_size - pend_small
            use_small = small_live > 0 and (small_live >= self.small_fraction * self._c() or not self._main)
            queue = self._small if use_small else self._main
            key = next((k for k in queue if k not in self._evicting), None)
            if key is None:
                if not use_small and self._small_size - pend_small > 0:
                    queue, use_small = self._small, True
                    key = next((k for k in queue if k not in self._evicting), None)
                if key is None:
                    return
            size = queue[key]
            if use_small:
                if self._freq[key] >= self.move_to_main_threshold:
                    del self._small[key]
                    self._small_size -= size
                    self._main[key] = size
                    self._main_size += size
                    self._freq[key] = 0
                    continue
            elif self._freq[key] > 0:
                self._freq[key] -= 1
                self._main.move_to_end(key)
                continue
            if not evictable(key):
                queue.move_to_end(key)
                continue
            freed += size
            self._evicting.add(key)
            yield key
            if use_small and key in self._small:
                pend_small += size

    def __len__(self) -> int:
        return len(self._freq)

    def __contains__(self, key: Key) -> bool:
        return key in self._freq
