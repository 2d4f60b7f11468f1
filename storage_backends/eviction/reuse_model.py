"""Online, censoring-aware estimate of *when* (and whether) something is reused, per class of thing.

An *item* is one wait for a reuse: a session waiting for its next turn, a shared chunk waiting for its next read,
a request's tail chunk waiting for any read. Items start, and either return (reuse) or reach the horizon (never).
Per class and reuse-time bucket it keeps a Kaplan-Meier style hazard: returns in the bucket / items that were at
risk through the whole bucket. Items still waiting are counted only for the buckets they have fully lived through,
so young items do not bias the estimate towards "never" (right-censoring). Classes borrow strength from a pooled
prior of their family (`prior_of`), so sparse classes start at the family's hazard.

Estimates are computed with numpy (a refresh of hundreds of rows costs well under a millisecond).
`potential_table(hit_prob)` folds the hazards with the ghost cache's P(hit | bucket) into, for every class and
elapsed bucket e, the *hit potential*: P(the next reuse happens, in bucket b >= e, and would be a hit | no reuse
during buckets < e) = sum_b hazard_b * prod_{e<=j<b}(1 - hazard_j) * hit_prob_b.

Memory: at most `max_items` waiting items (new ones are not tracked beyond it) and O(classes x buckets) counters.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable

import numpy as np

from kvtier.storage_backends.eviction.ghost_cache import ReuseBuckets

logger = logging.getLogger(__name__)


class Item:
    """One wait for a reuse."""

    __slots__ = ("start", "cls", "alive", "answer", "weight", "timing", "counted")

    def __init__(self, start: float, cls: int, weight: float = 1.0) -> None:
        self.start = start
        self.cls = cls
        self.weight = weight  #: how much it counts (chunks: hazards are per chunk, not per session)
        self.alive = True
        self.counted = 0  #: buckets already counted as lived through (at risk, no reuse)
        self.answer: int | None = None  #: answer-length bucket of the turn it waits after (sessions only)
        self.timing: int | None = None  #: timing key (answer / previous-gap bucket) for the timing ratios


class ReuseModel:
    def __init__(
        self,
        buckets: ReuseBuckets,
        n_classes: int,
        prior_of: Callable[[int], int] | None = None,
        prior_strength: float = 8.0,
        max_items: int = 200_000,
        count_cap: float = 50_000.0,
        empty_hazard: float = 0.0,
        min_family_risk: float = 5.0,
        n_timing: int = 0,
        granularity: float = 1.0,
    ) -> None:
        self.granularity = granularity  #: seconds between two counting passes over the waiting items
        self.empty_hazard = empty_hazard  #: hazard assumed where a family has no data at all
        self.min_family_risk = min_family_risk
        self.buckets = buckets
        self.n_classes = n_classes
        self.prior_of = prior_of or (lambda c: 0)
        self.prior_strength = prior_strength
        self.max_items = max_items
        self.count_cap = count_cap
        K = len(buckets)
        self.events = np.zeros((n_classes, K))  # [class, bucket]
        self.at_risk = np.zeros((n_classes, K))
        # Per timing key (Item.timing: e.g. answer-length x previous-gap bucket), pooled over classes: *when*
        # items with that key return, relative to all keyed items (`timing_ratios`).
        self.n_timing = n_timing
        self.timing_events = np.zeros((n_timing, K))  # [key, bucket]
        self.timing_at_risk = np.zeros((n_timing, n_classes, K))  # [key, class, bucket]
        self._queues: list[deque[Item]] = [deque() for _ in range(K)]
        self.items = 0  #: items still waiting (bounded by max_items)
        self._advanced_to = float("-inf")
        self._next_due = float("inf")  # earliest time an item completes its current bucket
        self.dropped = 0

    # -- item lifecycle
    def start(self, cls: int, now: float, weight: float = 1.0) -> Item | None:
        if self.items >= self.max_items:
            self.dropped += 1
            return None
        it = Item(now, cls, weight)
        self._queues[0].append(it)
        self.items += 1
        due = now + self.buckets.edges[0]
        if due < self._next_due:
            self._next_due = due
        return it

    def returned(self, item: Item | None, now: float) -> None:
        """The item's thing was reused at `now`."""
        if item is None or not item.alive:
            return
        item.alive = False
        self.items -= 1
        b = self.buckets.index(max(0.0, now - item.start))
        K = len(self.buckets)
        w, c, t = item.weight, item.cls, item.timing
        for k in range(item.counted, min(b, K)):  # the whole buckets it lived through, not counted yet
            self.at_risk[c, k] += w
            if t is not None:
                self.timing_at_risk[t, c, k] += w
        if b < K:
            self.events[c, b] += w
            self.at_risk[c, b] += w
            if t is not None:
                self.timing_events[t, b] += w
                self.timing_at_risk[t, c, b] += w

    def cancel(self, item: Item | None) -> None:
        """Stop tracking without counting anything (the thing was forgotten)."""
        if item is not None and item.alive:
            item.alive = False
            self.items -= 1

    def advance(self, now: float) -> None:
        """Count items that lived through whole buckets without a reuse (at most once per `granularity` seconds:
        a return counts its own lived-through buckets itself)."""
        if now < self._advanced_to + self.granularity or now < self._next_due:
            return
        self._advanced_to = now
        edges = self.buckets.edges
        K = len(edges)
        nd = float("inf")
        # summed per counter in plain Python first, added to the arrays once (numpy scalar updates are slow)
        risk: dict[tuple[int, int], float] = {}
        trisk: dict[tuple[int, int, int], float] = {}
        queues = self._queues
        for k in range(K):
            q = queues[k]
            if not q:
                continue
            edge = edges[k]
            nxt = queues[k + 1] if k + 1 < K else None
            while q and q[0].start + edge <= now:
                it = q.popleft()
                if not it.alive:
                    continue
                key = (it.cls, k)
                risk[key] = risk.get(key, 0.0) + it.weight
                if it.timing is not None:
                    tkey = (it.timing, it.cls, k)
                    trisk[tkey] = trisk.get(tkey, 0.0) + it.weight
                it.counted = k + 1
                if nxt is not None:
                    nxt.append(it)
                else:
                    it.alive = False  # never reused within the horizon
                    self.items -= 1
            if q:
                due = q[0].start + edge
                if due < nd:
                    nd = due
        ar, tar = self.at_risk, self.timing_at_risk
        for key, w in risk.items():
            ar[key] += w
        for tkey, w in trisk.items():
            tar[tkey] += w
        self._next_due = nd

    # -- estimates (vectorised: a refresh of a few hundred rows costs well under a millisecond)
    def hazards_array(self) -> np.ndarray:
        """Per class and bucket: P(reuse in bucket | no reuse before it), with a pooled family prior."""
        K = len(self.buckets)
        ev, ar = self.events, self.at_risk  # views; _cap_counts below halves in place, after the estimate
        fam = np.array([self.prior_of(c) for c in range(self.n_classes)])
        a = self.prior_strength
        prior = np.empty_like(ev)
        for f in np.unique(fam):
            sel = fam == f
            fev, far = ev[sel].sum(axis=0), ar[sel].sum(axis=0)
            # buckets nobody has lived through yet (early in a run, the long ones) carry the last observed family
            # hazard forward instead of guessing
            pr, last = np.empty(K), self.empty_hazard
            for k in range(K):
                if far[k] >= self.min_family_risk:
                    last = fev[k] / far[k]
                pr[k] = last
            prior[sel] = pr
        with np.errstate(divide="ignore", invalid="ignore"):
            shrunk = np.where(ar + a > 0, (ev + a * prior) / (ar + a), prior)
        seen = np.asarray(ar.any(axis=1))
        out = np.where(seen[:, None], shrunk, prior)  # no data at all: the family's row
        self._cap_counts()
        return out

    def hazards(self) -> list[list[float]]:
        return self.hazards_array().tolist()

    def timing_ratios_array(self, hazards: np.ndarray, strength: float = 100.0) -> np.ndarray:
        """ratio[t][k]: observed returns in bucket k of items with timing key t over the returns their own
        classes' `hazards` expect there (observed / expected, so a key is not credited for what its items'
        classes already say); `strength` pseudo-items at risk at the pooled hazard pull sparse keys towards 1."""
        obs, tar = self.timing_events, self.timing_at_risk
        exp = (tar * np.asarray(hazards)[None, :, :]).sum(axis=1)
        risk = tar.sum(axis=(0, 1))
        with np.errstate(divide="ignore", invalid="ignore"):
            prior = np.where(risk > 0, strength * obs.sum(axis=0) / risk, 0.0)
            den = exp + prior
            out = np.where(den > 0, (obs + prior) / den, 1.0)
        big = tar.sum(axis=(1, 2)) > self.count_cap
        if big.any():
            self.timing_events[big] /= 2
            self.timing_at_risk[big] /= 2
        return out

    def timing_ratios(self, hazards: list[list[float]], strength: float = 100.0) -> list[list[float]]:
        return self.timing_ratios_array(np.asarray(hazards), strength).tolist()

    def _cap_counts(self) -> None:
        """Halve a class's counters when they grow large: bounded numbers and a slow drift towards recent data."""
        big = self.at_risk.sum(axis=1) > self.count_cap
        if big.any():
            self.events[big] /= 2
            self.at_risk[big] /= 2

    def tables(
        self, hit_prob: list[float], rows: np.ndarray | None = None, stay_prob: list[float] | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """(hits, occupancy), one row per hazard row (default: `hazards_array()`), K + 1 columns (the last:
        beyond the horizon, 0). hits[r][e]: P(the next reuse happens, in bucket b >= e, and would be a hit | no
        reuse before e) = sum_b hazard_b * prod_{e<=j<b}(1 - hazard_j) * hit_prob_b, the *hit potential*.
        occupancy[r][e]: expected seconds still held from bucket e on, where `stay_prob` (default `hit_prob`:
        the chunk is held as long as the optimum would hold such a wait) is the chance of still being cached."""
        rows = self.hazards_array() if rows is None else np.asarray(rows, dtype=float)
        K = len(self.buckets)
        h = np.asarray(hit_prob, dtype=float)
        stay = h if stay_prob is None else np.asarray(stay_prob, dtype=float)
        widths = np.array([self.buckets.edges[k] - self.buckets.lower(k) for k in range(K)])
        R = rows.shape[0]
        hits = np.zeros((R, K + 1))
        occ = np.zeros((R, K + 1))
        acc_h = np.zeros(R)
        acc_o = np.zeros(R)
        for k in range(K - 1, -1, -1):
            lam = rows[:, k]
            acc_h = lam * h[k] + (1.0 - lam) * acc_h
            acc_o = stay[k] * widths[k] * (1.0 - 0.5 * lam) + (1.0 - lam) * acc_o
            hits[:, k] = acc_h
            occ[:, k] = acc_o
        return hits, occ

    def potential_table(self, hit_prob: list[float], rows: list[list[float]] | None = None) -> list[list[float]]:
        """table[c][e]: hit potential of a class-c item that has waited into bucket e (e = K: beyond horizon).
        `rows`: hazard rows to use instead of `hazards()` (e.g. with timing-reshaped rows appended)."""
        return self.tables(hit_prob, None if rows is None else np.asarray(rows))[0].tolist()

    def density_table(self, hit_prob: list[float]) -> list[list[float]]:
        return self.density_tables(hit_prob)[0]

    def density_tables(
        self, hit_prob: list[float], stay_prob: list[float] | None = None, rows: list[list[float]] | None = None
    ) -> tuple[list[list[float]], list[list[float]]]:
        """(density, occupancy) tables: density[c][e] = hits / occupancy (LHD-style hit density: expected hits
        per second still held), 0 where nothing is held; see `tables`."""
        hits, occ = self.tables(hit_prob, None if rows is None else np.asarray(rows), stay_prob)
        with np.errstate(divide="ignore", invalid="ignore"):
            dens = np.where(occ > 0, hits / occ, 0.0)
        return dens.tolist(), occ.tolist()

    def return_probability(self, cls: int) -> float:
        """P(reused within the horizon) for a fresh class-`cls` item (for reports)."""
        row = self.hazards()[cls]
        surv = 1.0
        for h in row:
            surv *= 1.0 - h
        return 1.0 - surv
