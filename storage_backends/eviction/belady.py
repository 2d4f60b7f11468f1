"""Belady's MIN / OPT: evict the resident key whose next use lies farthest in the future. Offline only.

It needs the future, so it is never selectable in production (`production = False`; `make_policy("belady")`
refuses it unless `production=False`). Give it the future as the exact sequence of keys the tier will *see*,
one per `on_access` (hit) or `on_insert` (miss) call, in order, either as `BeladyPolicy(future=keys)` or through
`set_future(keys)` before the first call. Each of those calls advances a cursor through the sequence; a call
whose key differs from the expected one raises `ValueError` (the replay and the policy disagree). Keys never seen
again are evicted first. It always admits the missed key (no bypass), as the tier contract has no admission step.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Hashable, Iterator, Sequence

from kvtier.storage_backends.eviction.base import EvictionPolicy, Key, register_policy

NEVER = float("inf")


def next_use_positions(keys: Sequence[Hashable]) -> list[float]:
    """For each position i, the next position j > i with keys[j] == keys[i] (inf if none)."""
    nxt: list[float] = [NEVER] * len(keys)
    last: dict[Hashable, int] = {}
    for i in range(len(keys) - 1, -1, -1):
        k = keys[i]
        nxt[i] = last.get(k, NEVER)
        last[k] = i
    return nxt


@register_policy
class BeladyPolicy(EvictionPolicy):
    name = "belady"
    production = False

    def __init__(self, clock=None, future: Sequence[Key] | None = None) -> None:
        super().__init__(clock)
        self._future: Sequence[Key] = ()
        self._next: list[float] = []
        self._pos = 0
        self._resident: dict[Key, tuple[float, int]] = {}  # key -> (next use, size)
        self._heap: list[tuple[float, int, Key]] = []  # (-next use, tiebreak, key), lazily invalidated
        self._tie = itertools.count()
        if future is not None:
            self.set_future(future)

    def set_future(self, keys: Sequence[Key]) -> None:
        """The sequence of keys the tier will pass to on_access/on_insert, in order."""
        self._future = list(keys)
        self._next = next_use_positions(self._future)
        self._pos = 0

    def _advance(self, key: Key) -> float:
        if self._pos >= len(self._future):
            raise ValueError("belady: more accesses than the future it was given")
        if self._future[self._pos] != key:
            raise ValueError(f"belady: expected key {self._future[self._pos]!r} at {self._pos}, got {key!r}")
        nxt = self._next[self._pos]
        self._pos += 1
        return nxt

    def _set(self, key: Key, nxt: float, size: int) -> None:
        self._resident[key] = (nxt, size)
        heapq.heappush(self._heap, (-nxt, next(self._tie), key))
        if len(self._heap) > 4 * len(self._resident) + 1024:  # drop stale entries
            self._heap = [(-n, next(self._tie), k) for k, (n, _) in self._resident.items()]
            heapq.heapify(self._heap)

    def on_insert(self, key: Key, size: int = 1) -> None:
        self._set(key, self._advance(key), size)

    def on_access(self, key: Key) -> None:
        nxt = self._advance(key)
        if key in self._resident:
            self._set(key, nxt, self._resident[key][1])

    def on_remove(self, key: Key) -> None:
        self._resident.pop(key, None)

    def victims(self, need: int, evictable: Callable[[Key], bool]) -> Iterator[Key]:
        freed = 0
        skipped: list[tuple[float, int, Key]] = []
        yielded: set[Key] = set()
        heap = self._heap
        while freed < need and heap:
            negnext, tie, key = heapq.heappop(heap)
            cur = self._resident.get(key)
            if cur is None or cur[0] != -negnext or key in yielded:
                continue  # stale entry
            if not evictable(key):
                skipped.append((negnext, tie, key))
                continue
            freed += cur[1]
            yielded.add(key)
            skipped.append((negnext, tie, key))  # put back: if the caller keeps it, it stays a candidate
            yield key
        for item in skipped:
            heapq.heappush(heap, item)

    def __len__(self) -> int:
        return len(self._resident)

    def __contains__(self, key: Key) -> bool:
        return key in self._resident
