"""First-in-first-out eviction: entries leave in insertion order; hits do not reorder them."""

from __future__ import annotations

from kvtier.storage_backends.eviction.base import Key, register_policy
from kvtier.storage_backends.eviction.lru import LRUPolicy


@register_policy
class FIFOPolicy(LRUPolicy):
    """LRU's ordered queue without the move-to-end on a hit (or on a re-insert of a resident key)."""

    name = "fifo"

    def on_insert(self, key: Key, size: int = 1) -> None:
        self._order[key] = size  # a resident key keeps its place

    def on_access(self, key: Key) -> None:
        pass
