"""What the answer-length policy learns from its ghost: the ghost's sampling (fixed at first use from the tier's
capacity), its sampled accesses and the Belady labels it gives back, and the reuse predictor those labels train:
the features of a turn and of a unit, the class model's log-odds as the predictor's offset, and the progressive
validation that gates its correction.

`GhostLearning` is a mixin of `AnswerLengthPolicy` (`policy.py`): it works on the policy's state, set up there."""

from __future__ import annotations

import itertools
import math
from bisect import bisect_right
from collections.abc import Sequence

from kvtier.storage_backends.eviction.answer_length.features import (
    ANSWER_EDGES,
    CHAIN_EDGES,
    DEPTH_EDGES,
    GAP_EDGES,
    HIST,
    NEW_EDGES,
    SHARE_EDGES,
    SHARED,
    TAIL,
    KeyUnit,
    Turn,
    bucket_of,
    log_loss,
    logit,
)
from kvtier.storage_backends.eviction.base import Key
from kvtier.storage_backends.eviction.sessions import Session


class GhostLearning:
    """Ghost sampling and labels, and the reuse predictor's features and gate (a mixin of the policy)."""

    # ------------------------------------------------------------------ predictor features
    def _turn(self, s: Session, chain: Sequence[Key], follow_up: bool) -> Turn:
        hits = 1
        if follow_up:
            repeated = len(chain) - s.new_blocks
            keys = self._keys
            n = sum(1 for k in itertools.islice(chain, repeated) if k in keys)
            hits = 2 if n == 0 else (4 if n >= repeated else 3)
        return self.turn_features(s.depth, s.new_blocks, len(chain), s.prev_gap, hits)

    def turn_features(self, depth: int, new_blocks: int, chain_len: int, prev_gap: float | None,
                      hits: int = 1) -> Turn:
        """The predictor's view of a turn (`hits`: 1 first turn, 2 none / 3 part / 4 all of its history was
        resident); the answer is added when the turn finishes."""
        cfg = self.cfg
        pace = 0
        if cfg.gap_timing:
            pace = 1 if prev_gap is None else 2 + bucket_of(prev_gap, GAP_EDGES)
        return Turn(
            1 + bucket_of(depth, DEPTH_EDGES) if cfg.use_depth else 0,
            1 + bucket_of(new_blocks, NEW_EDGES) if cfg.use_new_blocks else 0,
            1 + bucket_of(chain_len, CHAIN_EDGES) if cfg.use_chain else 0,
            pace,
            hits if cfg.use_hit_history else 0,
        )

    def session_features(self, turn: Turn, answer_tokens: int | None) -> tuple[int, ...]:
        """Features of a session's history chunks after `turn` (with its answer length, if known)."""
        if answer_tokens is not None and self.cfg.use_answer_length:
            turn.answer = 1 + bucket_of(answer_tokens, ANSWER_EDGES)
        return self._features(turn, HIST, 0)

    def _features(self, turn: Turn | None, kind: int, reads: int) -> tuple[int, ...]:
        r = 1 + bucket_of(reads, SHARE_EDGES) if (reads and self.cfg.use_reads) else 0
        if turn is None:
            return (kind, 0, 0, 0, 0, 0, 0, r)
        return (kind, turn.depth, turn.new, turn.chain, turn.answer, turn.pace, turn.hits, r)

    def _row_of(self, x: tuple[int, ...]) -> int:
        """The score-table row of a unit with features x (the class model's view of it)."""
        kind = x[0]
        if kind == HIST:
            cls = max(0, x[1] - 1) * self._nz + max(0, x[2] - 1)
            if self._n_timing and x[4] > 0:
                a = (x[4] - 1) if self._na_t > 1 else 0
                g = max(0, x[5] - 1) if self._ng_t > 1 else 0
                return self._timed_row(cls, a * self._ng_t + g)
            return cls
        if kind == TAIL:
            return self.C_TAIL
        if kind == SHARED:
            return self._shared_class(max(2, self._reads_of(x[7])))
        return self.C_ORPHAN

    @staticmethod
    def _reads_of(value: int) -> int:
        return (1, 1, 3, 5, 9, 17)[value]  # smallest read count of a "reads" feature value

    # ------------------------------------------------------------------ labels and the gate
    def _offset_of(self, x: tuple[int, ...]) -> float:
        """The class model's log-odds for what a label says: a hit on a reuse within the ghost's label horizon
        (cached per feature tuple until the tables or the ghost change)."""
        ghost = self.ghost
        stamp = (self._epoch, ghost._version)
        if self._off_stamp != stamp:
            self._off_stamp = stamp
            self._off_cache.clear()
        z = self._off_cache.get(x)
        if z is not None:
            return z
        row = self._row_of(x)
        b = bisect_right(self._edges, ghost.label_horizon())
        h = self._hits.item(row, 0)
        if b < len(self._edges):  # minus the hits after the horizon: survival to bucket b times hits from b on
            h -= self._surv.item(row, b) * self._hits.item(row, b)
        z = logit(h)
        if len(self._off_cache) < 65536:
            self._off_cache[x] = z
        return z

    def _on_label(self, ctx: tuple, label: bool, gap: float | None) -> None:
        """The ghost labelled a sampled past access: score the predictor on it (before it learns from it:
        progressive validation), then train it on it."""
        turn, kind, reads = ctx
        x = self._features(turn, kind, reads)
        if self.predictor.fits:
            # the intercept absorbs how the labels' horizon differs from the class model's; what counts is
            # whether the features' corrections predict better than the recalibrated class model alone
            base = self._offset_of(x) + self.predictor.bias
            full = base + self.predictor.shift(x) - self.predictor.bias
            gain = log_loss(base, label) - log_loss(full, label)  # > 0: the corrections predicted better
            d = self.cfg.gate_decay
            self._gate_gain = d * self._gate_gain + gain
            self._gate_n = d * self._gate_n + 1.0
            self._gate_open = (self._gate_n >= self.cfg.gate_min_labels
                               and self._gate_gain > self.cfg.gate_margin * self._gate_n)
        self.predictor.add(x, label)

    def _odds(self, x: tuple[int, ...] | None) -> float:
        """The predictor's odds ratio for a unit with features x (1: no correction)."""
        if x is None:
            return 1.0
        return math.exp(max(-20.0, min(20.0, self.predictor.shift(x) - self.predictor.bias)))

    # ------------------------------------------------------------------ the ghost's sample
    def _ghost_ctx(self, u: Session | KeyUnit) -> tuple:
        if isinstance(u, Session):
            return (u.turn, HIST, 0)
        if u.kind == TAIL:
            return (u.owner.turn if u.owner is not None else None, TAIL, 0)
        return (None, u.kind, u.count)

    def _observe(self, key: Key, u: Session | KeyUnit, now: float) -> None:
        """A sampled access (the key's sampling hash is 0 modulo the ghost's rate): the ghost records it."""
        if self._use_ghost and self.ghost.record_sampled(key, now, self._capacity_blocks(), self._ghost_ctx(u)):
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
