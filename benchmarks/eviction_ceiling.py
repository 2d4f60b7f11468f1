"""How much a better "will this conversation come back in time" predictor could still gain, on the TUNING half only.

    .venv/bin/python benchmarks/eviction_ceiling.py [--trace PATH] [--salts 3] [--sizes 0.02,0.05,0.1]

The answer-length policy misses its held-out target at 2% of unique blocks by a few points of the LRU->Belady
gap. This bounds what the "whether" side could still add, from three angles, all on the first 15 minutes of the
conversation trace (hits counted from t >= 450 s, at the held-out sizes in blocks, as `ghost_spread.py`). Of the
held-out second half it uses only its count of unique blocks (to size the tier); it never replays it, and every
label (when a turn's next turn came) comes from the tuning half alone.

1. Signal: for first turns and for follow-up turns, the AUC of each feature the trace carries for "the next turn
   comes within 60 / 120 / 300 s" (0.5: no signal; below 0.5: a larger value means less likely), and a logistic
   model of the follow-ups' features fitted on one half of them and scored on the other (both ways).
2. Where the cache goes: per class of the block's latest turn (first turn, or the answer length of a follow-up) and
   age since that turn, the share of block-seconds the 2% tier spends, the hits it gets, and the hits per 1,000
   block-seconds, for answer-length and for Belady.
3. Bounds: the policy's hit rate with an outside odds ratio on each session's next-turn hit chance
   (`SessionOddsPolicy` below: answer-length with that analysis hook): a perfect "returns within 120 s / 300 s"
   oracle (for first turns, for follow-ups, for all; a "no" scales the odds by 0.02), the same oracle with half its
   labels replaced by coin flips, and the logistic model of (1): fitted on the very turns it is scored on
   (in-sample: optimistic), and fitted on t < 450 s only (the past of the scored window: what an online learner
   could have had).
"""

from __future__ import annotations

import argparse
import collections
import logging
import math
import random
import statistics
from bisect import bisect_right
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from kvtier.replay.runner import ReplayClock, build_policy, host_key_sequence, parse_capacity, simulate
from kvtier.replay.traces import TraceRequest, read_trace, unique_blocks
from kvtier.storage_backends.eviction.answer_length import AnswerLengthPolicy
from kvtier.storage_backends.eviction.sessions import Session

logger = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[1]
SHARED = next((p for p in (REPO.parent / "shared" / "traces", REPO.parent.parent / "shared" / "traces")
               if p.exists()), REPO.parent / "shared" / "traces")
TRACE = SHARED / "mooncake_conversation_first30min.jsonl"
TUNE_END_S = 900.0
SCORE_FROM_S = 450.0
HORIZONS = (60.0, 120.0, 300.0)
AGE_EDGES = (15.0, 30.0, 60.0, 120.0)
ANSWER_CLASSES = ((100, "answer<100"), (250, "answer<250"), (500, "answer<500"), (1000, "answer<1000"),
                  (math.inf, "answer>=1000"))
MODEL_FEATURES = ("answer", "prev_gap", "depth", "user_tokens")


# ---------------------------------------------------------------------------------------------- the trace's turns
def next_gaps(reqs: Sequence[TraceRequest]) -> dict[int, float]:
    """Request index -> seconds until its session's next turn (absent: none in the file)."""
    out: dict[int, float] = {}
    for r in reqs:
        if r.parent is not None:
            g = r.timestamp - reqs[r.parent].timestamp
            out[r.parent] = min(out.get(r.parent, math.inf), g)
    return out


def turn_features(reqs: Sequence[TraceRequest], r: TraceRequest) -> dict[str, float]:
    """What is known about a turn once it has finished (no future information)."""
    f = {"answer": float(r.output_length), "input": float(r.input_length), "chunks": float(len(r.hash_ids)),
         "depth": float(r.turn)}
    if r.parent is not None:
        p = reqs[r.parent]
        f["prev_gap"] = r.timestamp - p.timestamp
        f["prev_answer"] = float(p.output_length)
        f["user_tokens"] = float(max(0, r.input_length - p.input_length - p.output_length))
        gaps, x = [], r
        while x.parent is not None:
            gaps.append(x.timestamp - reqs[x.parent].timestamp)
            x = reqs[x.parent]
        f["min_gap"] = min(gaps)
    return f


