"""The answer-length policy's scores: the rows of its score tables (classes and timed rows), the tables themselves
(expected hits and occupancy per row and elapsed bucket, from the reuse model and the ghost's h, with the
answer-length lower bound), and the lazy min-heap of unit scores with its second heap of bucket crossings.

`ScoreTables` is a mixin of `AnswerLengthPolicy` (`policy.py`): it works on the policy's state, set up there."""

from __future__ import annotations

import heapq
import math
from bisect import bisect_right

import numpy as np

from kvtier.storage_backends.eviction.answer_length.features import (
    DEPTH_EDGES,
    GAP_EDGES,
    NEW_EDGES,
    SHARE_EDGES,
    KeyUnit,
    bucket_of,
)
from kvtier.storage_backends.eviction.answer_length.state import PolicyState
from kvtier.storage_backends.eviction.sessions import Session


class ScoreTables(PolicyState):
    """Table rows, score tables and the score heap (a mixin of the policy)."""

    # ------------------------------------------------------------------ classes and tables
    def _hist_class(self, depth: int, new_blocks: int = 0) -> int:
        d = bucket_of(depth, DEPTH_EDGES) if self.cfg.use_depth else 0
        z = bucket_of(new_blocks, NEW_EDGES) if self.cfg.use_new_blocks else 0
        return d * self._nz + z

    def _timing_key(self, answer_bucket: int, prev_gap: float | None) -> int:
        a = answer_bucket if self._na_t > 1 else 0
        g = 0 if (self._ng_t == 1 or prev_gap is None) else 1 + bucket_of(prev_gap, GAP_EDGES)
        return a * self._ng_t + g

    def _timed_row(self, cls: int, t: int) -> int:
        return self._n_base + cls * self._n_timing + t

    def _shared_class(self, count: int) -> int:
        return self.C_SHARED0 + bucket_of(count, SHARE_EDGES)

    def _capacity_blocks(self) -> int:
        cap = self.capacity or self._hwm
        mean = self._used / len(self._keys) if self._keys else 1.0
        return max(1, int(cap / max(mean, 1e-9)))

    def _refresh(self) -> None:
        cfg = self.cfg
        if cfg.use_answer_length:
            for a, hist in enumerate(self._lb_hist):
                n = sum(hist)
                if n < cfg.lb_min_samples:
                    self._lb_bucket[a] = 0
                    continue
                acc, target = 0, cfg.lb_quantile * n
                for b, c in enumerate(hist):
                    acc += c
                    if acc > target:
                        self._lb_bucket[a] = b
                        break
        rows = self.reuse.hazards_array()
        if self._n_timing:
            ratios = self.reuse.timing_ratios_array(rows, cfg.timing_strength)
            timed = np.minimum(1.0, rows[: self.C_TAIL, None, :] * ratios[None, :, :])
            rows = np.vstack([rows, timed.reshape(-1, rows.shape[1])])  # row n_base + cls * n_timing + t
        self._h = self.ghost.hit_prob if cfg.use_ghost else [1.0] * len(self.buckets)
        self._hits, occ = self.reuse.tables(self._h, rows)
        self._occ = occ if cfg.score == "density" else None
        self._since_refresh = 0
        self._epoch += 1
        if self._units:  # every score may have moved: rebuild both heaps from fresh scores
            self._heap, self._cross = [], []
            now = self.now()
            for u in list(self._units.values()):
                self._rescore(u, now, push=False)
            heapq.heapify(self._heap)
            heapq.heapify(self._cross)

    # ------------------------------------------------------------------ scores
    def _hit_chance(self, u: Session | KeyUnit, hits: float) -> float:
        """A unit's expected hits (> 0), as the tables give them. An analysis hook, never changed in serving:
        `benchmarks/eviction_ceiling.py`'s subclass scales them by an outside odds ratio."""
        return hits

    def _rescore(self, u: Session | KeyUnit, now: float, push: bool = True) -> None:
        """Compute u's score now and (re)file it in the eviction heap; schedule its next bucket crossing
        (`push=False`: append to the heaps' lists, the caller heapifies)."""
        age = now - u.last_time
        e = bisect_right(self._edges, age) if self._use_elapsed else 0
        cls = u.cls
        occ = self._occ
        if e < u.lb:  # the next turn cannot come before the answer-length lower bound
            e2 = u.lb
            H = self._hits.item(cls, e2)
            if occ is not None:
                o = occ.item(cls, e2) + (self._lower[e2] - age) * self._h[e2]  # ... and it sits idle until then
        else:
            H = self._hits.item(cls, e)
            if occ is not None:
                o = occ.item(cls, e)
        if H > 0.0:
            H = self._hit_chance(u, H)
        score = H if occ is None else (H / o if o > 0.0 else 0.0)
        size: float
        if isinstance(u, KeyUnit):
            size = u.size
        else:
            n = len(u.keys)
            size = u.nbytes / n if n else 1.0
        if size != 1 and self._keys:
            score *= self._used / (len(self._keys) * size)  # per byte (relative to the mean chunk)
        u.ver += 1
        if not u.filed:
            u.filed = True
            self._units[id(u)] = u
        seq = next(self._seq)
        entry = (score, u.last_time, seq, u, u.ver)
        u.entry = entry
        u.epoch = self._epoch
        u.until = u.last_time + self._edges[e] if e < self._n_edges else math.inf
        if push:
            heapq.heappush(self._heap, entry)
            if e < self._n_edges:
                heapq.heappush(self._cross, (u.until, seq, u, u.ver))
        else:
            self._heap.append(entry)
            if e < self._n_edges:
                self._cross.append((u.until, seq, u, u.ver))

    def _unfile(self, u: Session | KeyUnit) -> None:
        """Out of the heap (its entries are skipped while it is not filed; `_refile` may put it back)."""
        if u.filed:
            u.filed = False
            del self._units[id(u)]

    def _refile(self, u: Session | KeyUnit, now: float) -> None:
        """File a unit that has resident chunks again: with its last score when nothing it depends on changed
        since (no touch, no table refresh, no bucket crossing), else with a fresh one."""
        entry = u.entry
        if entry is not None and entry[4] == u.ver and u.epoch == self._epoch and now < u.until:
            u.filed = True
            self._units[id(u)] = u
            heapq.heappush(self._heap, entry)
        else:
            self._rescore(u, now)

    def _compact(self) -> None:
        self._heap = [x for x in self._heap if x[3].filed and x[4] == x[3].ver]
        heapq.heapify(self._heap)
        self._cross = [x for x in self._cross if x[2].filed and x[3] == x[2].ver]
        heapq.heapify(self._cross)

    def _advance(self, now: float, budget: int = -1) -> None:
        """Re-score the units whose age crossed a bucket edge since the last call (at most `budget` of them when
        it is >= 0: a decision's latency stays bounded; the rest wait for the next call)."""
        cross = self._cross
        while cross and cross[0][0] <= now and budget != 0:
            _, _, u, ver = heapq.heappop(cross)
            if u.filed and u.ver == ver:
                self._rescore(u, now)
                budget -= 1

    def score(self, unit: Session | KeyUnit) -> float | None:
        """The unit's current score (lowest goes first); None when it is not filed (tests and reports)."""
        if not unit.filed:
            return None
        return next((x[0] for x in self._heap if x[3] is unit and x[4] == unit.ver), None)
