"""`AnswerLengthPolicy`: the tier contract and the session signals; its units, what they are filed under, and
what a request or a chunk access does to them. The score tables and heap are `scoring.ScoreTables`, the ghost's
sampling `learning.GhostLearning` (see the package docstring for how it decides)."""

from __future__ import annotations

import heapq
import itertools
import logging
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import fields, replace

import numpy as np

from kvtier.storage_backends.eviction.answer_length.config import AnswerLengthConfig
from kvtier.storage_backends.eviction.answer_length.features import (
    ANSWER_EDGES,
    DEPTH_EDGES,
    GAP_EDGES,
    NEW_EDGES,
    ORPHAN,
    SHARE_EDGES,
    SHARED,
    TAIL,
    KeyUnit,
    bucket_of,
)
from kvtier.storage_backends.eviction.answer_length.learning import GhostLearning
from kvtier.storage_backends.eviction.answer_length.scoring import ScoreTables
from kvtier.storage_backends.eviction.base import EvictionPolicy, Key, register_policy
from kvtier.storage_backends.eviction.ghost_cache import _MASK, _MIX, GhostBelady, ReuseBuckets, key_hash
from kvtier.storage_backends.eviction.reuse_model import ReuseModel
from kvtier.storage_backends.eviction.sessions import Session, SessionTracker

logger = logging.getLogger(__name__)