def auc(scores: Sequence[float], labels: Sequence[bool]) -> float:
    """Area under the ROC curve (ties count half); nan without both labels."""
    s = np.asarray(scores, dtype=float)
    y = np.asarray(labels, dtype=bool)
    pos, neg = int(y.sum()), int((~y).sum())
    if not pos or not neg:
        return math.nan
    order = np.argsort(s, kind="mergesort")
    ranks = np.empty(len(s))
    sorted_s = s[order]
    i = 0
    while i < len(s):  # average ranks over ties
        j = i
        while j < len(s) and sorted_s[j] == sorted_s[i]:
            j += 1
        ranks[order[i:j]] = (i + j - 1) / 2 + 1
        i = j
    return float((ranks[y].sum() - pos * (pos + 1) / 2) / (pos * neg))


def fit_logistic(x: np.ndarray, y: np.ndarray, l2: float = 1.0) -> tuple[float, np.ndarray, float] | None:
    """L2-penalised logistic regression of labels y in [0, 1] (soft labels allowed) on the rows of x, fitted by
    damped Newton steps on standardised features: (intercept, weight per raw feature, mean label), so that the
    log-odds of a row v is intercept + v @ weights. None when there is nothing to tell apart (every label the same)
    or the fit fails. (The fit of the retired return model, `docs/results/2026-12-03-retired-eviction-knobs.md`.)"""
    base = float(y.mean()) if len(y) else 0.0
    if base <= 0.0 or base >= 1.0:
        return None
    mu, sd = x.mean(axis=0), x.std(axis=0)
    sd = np.where(sd > 1e-6, sd, 1.0)  # a constant feature standardises to 0 (its weight stays at 0)
    z = np.c_[np.ones(len(x)), (x - mu) / sd]
    reg = l2 * np.eye(z.shape[1])
    reg[0, 0] = 1e-6  # keeps the Hessian invertible when every prediction saturates
    w = np.zeros(z.shape[1])
    w[0] = math.log(base / (1.0 - base))
    try:
        for _ in range(12):
            p = 1.0 / (1.0 + np.exp(-np.clip(z @ w, -30.0, 30.0)))
            step = np.linalg.solve((z.T * (p * (1.0 - p))) @ z + reg, z.T @ (p - y) + reg @ w)
            big = float(np.abs(step).max())
            if big > 4.0:  # damped: a separable window must not throw the weights far in one step
                step *= 4.0 / big
            w -= step
            if big < 1e-6:
                break
    except np.linalg.LinAlgError:
        w = np.full(z.shape[1], np.nan)
    if not np.all(np.isfinite(w)):
        logger.warning("logistic fit on %d labels failed", len(y))
        return None
    coef = w[1:] / sd
    return float(w[0] - coef @ mu), coef, base


class Logistic:
    """`fit_logistic` on log1p features."""

    def __init__(self, rows: Sequence[Sequence[float]], labels: Sequence[bool], l2: float = 1.0) -> None:
        fit = fit_logistic(self._x(rows), np.asarray(labels, dtype=float), l2)
        if fit is None:
            raise ValueError("logistic: the labels do not have both classes, or the fit failed")
        self.intercept, self.coef, self.base = fit

    @staticmethod
    def _x(rows: Sequence[Sequence[float]]) -> np.ndarray:
        return np.log1p(np.maximum(np.asarray(rows, dtype=float), 0.0))

    def prob(self, rows: Sequence[Sequence[float]]) -> np.ndarray:
        return 1.0 / (1.0 + np.exp(-(self.intercept + self._x(rows) @ self.coef)))

    def odds_ratio(self, row: Sequence[float]) -> float:
        p = float(self.prob([row])[0])
        return (p / (1 - p)) / (self.base / (1 - self.base))


