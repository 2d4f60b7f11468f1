"""What the answer-length policy knows of a chunk: the bucket edges of its signals, the kinds of chunks, and the unit
of a chunk evicted on its own (`KeyUnit`; a session's history chunks are evicted together, as their
`sessions.Session`)."""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvtier.storage_backends.eviction.base import Key
from kvtier.storage_backends.eviction.sessions import Session

if TYPE_CHECKING:
    from kvtier.storage_backends.eviction.reuse_model import Item

DEPTH_EDGES = (2, 3, 5, 9)  # turns: 1, 2, 3-4, 5-8, 9+
NEW_EDGES = (2, 5, 17)  # chunks the turn added: 1, 2-4, 5-16, 17+
ANSWER_EDGES = (30, 100, 250, 500, 1000)  # answer tokens: <30, <100, <250, <500, <1000, 1000+
GAP_EDGES = (45, 180)  # seconds between a session's two latest turns, after "first turn"
SHARE_EDGES = (3, 5, 9, 17)  # reads of a shared/orphan chunk: 1-2, 3-4, 5-8, 9-16, 17+

HIST, TAIL, SHARED, ORPHAN = 0, 1, 2, 3  # chunk kinds (HIST: a session's history chunks)


def bucket_of(value: float, edges: Sequence[float]) -> int:
    """Index of the first edge above value (len(edges) if none)."""
    return bisect_right(edges, value)


class KeyUnit:
    """A chunk evicted on its own (tail, shared, orphan)."""

    __slots__ = ("key", "size", "kind", "last_time", "item", "count", "cls", "seq", "owner", "lb", "ver",
                 "filed", "entry", "until", "epoch")

    def __init__(self, key: Key, size: int, kind: int, now: float, owner: Session | None = None) -> None:
        self.key = key
        self.size = size
        self.kind = kind
        self.last_time = now
        self.item: Item | None = None
        self.count = 1
        self.cls = -1
        self.seq = -1
        self.owner = owner
        self.lb = 0
        self.ver = 0
        self.filed = False
        self.entry: tuple | None = None
        self.until = 0.0
        self.epoch = -1
