"""Least-frequently-used eviction (O(1) buckets): fewest hits while resident leaves first, ties least recent first.

The count starts at 1 on insert and is forgotten when the entry leaves the tier (no history of evicted keys).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator

from kvtier.storage_backends.eviction.base import EvictionPolicy, Key, register_policy


@register_policy
class LFUPolicy(EvictionPolicy):
    name = "lfu"

    def __init__(self, clock=None) -> None:
        super().__init__(clock)
        self._freq: dict[Key, int] = {}
        self._size: dict[Key, int] = {}
        # frequency -> keys with that frequency, least recently bumped first
        self._buckets: dict[int, OrderedDict[Key, None]] = {}

    def _bucket(self, f: int) -> OrderedDict[Key, None]:
        b = self._buckets.get(f)
        if b is None:
            b = self._buckets[f] = OrderedDict()
        return b

    def _unlink(self, key: Key, f: int) -> None:
        b = self._buckets[f]
        del b[key]
        if not b:
            del self._buckets[f]

    def on_insert(self, key: Key, size: int = 1) -> None:
        if key in self._freq:
            self._size[key] = size
            self.on_access(key)
            return
        self._freq[key] = 1
        self._size[key] = size
        self._bucket(1)[key] = None

    def on_access(self, key: Key) -> None:
        f = self._freq.get(key)
        if f is None:
            return
        self._unlink(key, f)
        self._freq[key] = f + 1
        self._bucket(f + 1)[key] = None

    def on_remove(self, key: Key) -> None:
        f = self._freq.pop(key, None)
        if f is None:
            return
        del self._size[key]
        self._unlink(key, f)

    def victims(self, need: int, evictable: Callable[[Key], bool]) -> Iterator[Key]:
        freed = 0
        taken: set[Key] = set()
        while freed < need:
            key = None
            for f in sorted(self._buckets):
                key = next((k for k in self._buckets[f] if k not in taken and evictable(k)), None)
                if key is not None:
                    break
            if key is None:
                return
            taken.add(key)
            freed += self._size[key]
            yield key

    def __len__(self) -> int:
        return len(self._freq)

    def __contains__(self, key: Key) -> bool:
        return key in self._freq
