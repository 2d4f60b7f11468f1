"""Rolling-origin folds for eviction replays: score a policy on successive windows of a trace, each after a warm-up
on everything before it, and report the worst window (not production code).

A window that has been scored several times has become a tuning window; one window also moves by more than the
gains worth claiming. So a fold scores requests in [`score_from_s`, `score_until_s`) only, after replaying every
earlier request in arrival order (the tiers fill and the policy learns online, as in production), and nothing after
the window is replayed. Capacities are fractions of the unique blocks of every *replayed* request (warm-up and
window: what the tier has seen by the window's end, as `kvtier replay` sizes a replayed window), so a fold's 2% is a
production-sized tier, not 2% of one five-minute window. The reported figure is the worst fold's.

- `rolling_folds()`: the Mooncake conversation trace's folds: minutes [10, 15), [15, 20), [20, 25), [25, 30).
- `rolling_folds_for(reqs, n)`: any other trace: its first third is warm-up only, the rest is cut into n equal
  scored windows.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvtier.replay.runner import Capacity, ReplayResult, parse_capacity, replay_one
from kvtier.replay.traces import TraceRequest, unique_blocks

logger = logging.getLogger(__name__)

__all__ = ["Fold", "fold_capacity", "fold_requests", "gap_closed", "replay_fold", "rolling_folds",
           "rolling_folds_for", "worst_fold"]


@dataclass(frozen=True)
class Fold:
    """Score requests with score_from_s <= timestamp < score_until_s; every earlier request is warm-up."""

    name: str
    score_from_s: float
    score_until_s: float

    def __post_init__(self) -> None:
        if not self.score_from_s < self.score_until_s:
            raise ValueError(f"fold {self.name!r}: score_from_s must be < score_until_s")


def _name(a: float, b: float) -> str:
    return f"{a / 60:g}-{b / 60:g} min" if a % 60 == 0 and b % 60 == 0 else f"{a:g}-{b:g} s"


def rolling_folds(first_score_s: float = 600.0, step_s: float = 300.0, end_s: float = 1800.0) -> list[Fold]:
    """Windows [first, first + step), [first + step, first + 2 step), ... up to end_s (the last one cut there)."""
    if step_s <= 0 or not first_score_s < end_s:
        raise ValueError("step_s > 0 and first_score_s < end_s are required")
    folds: list[Fold] = []
    i = 0
    while (a := first_score_s + i * step_s) < end_s:
        b = min(first_score_s + (i + 1) * step_s, end_s)
        folds.append(Fold(_name(a, b), a, b))
        i += 1
    return folds


def rolling_folds_for(reqs: Sequence[TraceRequest], n: int = 4, warmup_share: float = 1 / 3) -> list[Fold]:
    """Folds scaled to a trace's span: its first `warmup_share` is warm-up only, the rest n equal scored windows
    (the last one ends just after the last request, so every request after the warm-up is scored once)."""
    if not reqs or n < 1 or not 0 <= warmup_share < 1:
        raise ValueError("a non-empty trace, n >= 1 and 0 <= warmup_share < 1 are required")
    t0, t1 = min(r.timestamp for r in reqs), max(r.timestamp for r in reqs)
    if not t0 < t1:
        raise ValueError("the trace spans no time")
    first = t0 + warmup_share * (t1 - t0)
    width = (t1 - first) / n
    bounds = [first + i * width for i in range(n)] + [math.nextafter(t1, math.inf)]
    d = max(0, 1 - math.floor(math.log10(width)))  # decimals enough to tell the windows apart
    return [Fold(f"{a:.{d}f}-{b:.{d}f} s", a, b) for a, b in zip(bounds, bounds[1:])]


def fold_requests(reqs: Sequence[TraceRequest], fold: Fold) -> tuple[list[TraceRequest], list[TraceRequest]]:
    """(replayed, scored): every request before the window's end, in the given (arrival) order, and those in the
    window."""
    replayed = [r for r in reqs if r.timestamp < fold.score_until_s]
    scored = [r for r in replayed if r.timestamp >= fold.score_from_s]
    return replayed, scored


def fold_capacity(replayed: Sequence[TraceRequest], fraction: float) -> Capacity:
    """`fraction` of the unique blocks of the replayed requests (`kvtier replay`'s rounding)."""
    if not 0 < fraction <= 1:
        raise ValueError(f"capacity fraction {fraction} not in (0, 1]")
    return parse_capacity(f"{fraction:g}", unique_blocks(replayed))


def replay_fold(
    reqs: Sequence[TraceRequest],
    fold: Fold,
    policy: str,
    fraction: float,
    policy_kwargs: dict | None = None,
    decision_ns: list[int] | None = None,
) -> ReplayResult:
    """Replay `policy` on one fold at `fraction` of the replayed requests' unique blocks (`replay_one`, hits counted
    from `fold.score_from_s`)."""
    replayed, scored = fold_requests(reqs, fold)
    if not scored:
        raise ValueError(f"fold {fold.name!r}: no request to score")
    cap = fold_capacity(replayed, fraction)
    return replay_one(replayed, policy, cap, policy_kwargs=policy_kwargs, score_from=fold.score_from_s,
                      decision_ns=decision_ns)


def worst_fold(values: Mapping[str, float]) -> tuple[str, float]:
    """(fold, value) of the smallest value, the first one on ties; NaN (undefined) counts as the worst."""
    if not values:
        raise ValueError("no folds")
    return min(values.items(), key=lambda kv: -math.inf if math.isnan(kv[1]) else kv[1])


def gap_closed(hit: float, lru: float, belady: float) -> float:
    """Share of the LRU->Belady hit-rate gap that `hit` closes (NaN when Belady does not beat LRU)."""
    return (hit - lru) / (belady - lru) if belady > lru else math.nan
