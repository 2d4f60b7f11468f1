"""First-in-first-out eviction: entries leave in insertion order; hits do not reorder them."""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Iterator

from kvtier.storage_backends.eviction.base import EvictionPolicy, Key, register_policy


@register_policy
class FIFOPolicy(EvictionPolicy):
    name = "fifo"

    def __init__(self, clock=None) -> None:
        super().__init__(clock)
        self._order: OrderedDict[Key, int] = OrderedDict()

    def on_insert(self, key: Key, size: int = 1) -> None:
        if key in self._order:  # re-insert of a resident key keeps its place
            self._order[key] = size
            return
        self._order[key] = size

    def on_access(self, key: Key) -> None:
        pass

    def on_remove(self, key: Key) -> None:
        self._order.pop(key, None)

    def victims(self, need: int, evictable: Callable[[Key], bool]) -> Iterator[Key]:
        # Scan from the front again after each yield (the caller may have removed the key meanwhile):
        # no O(n) copy per decision.
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
