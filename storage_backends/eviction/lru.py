"""Least-recently-used eviction: the tier's default and the baseline every other policy is measured against."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator

from kvtier.storage_backends.eviction.base import EvictionPolicy, Key, register_policy


@register_policy
class LRUPolicy(EvictionPolicy):
    name = "lru"

    def __init__(self, clock=None) -> None:
        super().__init__(clock)
        self._order: OrderedDict[Key, int] = OrderedDict()

    def on_insert(self, key: Key, size: int = 1) -> None:
        self._order[key] = size
        self._order.move_to_end(key)

    def on_access(self, key: Key) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def on_remove(self, key: Key) -> None:
        self._order.pop(key, None)

    def victims(self, need: int, evictable: Callable[[Key], bool]) -> Iterator[Key]:
        # Oldest first. The caller removes each yielded key before asking for the next, so the scan restarts at the
        # front instead of copying the order (no O(n) copy per decision).
        freed = 0
        taken: set[Key] = set()
        while freed < need:
            key = next((k for k in self._order if k not in taken and evictable(k)), None)
            if key is None:
                return
            taken.add(key)
            freed += self._order[key]
            yield key

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: Key) -> bool:
        return key in self._order
