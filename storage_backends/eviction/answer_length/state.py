"""The answer-length policy's state as its mixins see it: the attributes `AnswerLengthPolicy.__init__` sets up
(`policy.py`) and the methods one mixin calls on another, declared once so that the type checker reads
`scoring.ScoreTables` and `learning.GhostLearning` against the same fields the policy has."""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

import numpy as np

from kvtier.storage_backends.eviction.answer_length.config import AnswerLengthConfig
from kvtier.storage_backends.eviction.answer_length.features import KeyUnit
from kvtier.storage_backends.eviction.base import EvictionPolicy, Key
from kvtier.storage_backends.eviction.ghost_cache import GhostBelady, ReuseBuckets
from kvtier.storage_backends.eviction.reuse_model import ReuseModel
from kvtier.storage_backends.eviction.sessions import Session

#: a unit of eviction: a session's chunks, or one chunk on its own
Unit = Session | KeyUnit
#: (score, last_time, seq, unit, ver): a unit's entry in the score heap
HeapEntry = tuple[float, float, int, Unit, int]
#: (time of the unit's next bucket crossing, seq, unit, ver)
CrossEntry = tuple[float, int, Unit, int]


class PolicyState(EvictionPolicy):
    """Declarations only (nothing is set here): the policy's fields its mixins read and write."""

    cfg: AnswerLengthConfig
    buckets: ReuseBuckets
    reuse: ReuseModel
    ghost: GhostBelady
    C_TAIL: int
    C_SHARED0: int
    _edges: tuple[float, ...]
    _lower: list[float]
    _use_elapsed: bool
    _use_ghost: bool
    _ghost_rate: int
    _ghost_rate_fixed: bool
    _n_edges: int
    _nz: int
    _n_base: int
    _na_t: int
    _ng_t: int
    _n_timing: int
    _keys: dict[Key, Unit]
    _heap: list[HeapEntry]
    _cross: list[CrossEntry]
    _seq: itertools.count[int]
    _units: dict[int, Unit]
    _epoch: int
    _hits: np.ndarray
    _occ: np.ndarray | None
    _h: list[float]
    _lb_hist: list[list[int]]
    _lb_bucket: list[int]
    _since_refresh: int
    _used: int
    _hwm: int

    if TYPE_CHECKING:  # defined by one mixin, called from the other
        def _refresh(self) -> None: ...

        def _capacity_blocks(self) -> int: ...

        def _rescore(self, u: Unit, now: float, push: bool = True) -> None: ...
