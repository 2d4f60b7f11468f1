"""What the answer-length policy knows of a chunk: the bucket edges of its signals, the kinds of chunks, the reuse
predictor's feature space, a turn's feature values (`Turn`), the unit of a chunk evicted on its own (`KeyUnit`;
a session's history chunks are evicted together, as their `sessions.Session`), and the log-odds helpers."""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Sequence

from kvtier.storage_backends.eviction.base import Key
from kvtier.storage_backends.eviction.reuse_predictor import FeatureSpace
from kvtier.storage_backends.eviction.sessions import Session

DEPTH_EDGES = (2, 3, 5, 9)  # turns: 1, 2, 3-4, 5-8, 9+
NEW_EDGES = (2, 5, 17)  # chunks the turn added: 1, 2-4, 5-16, 17+
CHAIN_EDGES = (3, 5, 9, 17, 33)  # chunks in the chain
ANSWER_EDGES = (30, 100, 250, 500, 1000)  # answer tokens: <30, <100, <250, <500, <1000, 1000+
GAP_EDGES = (45, 180)  # seconds between a session's two latest turns, after "first turn"
SHARE_EDGES = (3, 5, 9, 17)  # reads of a shared/orphan chunk: 1-2, 3-4, 5-8, 9-16, 17+

HIST, TAIL, SHARED, ORPHAN = 0, 1, 2, 3  # chunk kinds (HIST: a session's history chunks)

# Predictor features; value 0 of every group but "kind" means "not applicable / unknown".
FEATURES = FeatureSpace(
    groups=(
        ("kind", 4),
        ("depth", len(DEPTH_EDGES) + 2),
        ("new_chunks", len(NEW_EDGES) + 2),
        ("chain", len(CHAIN_EDGES) + 2),
        ("answer", len(ANSWER_EDGES) + 2),
        ("pace", len(GAP_EDGES) + 3),
        ("hits", 5),
        ("reads", len(SHARE_EDGES) + 2),
    ),
    crosses=(("answer", "pace"), ("depth", "new_chunks"), ("kind", "depth")),
)


def bucket_of(value: float, edges: Sequence[float]) -> int:
    """Index of the first edge above value (len(edges) if none)."""
    return bisect_right(edges, value)


class Turn:
    """Feature values of one request; the ghost samples of its chunks point here, so the answer length, known
    when the request finishes, reaches their labels."""

    __slots__ = ("depth", "new", "chain", "answer", "pace", "hits")

    def __init__(self, depth: int, new: int, chain: int, pace: int, hits: int) -> None:
        self.depth, self.new, self.chain, self.pace, self.hits = depth, new, chain, pace, hits
        self.answer = 0


class KeyUnit:
    """A chunk evicted on its own (tail, shared, orphan)."""

    __slots__ = ("key", "size", "kind", "last_time", "item", "count", "cls", "seq", "owner", "lb", "x", "ver",
                 "filed", "entry", "until", "epoch")

    def __init__(self, key: Key, size: int, kind: int, now: float, owner: Session | None = None) -> None:
        self.key = key
        self.size = size
        self.kind = kind
        self.last_time = now
        self.item = None
        self.count = 1
        self.cls = -1
        self.seq = -1
        self.owner = owner
        self.lb = 0
        self.x: tuple | None = None
        self.ver = 0
        self.filed = False
        self.entry = None
        self.until = 0.0
        self.epoch = -1


def log_loss(z: float, label: bool) -> float:
    """-log P(label) for log-odds z."""
    z = -z if label else z
    return z + math.log1p(math.exp(-z)) if z > 0 else math.log1p(math.exp(z))


def with_odds(p: float, r: float) -> float:
    """Probability p with its odds scaled by r (r = 0: never)."""
    return r * p / (1.0 - p + r * p) if r > 0.0 else 0.0


def logit(p: float) -> float:
    p = min(max(p, 1e-6), 1.0 - 1e-6)
    return math.log(p / (1.0 - p))