def signal_report(reqs: Sequence[TraceRequest], tune: Sequence[TraceRequest], gaps: dict[int, float]) -> None:
    print("\n1. signal: AUC of each feature for 'the next turn comes within H' (tuning half's turns)")
    for name, sel in (("first turns", lambda r: r.turn == 1), ("follow-up turns", lambda r: r.turn >= 2)):
        turns = [r for r in tune if sel(r)]
        feats = [turn_features(reqs, r) for r in turns]
        names = list(feats[0])
        print(f"  {name} ({len(turns)}):")
        for h in HORIZONS:
            y = [gaps.get(r.index, math.inf) <= h for r in turns]
            cells = " ".join(f"{n} {auc([f[n] for f in feats], y):.3f}" for n in names)
            print(f"    within {h:.0f} s ({sum(y)} yes): {cells}")
    print("  by depth, chunk-weighted: P(next turn within 120 / 300 s), and hits per 1,000 block-seconds if every "
          "chunk were held until its next turn or 300 s (no selection)")
    by_depth = collections.defaultdict(lambda: [0, 0, 0, 0.0])
    for r in tune:
        g, n = gaps.get(r.index, math.inf), len(r.hash_ids)
        d = by_depth[min(r.turn, 6)]
        d[0] += n
        d[1] += n * (g <= 120.0)
        d[2] += n * (g <= 300.0)
        d[3] += n * min(g, 300.0)
    for depth, (n, a, b, held) in sorted(by_depth.items()):
        print(f"    depth {depth}{'+' if depth == 6 else ' '} {n:6d} chunks: {a / n:.3f} / {b / n:.3f}, "
              f"{1000 * b / held:.2f} hits per 1,000 block-s")
    turns = [r for r in tune if r.turn >= 2]
    rows = [[turn_features(reqs, r)[n] for n in MODEL_FEATURES] for r in turns]
    half = len(turns) // 2
    print(f"  follow-ups, logistic on {', '.join(MODEL_FEATURES)}, fitted on one half of them, AUC on the other:")
    for h in HORIZONS:
        y = [gaps.get(r.index, math.inf) <= h for r in turns]
        a = auc(Logistic(rows[:half], y[:half]).prob(rows[half:]), y[half:])
        b = auc(Logistic(rows[half:], y[half:]).prob(rows[:half]), y[:half])
        print(f"    within {h:.0f} s: {a:.3f} (fit on the earlier half) / {b:.3f} (fit on the later half)")


# ------------------------------------------------------------------------------------------ where the cache goes
def _turn_class(r: TraceRequest, i: int) -> str:
    if i == 0:
        return "first chunk"
    if r.turn == 1:
        return "first turn"
    return next(name for edge, name in ANSWER_CLASSES if r.output_length < edge)


def occupancy_report(tune: Sequence[TraceRequest], blocks: int) -> None:
    """Block-seconds, hits and hits per 1,000 block-seconds per (class, age since the block's latest turn)."""
    print(f"\n2. where the {blocks}-block tier goes (scored window): share of block-seconds / hits / hits per "
          "1,000 block-seconds, by the block's latest turn and the age since it")
    ages = ["0-15", "15-30", "30-60", "60-120", "120+"]
    for policy in ("answer-length", "belady"):
        clock = ReplayClock()
        pol = build_policy(policy, clock, blocks)
        if policy == "belady":
            pol.set_future(host_key_sequence(tune))  # type: ignore[attr-defined]
        owner: dict = {}  # key -> (class, time of its latest turn)
        cells = collections.defaultdict(lambda: [0.0, 0])

        def charge(k, now: float) -> None:
            cls, since = owner[k]
            lo = max(since, SCORE_FROM_S)
            for j, (a, b) in enumerate(zip((0.0,) + AGE_EDGES, AGE_EDGES + (math.inf,))):
                x, y = max(lo, since + a), min(now, since + b)
                if y > x:
                    cells[(cls, j)][0] += y - x

        used = 0
        for r in tune:
            clock.now = now = r.timestamp
            pol.on_request(r.hash_ids, now)
            for i, k in enumerate(r.hash_ids):
                if k in pol:
                    charge(k, now)
                    if now >= SCORE_FROM_S:
                        cells[(owner[k][0], bisect_right(AGE_EDGES, now - owner[k][1]))][1] += 1
                    owner[k] = (_turn_class(r, i), now)
                    pol.on_access(k)
                    continue
                if used + 1 > blocks:
                    for v in pol.victims(used + 1 - blocks, lambda _k: True):
                        pol.on_remove(v)
                        used -= 1
                        charge(v, now)
                        del owner[v]
                pol.on_insert(k, 1)
                used += 1
                owner[k] = (_turn_class(r, i), now)
            pol.on_request_finished(r.hash_ids, r.output_length, now)
        for k in list(owner):
            charge(k, TUNE_END_S)
        total = sum(c[0] for c in cells.values()) or 1.0
        print(f"  {policy}:")
        for cls in ["first turn"] + [n for _, n in ANSWER_CLASSES]:
            row = []
            for j, age in enumerate(ages):
                bs, hits = cells[(cls, j)]
                row.append(f"[{age} s] {100 * bs / total:4.1f}% {hits:4d} {1000 * hits / bs if bs else 0:5.1f}")
            print(f"    {cls:13s} " + "  ".join(row))


