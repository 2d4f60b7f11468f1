"""What the answer-length policy learns from its ghost: the ghost's sampling (fixed at first use from the tier's
capacity) and the sampled accesses it records; each Belady rerun gives the h(b) table the scores use
(`scoring.ScoreTables._refresh`).

`GhostLearning` is a mixin of `AnswerLengthPolicy` (`policy.py`): it works on the policy's state, set up there."""

from __future__ import annotations

from kvtier.storage_backends.eviction.answer_length.state import PolicyState
from kvtier.storage_backends.eviction.base import Key


class GhostLearning(PolicyState):
    """The ghost's sampling and its sampled accesses (a mixin of the policy)."""

    def _observe(self, key: Key, now: float) -> None:
        """A sampled access (the key's sampling hash is 0 modulo the ghost's rate): the ghost records it; the
        tables are refreshed when Belady reran."""
        if self._use_ghost and self.ghost.record_sampled(key, now, self._capacity_blocks()):
            self._refresh()

    def _fix_rates(self) -> None:
        """The sampling rate, fixed at the first call that needs it (the capacity is known by then, if ever)."""
        if not self._ghost_rate_fixed:
            self._fix_ghost_rate()
        self._ghost_rate = self.ghost.sample_rate if self._use_ghost else 1 << 62

    def _fix_ghost_rate(self) -> None:
        """Automatic ghost sampling, fixed at first use: about `ghost_capacity` sampled chunks of capacity (a
        larger tier samples fewer keys, so its window spans longer reuse times at the same cost); 8 when the
        tier never said its capacity. At a rate above 8, Belady first runs after as many accesses (of all keys)
        as it would at rate 8, so the first estimates come no later than at rate 8; later runs keep the
        `ghost_refresh` cadence of sampled accesses."""
        self._ghost_rate_fixed = True
        if self.capacity:
            rate = max(1, round(self._capacity_blocks() / max(1, self.cfg.ghost_capacity)))
            g = self.ghost
            g.sample_rate = rate
            g.first_run = max(64, min(g.first_run, round(g.first_run * 8 / rate)))