@register_policy
class AnswerLengthPolicy(ScoreTables, GhostLearning, EvictionPolicy):
    name = "answer-length"

    def __init__(self, clock=None, capacity: int | None = None, config: AnswerLengthConfig | None = None, **kw):
        super().__init__(clock)
        cfg = config or AnswerLengthConfig()
        if kw:
            known = {f.name for f in fields(AnswerLengthConfig)}
            bad = sorted(set(kw) - known)
            if bad:
                raise ValueError(f"answer-length: unknown option(s) {bad}; known: {sorted(known)}")
            cfg = replace(cfg, **kw)
        if cfg.score not in ("density", "potential"):
            raise ValueError(f"answer-length: score must be 'density' or 'potential', not {cfg.score!r}")
        self.cfg = cfg
        self.capacity = capacity
        self.buckets = ReuseBuckets.geometric(cfg.bucket_first_s, cfg.horizon_s, cfg.bucket_ratio)
        self._edges = self.buckets.edges
        self._lower = [self.buckets.lower(k) for k in range(len(self._edges))]
        self._use_elapsed = cfg.use_elapsed
        self._use_ghost = cfg.use_ghost
        self._ghost_rate_fixed = cfg.ghost_sample_rate > 0
        self._n_edges = len(self._edges) if cfg.use_elapsed else 0  # no crossings without elapsed time
        nd = len(DEPTH_EDGES) + 1 if cfg.use_depth else 1
        nz = len(NEW_EDGES) + 1 if cfg.use_new_blocks else 1
        self._nd, self._nz = nd, nz
        self.C_TAIL = nd * nz
        self.C_SHARED0 = self.C_TAIL + 1
        self.C_ORPHAN = self.C_SHARED0 + len(SHARE_EDGES) + 1
        n_classes = self.C_ORPHAN + 1
        self._family = [0] * self.C_TAIL + [1] + [2] * (len(SHARE_EDGES) + 1) + [3]
        # Timed session rows: session class x timing key (answer bucket x previous-gap bucket), after the classes.
        self._n_base = n_classes
        self._na_t = len(ANSWER_EDGES) + 1 if (cfg.use_answer_length and cfg.answer_timing) else 1
        self._ng_t = len(GAP_EDGES) + 2 if cfg.gap_timing else 1
        self._n_timing = self._na_t * self._ng_t if self._na_t * self._ng_t > 1 else 0
        self.reuse = ReuseModel(
            self.buckets, n_classes, prior_of=self._family.__getitem__, max_items=cfg.max_items,
            prior_strength=cfg.prior_strength, n_timing=self._n_timing,
        )
        self.ghost = GhostBelady(self.buckets, cfg.ghost_sample_rate or 8, cfg.ghost_window, cfg.ghost_refresh)
        self._salt = int(cfg.ghost_salt)
        self.sessions = SessionTracker(cfg.max_sessions)
        self._keys: dict[Key, Session | KeyUnit] = {}  # resident key -> its unit
        self._heap: list = []  # (score, last_time, seq, unit, ver)
        self._cross: list = []  # (time of the unit's next bucket crossing, seq, unit, ver)
        self._seq = itertools.count()
        self._units: dict[int, Session | KeyUnit] = {}  # units with resident chunks (filed in the heap), by id
        self._epoch = 0  # bumped by every table refresh (scores computed before are stale)
        self._ctx: dict[Key, tuple[Session, bool]] = {}  # in-flight chain key -> (session, is tail)
        self._ghost_items: OrderedDict[Key, tuple] = OrderedDict()  # evicted chunk -> (item, kind, count)
        self._limbo: dict[Key, tuple[Session | KeyUnit, int]] = {}  # yielded by victims(), not removed yet
        self._hits = np.zeros((0, 0))  # per table row and elapsed bucket: expected hits from there on
        self._occ: np.ndarray | None = None  # ... and expected occupancy (density score only)
        self._h: list[float] = []
        # answer bucket -> histogram of observed next-turn reuse-time buckets; -> lower-bound bucket
        self._lb_hist = [[0] * (len(self.buckets) + 1) for _ in range(len(ANSWER_EDGES) + 1)]
        self._lb_bucket = [0] * (len(ANSWER_EDGES) + 1)
        self._req_seq = 0
        self._answers = 0
        self._since_refresh = 0
        self._used = 0
        self._hwm = 0
        self._refresh()
        self._ghost_rate = 0  # fixed by _fix_rates() when the capacity is set or at the first chunk

    def set_capacity(self, capacity: int) -> None:
        super().set_capacity(capacity)
        if not self._ghost_rate:
            self._fix_rates()

    # ------------------------------------------------------------------ unit bookkeeping
    def _set_session(self, s: Session, cls: int, now: float) -> None:
        s.cls = cls
        if s.keys:
            self._rescore(s, now)

    def _set_key_unit(self, u: KeyUnit, cls: int, now: float) -> None:
        u.cls = cls
        self._rescore(u, now)

    def _touch_key_unit(self, u: KeyUnit, now: float) -> None:
        """A tail/shared/orphan chunk was read again: close its wait, start the next one."""
        self.reuse.returned(u.item, now)
        u.count += 1
        u.last_time = now
        u.seq = self._req_seq
        if u.kind == TAIL:  # read again: no longer a dead tail
            u.kind = SHARED if self.cfg.use_shared else ORPHAN
            u.owner = None
        cls = self._shared_class(u.count) if u.kind == SHARED else self.C_ORPHAN
        u.item = self.reuse.start(cls, now)
        self._set_key_unit(u, cls, now)

    def _remember_evicted(self, key: Key, u: KeyUnit) -> None:
        if u.item is None:
            return
        self._ghost_items[key] = (u.item, u.kind, u.count)
        while len(self._ghost_items) > self.cfg.max_ghost_keys:
            _, (item, _, _) = self._ghost_items.popitem(last=False)
            self.reuse.cancel(item)

    # ------------------------------------------------------------------ session signals
    def on_request(self, chain: Sequence[Key], now: float | None = None) -> None:
        if not chain:
            return
        now = self.now() if now is None else now
        self._req_seq += 1
        self.reuse.advance(now)
        self._since_refresh += 1
        if self._since_refresh >= self.cfg.refresh_requests:
            self._refresh()
        self._advance(now)
        if len(self._heap) > 4 * len(self._units) + 4096 or len(self._cross) > 4 * len(self._units) + 4096:
            self._compact()
        s, follow_up = self.sessions.begin(chain, now)
        if follow_up:
            self.reuse.returned(s.item, now)
            if s.item is not None and s.item.answer is not None:
                hist = self._lb_hist[s.item.answer]
                hist[min(self.buckets.index(now - s.item.start), len(hist) - 1)] += 1
        s.lb = 0
        s.item = None
        self._set_session(s, self._hist_class(s.depth, s.new_blocks), now)
        last = len(chain) - 1
        keys = self._keys
        for i, k in enumerate(chain):
            u = keys.get(k)
            if u is None:
                self._ctx[k] = (s, i == last and self.cfg.use_tail)
                continue
            if u is s:
                continue
            if isinstance(u, KeyUnit):
                if u.kind == TAIL and u.owner is s and i < last:
                    # the parent's last chunk was a full one: the follow-up extends it, it is history now
                    self.reuse.returned(u.item, now)
                    self._unfile(u)
                    s.keys[k] = u.size
                    s.nbytes += u.size
                    keys[k] = s
                    if not s.filed:
                        self._refile(s, now)
                elif u.seq != self._req_seq:
                    self._touch_key_unit(u, now)
            elif isinstance(u, Session):
                # another conversation's chunk read by this one: shared from now on
                size = u.keys.pop(k, None)
                if size is None:
                    continue
                u.nbytes -= size
                if not u.keys:
                    self._unfile(u)
                ku = KeyUnit(k, size, SHARED if self.cfg.use_shared else ORPHAN, now)
                ku.count = 2
                ku.seq = self._req_seq
                cls = self._shared_class(2) if ku.kind == SHARED else self.C_ORPHAN
                ku.item = self.reuse.start(cls, now)
                keys[k] = ku
                self._set_key_unit(ku, cls, now)
        if len(self._ctx) > self.cfg.max_ctx:  # chunks announced but never inserted: forget the oldest half
            for k in list(itertools.islice(self._ctx, len(self._ctx) // 2)):
                del self._ctx[k]

    def on_request_finished(self, chain: Sequence[Key], answer_tokens: int, now: float | None = None) -> None:
        if not chain:
            return
        now = self.now() if now is None else now
        ctx = self._ctx
        for k in chain:
            if k in ctx:
                del ctx[k]
        s = self.sessions.session_of_chain(chain)
        if s is not None:
            self._answers += 1
            s.answer_tokens = int(answer_tokens)
            cls = self._hist_class(s.depth, s.new_blocks)
            self.reuse.cancel(s.item)
            s.item = self.reuse.start(cls, s.last_time)
            a = bucket_of(s.answer_tokens, ANSWER_EDGES)
            if self.cfg.use_answer_length:
                if s.item is not None:
                    s.item.answer = a
                s.lb = self._lb_bucket[a]
            if self._n_timing:
                t = self._timing_key(a, s.prev_gap)
                if s.item is not None:
                    s.item.timing = t
                cls = self._timed_row(cls, t)
            self._set_session(s, cls, now)

    # ------------------------------------------------------------------ tier contract
    def on_insert(self, key: Key, size: int = 1) -> None:
        keys = self._keys
        if key in keys:
            self.on_access(key)
            return
        now = self._clock()
        ctx = self._ctx.pop(key, None)
        old = self._ghost_items.pop(key, None) if self._ghost_items else None
        if old is not None:  # an evicted tail/shared/orphan chunk came back: that was a reuse
            self.reuse.returned(old[0], now)
        self._used += size
        if self._used > self._hwm:
            self._hwm = self._used
        if ctx is not None and not ctx[1]:
            sess = ctx[0]
            sess.keys[key] = size
            sess.nbytes += size
            keys[key] = sess
            if not sess.filed and sess.cls >= 0:
                self._refile(sess, now)
        else:
            if ctx is not None:
                u = KeyUnit(key, size, TAIL, now, owner=ctx[0])
                cls = self.C_TAIL
            elif old is not None and old[1] == SHARED and self.cfg.use_shared:
                u = KeyUnit(key, size, SHARED, now)
                u.count = old[2] + 1
                cls = self._shared_class(u.count)
            else:
                u = KeyUnit(key, size, ORPHAN, now)
                cls = self.C_ORPHAN
            u.seq = self._req_seq
            u.item = self.reuse.start(cls, now)
            keys[key] = u
            self._set_key_unit(u, cls, now)
        hv = key_hash(key, self._salt) if self._salt else ((hash(key) * _MIX) & _MASK) >> 40  # key_hash, inlined
        if not self._ghost_rate:
            self._fix_rates()
        if hv % self._ghost_rate == 0:
            self._observe(key, now)

    def on_access(self, key: Key) -> None:
        u = self._keys.get(key)
        if u is None:
            return
        now = self._clock()
        if u.__class__ is KeyUnit and (u.seq != self._req_seq or not self._req_seq):
            self._touch_key_unit(u, now)
        hv = key_hash(key, self._salt) if self._salt else ((hash(key) * _MIX) & _MASK) >> 40  # key_hash, inlined
        if not self._ghost_rate:
            self._fix_rates()
        if hv % self._ghost_rate == 0:
            self._observe(key, now)

    def on_remove(self, key: Key) -> None:
        u = self._keys.pop(key, None)
        if u is None:
            return
        lim = self._limbo.pop(key, None)
        if isinstance(u, Session):
            size = u.keys.pop(key, None)
            if size is None:  # victims() already took it out of the unit
                size = lim[1] if lim is not None else 0
            else:
                u.nbytes -= size
            if not u.keys:
                self._unfile(u)
        else:
            size = u.size
            self._unfile(u)
            self._remember_evicted(key, u)
        self._used -= size

    def victims(self, need: int, evictable: Callable[[Key], bool]) -> Iterator[Key]:
        if self._limbo:
            self._reattach_limbo()
        cross = self._cross
        if cross:
            now = self._clock()
            if cross[0][0] <= now:
                self._advance(now, self.cfg.max_rescores_per_decision)
        heap = self._heap
        pop = heapq.heappop
        limbo = self._limbo
        freed = 0
        out = []
        skipped = []
        while freed < need and heap:
            entry = heap[0]
            u = entry[3]
            if not u.filed or u.ver != entry[4]:
                pop(heap)
                continue
            if u.__class__ is KeyUnit:
                key = u.key
                pop(heap)
                if not evictable(key):
                    skipped.append(entry)
                    continue
                size = u.size
                self._unfile(u)
            else:  # a session: its deepest evictable chunk; the unit stays on top while it has chunks
                key = None
                for k in reversed(u.keys):
                    if evictable(k):
                        key = k
                        break
                if key is None:
                    skipped.append(pop(heap))
                    continue
                size = u.keys.pop(key)
                u.nbytes -= size
                if not u.keys:
                    pop(heap)
                    self._unfile(u)
            limbo[key] = (u, size)
            freed += size
            out.append(key)
        for entry in skipped:
            heapq.heappush(heap, entry)
        return iter(out)

    def _reattach_limbo(self) -> None:
        """Keys a previous victims() yielded that the caller kept: back into their units."""
        if not self._limbo:
            return
        now = self.now()
        for key, (unit, size) in list(self._limbo.items()):
            if self._keys.get(key) is not unit:
                continue
            if isinstance(unit, Session):
                unit.keys[key] = size
                unit.nbytes += size
            if not unit.filed:
                self._refile(unit, now)
        self._limbo.clear()

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: Key) -> bool:
        return key in self._keys

    # ------------------------------------------------------------------ introspection
    def memory_items(self) -> dict[str, int]:
        """Sizes of the bounded learning state (tests check they stay within the configured bounds)."""
        return {
            "sessions": len(self.sessions),
            "ghost_trace": self.ghost.memory_items(),
            "reuse_items": self.reuse.items,
            "ghost_keys": len(self._ghost_items),
            "ctx": len(self._ctx),
            "units": len(self._units),
            "heap": max(len(self._heap), len(self._cross)),
        }

    def stats(self) -> dict:
        return {
            "answers": self._answers,  #: finished requests whose answer length reached a known session
            "ghost_runs": self.ghost.runs,
            "sessions": len(self.sessions),
        }