# -------------------------------------------------------------------------------------------------------- bounds
def with_odds(p: float, r: float) -> float:
    """Probability p with its odds scaled by r (r = 0: never)."""
    return r * p / (1.0 - p + r * p) if r > 0.0 else 0.0


class SessionOddsPolicy(AnswerLengthPolicy):
    """answer-length with an outside odds ratio on each session's next-turn hit chance (an analysis hook, never in
    serving): `session_odds(chain, answer_tokens)` is called when a turn finishes, and a number it returns scales
    the odds of that session's hit chance until its next turn (0: it will not return; None, NaN or a negative
    number: no opinion)."""

    def __init__(self, session_odds: Callable[[Sequence, int], float | None], **kw) -> None:
        super().__init__(**kw)
        self.session_odds = session_odds
        self._outside: dict[int, tuple[int, float]] = {}  # session id -> (depth of the turn it was given after, odds)

    def on_request_finished(self, chain, answer_tokens: int, now: float | None = None) -> None:
        s = self.sessions.session_of_chain(chain) if chain else None
        if s is not None:
            r = self.session_odds(chain, int(answer_tokens))
            if r is None or not r >= 0.0:
                self._outside.pop(s.sid, None)
            else:
                self._outside[s.sid] = (s.depth, float(r))
        super().on_request_finished(chain, answer_tokens, now)

    def _hit_chance(self, u, hits: float) -> float:
        hits = super()._hit_chance(u, hits)
        if u.__class__ is Session and hits > 0.0:
            o = self._outside.get(u.sid)
            if o is not None and o[0] == u.depth:  # a later turn replaced the turn it was given after: no opinion
                hits = with_odds(hits, o[1])
        return hits


def hit_rates(tune, held_unique: int, sizes, salts: int,
              odds: Callable[[], Callable[[Sequence, int], float | None] | None] | None = None,
              policy: str = "answer-length") -> list[float]:
    """Mean hit rate (%) over the ghost salts at each size; `odds()` makes a fresh session_odds hook per replay
    (answer-length rows only)."""
    out = []
    for f in sizes:
        blocks = parse_capacity(f"{round(f * held_unique)}blocks", held_unique).blocks
        rates = []
        for salt in range(salts if policy == "answer-length" else 1):
            clock = ReplayClock()
            kw = {"ghost_salt": salt} if policy == "answer-length" else {}
            if odds is not None:
                assert policy == "answer-length"
                pol = SessionOddsPolicy(odds(), clock=clock, **kw)
                pol.set_capacity(blocks)
            else:
                pol = build_policy(policy, clock, blocks, **kw)
            if policy == "belady":
                pol.set_future(host_key_sequence(tune))  # type: ignore[attr-defined]
            c = simulate(tune, pol, blocks, clock=clock, score_from=SCORE_FROM_S)
            rates.append(100.0 * c["host_hits"] / max(1, c["accesses"]))
        out.append(statistics.mean(rates))
    return out


