"""`adaptive`: the production eviction policy. Full-size shadow caches of several experts (answer-length and the
classic policies) score themselves on every access; the tier follows the expert that leads on recent traffic.

Each expert runs alone in a shadow cache of the tier's capacity (keys and sizes only, no data): every access of the
tier (a hit, `on_access`, or a miss being stored, `on_insert`) is replayed into every shadow, which evicts by its own
expert. The experts are compared on units of traffic, a request's accesses (between the request calls of the
session signals; an access alone where the tier hears none): for every pair of experts the difference of their
shadows' hits in a unit and its square are summed, decaying with a half-life of `half_life` times the tier's
capacity in entries (`min_half_life` accesses at least). Another expert takes the lead when its summed difference
against the leader exceeds `switch_z` times the root of the summed squares: a paired test on whole requests, since
a request's chunks hit or miss together (counting chunks as independent made noise look like a lead and the tier
flapped between experts on the Poisson trace).

The tier's own contents follow the leader's shadow: a victim is first a resident key that the leader's shadow no
longer holds (oldest such key first); when there is none, the leader's shadow makes room for the incoming entry
right then (as the expert alone does before an insert) and its victims go; the least recently used resident is the
last resort (pinned keys). When the leader stays, the tier holds exactly what the leader's shadow holds (with one
expert the tier IS that expert, access for access); after a switch the old leader's residents go first, so it
converges to the new leader as misses arrive. So the tier's hit rate tracks the best expert's wherever the
experts' advantages last longer than the half-life, and no single expert's failure mode (a trace whose session
signals carry nothing, a size where recency wins) becomes the tier's.

Cost: one access per expert per tier access (the answer-length expert dominates; the classic ones are dict
operations), plus the tier's own ordered dict. Memory: each shadow holds at most the capacity's keys; the
answer-length expert's learning state is bounded by its own limits (`AnswerLengthConfig`).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, fields

from kvtier.storage_backends.eviction.base import EvictionPolicy, Key, make_policy, register_policy


@dataclass(frozen=True)
class AdaptiveConfig:
    #: the experts, each a registered production policy; the first is the leader until another leads
    experts: tuple[str, ...] = ("answer-length", "arc", "s3fifo", "lru")
    #: half-life of the counts, in multiples of the capacity (in entries) worth of accesses
    half_life: float = 2.0
    #: fewest accesses of half-life (small tiers still compare over enough traffic)
    min_half_life: int = 10_000
    #: another expert leads once, on the accesses where it and the leader disagree, its extra hits exceed the
    #: leader's by this many standard deviations (a sign test on decayed counts)
    switch_z: float = 2.0
    #: keyword arguments of the answer-length expert (its `AnswerLengthConfig` fields)
    answer_length: dict = field(default_factory=dict)


class _Shadow:
    """One expert alone in a cache of the tier's capacity: keys and sizes only."""

    __slots__ = ("policy", "resident", "used")

    def __init__(self, policy: EvictionPolicy) -> None:
        self.policy = policy
        self.resident: dict[Key, int] = {}
        self.used = 0

    def access(self, key: Key, size: int, capacity: int, dropped: list[Key] | None) -> bool:
        """Replay one access; True on a shadow hit. Keys the shadow evicts are appended to `dropped`."""
        if key in self.resident:
            self.policy.on_access(key)
            return True
        if size > capacity or not self.make_room(size, capacity, dropped):
            return False  # the expert found no room: the key stays out of its cache
        self.resident[key] = size
        self.used += size
        self.policy.on_insert(key, size)
        return False

    def make_room(self, size: int, capacity: int, dropped: list[Key] | None) -> bool:
        """Evict by the expert until `size` more fits; False if it cannot."""
        need = self.used + size - capacity
        if need <= 0:
            return True
        for v in self.policy.victims(need, _always):
            vsize = self.resident.pop(v)
            self.policy.on_remove(v)
            self.used -= vsize
            need -= vsize
            if dropped is not None:
                dropped.append(v)
            if need <= 0:
                return True
        return False


def _always(_key: Key) -> bool:
    return True


