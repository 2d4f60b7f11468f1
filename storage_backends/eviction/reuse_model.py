"""Online, censoring-aware estimate of *when* (and whether) something is reused, per class of thing.

An *item* is one wait for a reuse: a session waiting for its next turn, a shared chunk waiting for its next read,
a request's tail chunk waiting for any read. Items start, and either return (reuse) or reach the horizon (never).
Per class and reuse-time bucket it keeps a Kaplan-Meier style hazard: returns in the bucket / items that were at
risk through the whole bucket. Items still waiting are counted only for the buckets they have fully lived through,
so young items do not bias the estimate towards "never" (right-censoring). Classes borrow strength from a pooled
prior of their family (`prior_of`), so sparse classes start at the family's hazard.

`potential_table(hit_prob)` folds the hazards with the ghost cache's P(hit | bucket) into, for every class and
elapsed bucket e, the *hit potential*: P(the next reuse happens, in bucket b >= e, and would be a hit | no reuse
during buckets < e) = sum_b hazard_b * prod_{e<=j<b}(1 - hazard_j) * hit_prob_b.

Memory: at most `max_items` waiting items (new ones are not tracked beyond it) and O(classes x buckets) counters.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Callable

from kvtier.storage_backends.eviction.ghost_cache import ReuseBuckets

logger = logging.getLogger(__name__)


class Item:
    """One wait for a reuse."""

    __slots__ = ("start", "cls", "alive", "answer", "weight", "timing")

    def __init__(self, start: float, cls: int, weight: float = 1.0) -> None:
        self.start = start
        self.cls = cls
        self.weight = weight  #: how much it counts (chunks: hazards are per chunk, not per session)
        self.alive = True
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
    ) -> None:
        self.empty_hazard = empty_hazard  #: hazard assumed where a family has no data at all
        self.min_family_risk = min_family_risk
        self.buckets = buckets
        self.n_classes = n_classes
        self.prior_of = prior_of or (lambda c: 0)
        self.prior_strength = prior_strength
        self.max_items = max_items
        self.count_cap = count_cap
        K = len(buckets)
        self.events = [[0.0] * K for _ in range(n_classes)]
        self.at_risk = [[0.0] * K for _ in range(n_classes)]
        # Per timing key (Item.timing: e.g. answer-length x previous-gap bucket), pooled over classes: *when*
        # items with that key return, relative to all keyed items (`timing_ratios`).
        self.n_timing = n_timing
        self.timing_events = [[0.0] * K for _ in range(n_timing)]
        self.timing_at_risk = [[[0.0] * K for _ in range(n_classes)] for _ in range(n_timing)]  # [key][class][k]
        self._queues: list[deque[Item]] = [deque() for _ in range(K)]
        self.items = 0  #: items still waiting (bounded by max_items)
        self._advanced_to = float("-inf")
        self.dropped = 0

    # -- item lifecycle
    def start(self, cls: int, now: float, weight: float = 1.0) -> Item | None:
        if self.items >= self.max_items:
            self.dropped += 1
            return None
        it = Item(now, cls, weight)
        self._queues[0].append(it)
        self.items += 1
        return it

    def returned(self, item: Item | None, now: float) -> None:
        """The item's thing was reused at `now`."""
        if item is None or not item.alive:
            return
        self.advance(now)  # count the buckets it lived through first
        item.alive = False
        self.items -= 1
        b = self.buckets.index(max(0.0, now - item.start))
        if b < len(self.buckets):
            self.events[item.cls][b] += item.weight
            self.at_risk[item.cls][b] += item.weight
            if item.timing is not None:
                self.timing_events[item.timing][b] += item.weight
                self.timing_at_risk[item.timing][item.cls][b] += item.weight

    def cancel(self, item: Item | None) -> None:
        """Stop tracking without counting anything (the thing was forgotten)."""
        if item is not None and item.alive:
            item.alive = False
            self.items -= 1

    def advance(self, now: float) -> None:
        """Count items that lived through whole buckets without a reuse."""
        if now <= self._advanced_to:
            return
        self._advanced_to = now
        edges = self.buckets.edges
        K = len(edges)
        for k in range(K):
            q = self._queues[k]
            edge = edges[k]
            nxt = self._queues[k + 1] if k + 1 < K else None
            while q and q[0].start + edge <= now:
                it = q.popleft()
                if not it.alive:
                    continue
                self.at_risk[it.cls][k] += it.weight
                if it.timing is not None:
                    self.timing_at_risk[it.timing][it.cls][k] += it.weight
                if nxt is not None:
                    nxt.append(it)
                else:
                    it.alive = False  # never reused within the horizon
                    self.items -= 1

    # -- estimates
    def hazards(self) -> list[list[float]]:
        """Per class and bucket: P(reuse in bucket | no reuse before it), with a pooled family prior."""
        K = len(self.buckets)
        fams: dict[int, tuple[list[float], list[float]]] = {}
        for c in range(self.n_classes):
            f = self.prior_of(c)
            ev, ar = fams.setdefault(f, ([0.0] * K, [0.0] * K))
            for k in range(K):
                ev[k] += self.events[c][k]
                ar[k] += self.at_risk[c][k]
        a = self.prior_strength
        # Family prior per bucket; buckets nobody has lived through yet (early in a run, the long ones) carry the
        # last observed family hazard forward instead of guessing.
        priors: dict[int, list[float]] = {}
        for f, (fev, far) in fams.items():
            pr, last = [], self.empty_hazard
            for k in range(K):
                if far[k] >= self.min_family_risk:
                    last = fev[k] / far[k]
                pr.append(last)
            priors[f] = pr
        out = []
        for c in range(self.n_classes):
            prior = priors[self.prior_of(c)]
            ev, ar = self.events[c], self.at_risk[c]
            if not any(ar):  # no data: the family's row
                out.append(prior)
                continue
            out.append([(ev[k] + a * prior[k]) / (ar[k] + a) if ar[k] + a > 0 else prior[k] for k in range(K)])
        self._cap_counts()
        return out

    def timing_ratios(self, hazards: list[list[float]], strength: float = 100.0) -> list[list[float]]:
        """ratio[t][k]: observed returns in bucket k of items with timing key t over the returns their own
        classes' `hazards` expect there (observed / expected, so a key is not credited for what its items'
        classes already say); `strength` pseudo-items at risk at the pooled hazard pull sparse keys towards 1."""
        K = len(self.buckets)
        n = self.n_timing
        obs = [[self.timing_events[t][k] for k in range(K)] for t in range(n)]
        exp = [[sum(ar[k] * hazards[c][k] for c, ar in enumerate(self.timing_at_risk[t]) if ar[k])
                for k in range(K)] for t in range(n)]
        risk = [sum(sum(ar[k] for ar in self.timing_at_risk[t]) for t in range(n)) for k in range(K)]
        prior = [strength * (sum(obs[t][k] for t in range(n)) / risk[k]) if risk[k] > 0 else 0.0 for k in range(K)]
        out = []
        for t in range(n):
            out.append([(obs[t][k] + prior[k]) / (exp[t][k] + prior[k]) if exp[t][k] + prior[k] > 0 else 1.0
                        for k in range(K)])
        for t in range(n):
            if sum(sum(ar) for ar in self.timing_at_risk[t]) > self.count_cap:
                self.timing_events[t] = [x / 2 for x in self.timing_events[t]]
                self.timing_at_risk[t] = [[x / 2 for x in ar] for ar in self.timing_at_risk[t]]
        return out

    def _cap_counts(self) -> None:
        """Halve a class's counters when they grow large: bounded numbers and a slow drift towards recent data."""
        for c in range(self.n_classes):
            if sum(self.at_risk[c]) > self.count_cap:
                self.events[c] = [x / 2 for x in self.events[c]]
                self.at_risk[c] = [x / 2 for x in self.at_risk[c]]

    def potential_table(self, hit_prob: list[float], rows: list[list[float]] | None = None) -> list[list[float]]:
        """table[c][e]: hit potential of a class-c item that has waited into bucket e (e = K: beyond horizon).
        `rows`: hazard rows to use instead of `hazards()` (e.g. with timing-reshaped rows appended)."""
        K = len(self.buckets)
        table = []
        for row in (rows if rows is not None else self.hazards()):
            pot = [0.0] * (K + 1)
            acc = 0.0
            for k in range(K - 1, -1, -1):
                acc = row[k] * hit_prob[k] + (1.0 - row[k]) * acc
                pot[k] = acc
            table.append(pot)
        return table

    def density_table(self, hit_prob: list[float]) -> list[list[float]]:
        return self.density_tables(hit_prob)[0]

    def density_tables(
        self, hit_prob: list[float], stay_prob: list[float] | None = None, rows: list[list[float]] | None = None
    ) -> tuple[list[list[float]], list[list[float]]]:
        """(density, occupancy) tables; occupancy[c][e] = expected chunk-seconds still held from bucket e on.

        table[c][e]: hit *density* (LHD-style) of a class-c item that has waited into bucket e: expected hits
        divided by expected chunk-seconds it will still occupy the tier. `hit_prob[b]` doubles as the chance
        the chunk is still cached in bucket b, so occupancy stops where the ghost says the optimum lets go;
        `stay_prob[b]`, when given, replaces it for the occupancy (the tier's own residency curve); `rows` as
        in `potential_table`."""
        stay = stay_prob if stay_prob is not None else hit_prob
        K = len(self.buckets)
        widths = [self.buckets.edges[k] - self.buckets.lower(k) for k in range(K)]
        table = []
        occs = []
        memo: dict[int, tuple[list[float], list[float]]] = {}
        for row in (rows if rows is not None else self.hazards()):
            if id(row) in memo:  # classes without data share their family's row
                d, o = memo[id(row)]
                table.append(d)
                occs.append(o)
                continue
            dens = [0.0] * (K + 1)
            occ_row = [0.0] * (K + 1)
            hits = 0.0
            occ = 0.0
            for k in range(K - 1, -1, -1):
                lam, h = row[k], hit_prob[k]
                hits = lam * h + (1.0 - lam) * hits
                occ = stay[k] * widths[k] * (1.0 - 0.5 * lam) + (1.0 - lam) * occ
                dens[k] = hits / occ if occ > 0 else 0.0
                occ_row[k] = occ
            table.append(dens)
            occs.append(occ_row)
            memo[id(row)] = (dens, occ_row)
        return table, occs

    def return_probability(self, cls: int) -> float:
        """P(reused within the horizon) for a fresh class-`cls` item (for reports)."""
        row = self.hazards()[cls]
        surv = 1.0
        for h in row:
            surv *= 1.0 - h
        return 1.0 - surv