def bounds_report(reqs, tune, gaps, held_unique: int, sizes, salts: int) -> None:
    by_chain = {r.hash_ids: r for r in tune}
    print(f"\n3. bounds: hit % at {' / '.join(f'{f:g}' for f in sizes)} of the held-out half's unique blocks "
          f"(answer-length rows: mean of {salts} ghost salts)")
    base = {}

    def show(label: str, rates: list[float]) -> None:
        gap = [(a - base["lru"][i]) / (base["belady"][i] - base["lru"][i]) for i, a in enumerate(rates)]
        print(f"  {label:58s} " + " / ".join(f"{x:5.2f}" for x in rates)
              + "   gap closed " + " / ".join(f"{100 * g:5.1f}%" for g in gap), flush=True)

    for p in ("lru", "belady"):
        base[p] = hit_rates(tune, held_unique, sizes, salts, policy=p)
    show("lru", base["lru"])
    show("belady", base["belady"])
    show("answer-length (defaults)", hit_rates(tune, held_unique, sizes, salts))

    def oracle(horizon: float, which: str, noise: float = 0.0):
        def make():
            rng = random.Random(7)

            def odds(chain, _answer):
                r = by_chain.get(tuple(chain))
                if r is None or (which == "first" and r.turn != 1) or (which == "follow-up" and r.turn < 2):
                    return None
                yes = gaps.get(r.index, math.inf) <= horizon
                if noise and rng.random() < noise:
                    yes = rng.random() < 0.5
                return 1.0 if yes else 0.02
            return odds
        return make

    for horizon in (120.0, 300.0):
        for which in ("first", "follow-up", "all"):
            show(f"oracle: {which} turns, returns within {horizon:.0f} s", hit_rates(
                tune, held_unique, sizes, salts, oracle(horizon, which)))
    show("oracle: follow-ups within 120 s, half the labels coin flips",
         hit_rates(tune, held_unique, sizes, salts, oracle(120.0, "follow-up", 0.5)))

    def model(horizon: float, fit_until: float):
        fit = [r for r in tune if r.turn >= 2 and r.timestamp < fit_until]
        m = Logistic([[turn_features(reqs, r)[n] for n in MODEL_FEATURES] for r in fit],
                     [gaps.get(r.index, math.inf) <= horizon for r in fit])
        ratio = {r.hash_ids: m.odds_ratio([turn_features(reqs, r)[n] for n in MODEL_FEATURES])
                 for r in tune if r.turn >= 2}

        def make():
            return lambda chain, _answer: ratio.get(tuple(chain))
        return make, len(fit)

    for horizon in (120.0, 300.0):
        for fit_until, what in ((TUNE_END_S, "in-sample"), (SCORE_FROM_S, f"fitted on t < {SCORE_FROM_S:.0f} s")):
            make, n = model(horizon, fit_until)
            show(f"logistic, follow-ups within {horizon:.0f} s, {what} ({n} turns)",
                 hit_rates(tune, held_unique, sizes, salts, make))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trace", default=str(TRACE),
                    help="the first 30 minutes of conversation_trace.jsonl of https://github.com/kvcache-ai/Mooncake "
                         "(FAST25-release/traces); see docs/development.md, 'Traces' (default: %(default)s)")
    ap.add_argument("--salts", type=int, default=3, help="ghost sampling salts averaged per answer-length row")
    ap.add_argument("--sizes", default="0.02,0.05,0.1", help="fractions of the held-out half's unique blocks")
    ap.add_argument("--skip", default="", help="comma-separated parts to skip: signal, occupancy, bounds")
    a = ap.parse_args()
    skip = set(filter(None, a.skip.split(",")))
    reqs = read_trace(a.trace)
    held_unique = unique_blocks(r for r in reqs if r.timestamp >= TUNE_END_S)
    tune = [r for r in reqs if r.timestamp < TUNE_END_S]
    gaps = next_gaps(tune)  # labels from the tuning half alone: a return after t = 900 s counts as none
    sizes = [float(x) for x in a.sizes.split(",")]
    print(f"TUNING half only (t < {TUNE_END_S:.0f} s, {len(tune)} requests, hits scored from {SCORE_FROM_S:.0f} s); "
          "the held-out second half is never replayed. Sizes in blocks are the held-out half's fractions: "
          + ", ".join(f"{f:g} = {round(f * held_unique)}" for f in sizes))
    if "signal" not in skip:
        signal_report(reqs, tune, gaps)
    if "occupancy" not in skip:
        occupancy_report(tune, round(sizes[0] * held_unique))
    if "bounds" not in skip:
        bounds_report(reqs, tune, gaps, held_unique, sizes, a.salts)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