@register_policy
class AdaptivePolicy(EvictionPolicy):
    name = "adaptive"

    def __init__(self, clock=None, capacity: int | None = None, config: AdaptiveConfig | None = None, **kw) -> None:
        super().__init__(clock)
        cfg = config or AdaptiveConfig()
        if kw:
            known = {f.name for f in fields(AdaptiveConfig)}
            bad = sorted(set(kw) - known)
            if bad:
                raise ValueError(f"adaptive: unknown setting(s) {', '.join(bad)}; known: {', '.join(sorted(known))}")
            cfg = AdaptiveConfig(**{**{f.name: getattr(cfg, f.name) for f in fields(AdaptiveConfig)}, **kw})
        if not cfg.experts or len(set(cfg.experts)) != len(cfg.experts):
            raise ValueError(f"adaptive: experts must be distinct registered policies, got {cfg.experts!r}")
        if "adaptive" in cfg.experts:
            raise ValueError("adaptive: an expert cannot be adaptive itself")
        if not (cfg.half_life > 0 and cfg.min_half_life >= 1 and cfg.switch_z >= 0):
            raise ValueError("adaptive: half_life > 0, min_half_life >= 1 and switch_z >= 0 are required")
        self.config = cfg
        self.shadows: list[_Shadow] = []
        for name in cfg.experts:
            kwargs = dict(cfg.answer_length) if name == "answer-length" else {}
            self.shadows.append(_Shadow(make_policy(name, clock=self._clock, **kwargs)))
        n = len(self.shadows)
        self.hits = [0.0] * n  #: decayed shadow hits per expert (times `_gain`)
        #: diff[i][j], sq[i][j]: decayed sums (times `_gain`) over units (a request's accesses) of d and d * d, where d
        #: is expert i's shadow hits minus expert j's in the unit
        self.diff = [[0.0] * n for _ in range(n)]
        self.sq = [[0.0] * n for _ in range(n)]
        self._unit = [0] * n  # each expert's shadow hits in the current unit
        self._requests = 0  # request boundaries heard (on_request); none: every access is a unit
        self.leader = 0
        self.switches = 0
        self._resident: OrderedDict[Key, int] = OrderedDict()  # the tier's entries, least recently used first
        self._doomed: OrderedDict[Key, None] = OrderedDict()  # resident keys the leader's shadow no longer holds
        self._high_water = 0
        self._used_bytes = 0
        self._gain = 1.0  # counts are stored multiplied by this (it grows instead of every count decaying)
        self._half = 0.0  # the half-life the growth step was computed for
        self._step = 1.0
        self._accesses = 0
        if capacity is not None:
            self.set_capacity(capacity)

    # ------------------------------------------------------------------ sizing
    def set_capacity(self, capacity: int) -> None:
        super().set_capacity(capacity)
        for s in self.shadows:
            s.policy.set_capacity(capacity)

    def _capacity(self) -> int:
        return self.capacity if self.capacity is not None else self._high_water

    def _half_life(self) -> float:
        """Accesses per halving of the counts: `half_life` capacities' worth of entries (mean entry size)."""
        entries = 1
        if self._resident:
            entries = max(1, round(self._capacity() * len(self._resident) / max(self._used_bytes, 1)))
        return max(float(self.config.min_half_life), self.config.half_life * entries)

    # ------------------------------------------------------------------ accesses
    def _observe(self, key: Key, size: int) -> None:
        """Replay one tier access into every shadow and count each expert's hits in the current request."""
        cap = self._capacity()
        lead = self.leader
        dropped: list[Key] = []
        if not self._accesses & 255:  # the mean entry size moves slowly: recompute now and then
            hl = self._half_life()
            if hl != self._half:
                self._half = hl
                self._step = 2.0 ** (1.0 / hl)
        self._gain *= self._step
        if self._gain > 1e100:  # renormalise before floats overflow
            self._rescale()
        g = self._gain
        unit = self._unit
        for i, shadow in enumerate(self.shadows):
            if shadow.access(key, size, cap, dropped if i == lead else None):
                self.hits[i] += g
                unit[i] += 1
        for v in dropped:
            if v in self._resident:
                self._doomed[v] = None
        self._doomed.pop(key, None)
        if key not in self.shadows[lead].resident and key in self._resident:
            self._doomed[key] = None  # the leader's shadow had no room for it
        self._accesses += 1
        if not self._requests:
            self._settle()  # no request boundaries reach this tier: every access is its own unit

    def _settle(self) -> None:
        """Close the current unit (a request's accesses): add each pair's hit difference to the decayed sums, then
        let an expert take the lead if it beats the leader on the units where they differ."""
        unit = self._unit
        if not any(unit):
            return
        g = self._gain
        n = len(unit)
        for i in range(n):
            for j in range(i + 1, n):
                d = unit[i] - unit[j]
                if d:
                    self.diff[i][j] += g * d
                    self.diff[j][i] -= g * d
                    self.sq[i][j] += g * d * d
                    self.sq[j][i] += g * d * d
        self._unit = [0] * n
        lead, z = self.leader, self.config.switch_z
        best, best_margin = lead, 0.0
        for i in range(n):
            if i == lead:
                continue
            margin = self.diff[i][lead] / g - z * math.sqrt(self.sq[i][lead] / g)
            if margin > best_margin:
                best, best_margin = i, margin
        if best != lead:
            self._switch(best)

    def _rescale(self) -> None:
        g = self._gain
        self.hits = [h / g for h in self.hits]
        self.diff = [[w / g for w in row] for row in self.diff]
        self.sq = [[w / g for w in row] for row in self.sq]
        self._gain = 1.0

    def _switch(self, leader: int) -> None:
        self.leader = leader
        self.switches += 1
        held = self.shadows[leader].resident
        self._doomed = OrderedDict((k, None) for k in self._resident if k not in held)

    # ------------------------------------------------------------------ EvictionPolicy
    def on_insert(self, key: Key, size: int = 1) -> None:
        if key in self._resident:
            self._used_bytes -= self._resident[key]
        self._resident[key] = size
        self._resident.move_to_end(key)
        self._used_bytes += size
        if self.capacity is None:
            self._high_water = max(self._high_water, self._used_bytes)
        self._observe(key, size)

    def on_access(self, key: Key) -> None:
        size = self._resident.get(key)
        if size is None:
            return
        self._resident.move_to_end(key)
        self._observe(key, size)

    def on_remove(self, key: Key) -> None:
        size = self._resident.pop(key, None)
        if size is not None:
            self._used_bytes -= size
        self._doomed.pop(key, None)

    def victims(self, need: int, evictable: Callable[[Key], bool]) -> Iterator[Key]:
        # First the residents the leader's shadow dropped (oldest first). When there are none, the leader's shadow
        # makes room for the incoming entry now, as the expert alone would before inserting it (its victims become
        # the dropped residents), instead of when it hears the access. Last, the least recently used resident.
        # The tier's dicts change between yields (the caller removes each victim): they are scanned afresh each time.
        freed = 0
        taken: set[Key] = set()
        made_room = False

        def free(k: Key) -> bool:
            return k in self._resident and k not in taken and evictable(k)

        while freed < need:
            key = next((k for k in self._doomed if free(k)), None)
            if key is None and not made_room:
                made_room = True
                self._leader_makes_room(need)
                continue
            if key is None:
                key = next((k for k in self._resident if free(k)), None)
                if key is None:
                    return
            taken.add(key)
            freed += self._resident[key]
            yield key

    def _leader_makes_room(self, need: int) -> None:
        """The leader's shadow evicts for the entry the tier is making room for; its victims become doomed."""
        size = need + self.capacity - self._used_bytes if self.capacity is not None else need  # the incoming entry
        dropped: list[Key] = []
        self.shadows[self.leader].make_room(max(size, 1), self._capacity(), dropped)
        for v in dropped:
            if v in self._resident:
                self._doomed[v] = None

    def __len__(self) -> int:
        return len(self._resident)

    def __contains__(self, key: Key) -> bool:
        return key in self._resident

    # ------------------------------------------------------------------ session signals
    def on_request(self, chain: Sequence[Key], now: float | None = None) -> None:
        self._settle()
        self._requests += 1
        for s in self.shadows:
            s.policy.on_request(chain, now)

    def on_request_finished(self, chain: Sequence[Key], answer_tokens: int, now: float | None = None) -> None:
        self._settle()
        for s in self.shadows:
            s.policy.on_request_finished(chain, answer_tokens, now)

    # ------------------------------------------------------------------ reporting
    def stats(self) -> dict:
        out: dict = {"leader": self.config.experts[self.leader], "switches": self.switches, "accesses": self._accesses}
        for name, h in zip(self.config.experts, self.hits, strict=True):
            out[f"recent_hits_{name}"] = round(h / self._gain, 1)
        return out

    def memory_items(self) -> dict[str, int]:
        """Entries held: the tier's, and each shadow's (each at most the capacity's)."""
        out = {"resident": len(self._resident), "doomed": len(self._doomed)}
        for name, s in zip(self.config.experts, self.shadows, strict=True):
            out[f"shadow_{name}"] = len(s.resident)
        return out


__all__ = ["AdaptiveConfig", "AdaptivePolicy"]
