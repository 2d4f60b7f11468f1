"""An experiment of issue 29 (not shipped): how far can any choice among `adaptive`'s experts go, and do other
switch tests choose better?

    .venv/bin/python benchmarks/selection_ceiling.py [--conversation PATH] [--poisson PATH] [--jobs N]

`adaptive`'s shadows see every access whatever the tier holds, so each expert's hits per request do not depend on
which expert leads. One replay per trace, fold and size records them (a subclass of `adaptive` that never switches
and logs each request's per-expert shadow hits and its session, from `SessionTracker`). From that record:
- **oracles**: the best expert per fold in hindsight, and per window of W scored requests with free switching (an
  upper bound of any switch rule over these experts: a real switch also pays for the tier's convergence);
- **switch tests**, replayed offline on the record: `adaptive`'s own (decayed per-request differences and squares,
  `switch_z` 2), the same with the variance summed per session (a session's requests hit or miss together, so
  per-request squares understate the noise), and with batch means over B consecutive requests. The estimate of a
  rule is the leader's shadow hits on the scored requests (no convergence cost); `--validate` replays the shipped
  `adaptive` and prints how far the estimate of its own rule is from the real figure.

Experts: the production four, and a fifth, `split`: the answer-length / LRU split of `bd98a90` (first-seen chunks
on an answer-length probation of 10% of the capacity, chunks stored again while a doorkeeper of 4x the capacity
remembers them on an LRU main queue). Traces and folds are `eviction_replay.py`'s.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections import OrderedDict, defaultdict
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import eviction_replay as er  # noqa: E402

from kvtier.replay.folds import fold_capacity, fold_requests, replay_fold  # noqa: E402
from kvtier.storage_backends.eviction.adaptive import AdaptivePolicy  # noqa: E402
from kvtier.storage_backends.eviction.base import EvictionPolicy, make_policy, register_policy  # noqa: E402
from kvtier.storage_backends.eviction.sessions import SessionTracker  # noqa: E402

EXPERTS = ("answer-length", "arc", "s3fifo", "lru", "split")
SIZES = (0.02, 0.05, 0.1)
TARGET = {0.02: 30.0, 0.05: 30.0, 0.1: 15.0}


@register_policy
class SplitExpert(EvictionPolicy):
    """Probation (first-seen chunks, answer-length order, `share` of the capacity) before main (LRU)."""

    name = "split"

    def __init__(self, clock=None, capacity: int | None = None, share: float = 0.1, doorkeeper: float = 4.0) -> None:
        super().__init__(clock)
        self.share, self.doorkeeper = share, doorkeeper
        self.probation = make_policy("answer-length", clock=self._clock)
        self.main = make_policy("lru", clock=self._clock)
        self.seen: OrderedDict = OrderedDict()
        self.on_probation: set = set()
        self.in_main: set = set()
        self.cap = 1
        if capacity is not None:
            self.set_capacity(capacity)

    def set_capacity(self, capacity: int) -> None:
        super().set_capacity(capacity)
        self.cap = max(1, int(capacity))
        self.probation.set_capacity(capacity)
        self.main.set_capacity(capacity)

    def on_request(self, chain, now=None) -> None:
        self.probation.on_request(chain, now)

    def on_request_finished(self, chain, answer_tokens, now=None) -> None:
        self.probation.on_request_finished(chain, answer_tokens, now)

    def on_insert(self, key, size=1) -> None:
        if key in self.seen:
            self.seen.move_to_end(key)
            self.in_main.add(key)
            self.main.on_insert(key, size)
            return
        self.seen[key] = None
        while len(self.seen) > self.doorkeeper * self.cap:
            self.seen.popitem(last=False)
        self.on_probation.add(key)
        self.probation.on_insert(key, size)

    def on_access(self, key) -> None:
        if key in self.on_probation:
            self.on_probation.discard(key)
            self.probation.on_remove(key)
            self.in_main.add(key)
            self.main.on_insert(key, 1)
        else:
            self.main.on_access(key)

    def on_remove(self, key) -> None:
        if key in self.on_probation:
            self.on_probation.discard(key)
            self.probation.on_remove(key)
        else:
            self.in_main.discard(key)
            self.main.on_remove(key)

    def victims(self, need, evictable):
        freed = 0
        while freed < need:
            first = self.on_probation and (len(self.on_probation) > self.share * self.cap or not self.in_main)
            order = (self.probation, self.main) if first else (self.main, self.probation)
            key = next((k for src in order for k in src.victims(1, evictable)), None)
            if key is None:
                return
            freed += 1
            yield key

    def __len__(self) -> int:
        return len(self.on_probation) + len(self.in_main)

    def __contains__(self, key) -> bool:
        return key in self.on_probation or key in self.in_main


RECORD: list[tuple[float, int, int, tuple[int, ...]]] = []  #: (arrival, session, accesses, hits per expert)


@register_policy
class RecordingAdaptive(AdaptivePolicy):
    """`adaptive` that never switches and records each request's shadow hits per expert."""

    name = "adaptive-recording"

    def __init__(self, clock=None, capacity=None, **kw) -> None:
        super().__init__(clock, capacity, **{"switch_z": math.inf, **kw})
        self.sessions = SessionTracker()
        self.session, self.arrival = -1, 0.0
        RECORD.clear()

    def on_request(self, chain, now=None) -> None:
        super().on_request(chain, now)
        self.session, self.arrival = self.sessions.begin(list(chain), now or 0.0)[0].sid, now or 0.0

    def on_request_finished(self, chain, answer_tokens, now=None) -> None:
        RECORD.append((self.arrival, self.session, len(chain), tuple(self._unit)))
        super().on_request_finished(chain, answer_tokens, now)


def record(job):
    src, fold, size, validate = job
    reqs = er.load(src)
    r = replay_fold(reqs, fold, "adaptive-recording", size, {"experts": EXPERTS})
    rec = list(RECORD)
    replayed, _ = fold_requests(reqs, fold)
    cap = fold_capacity(replayed, size).blocks
    belady = replay_fold(reqs, fold, "belady", size).hit_rate * 100 if src.name == "conversation" else math.nan
    real = replay_fold(reqs, fold, "adaptive", size).hit_rate * 100 if validate else math.nan
    return src.name, fold.name, size, fold.score_from_s, r.accesses, cap, rec, belady, real


def switch_rule(rec, score_from: float, cap: int, experts: Sequence[int], z: float = 2.0, variance: str = "request",
                batch: int = 16, half_life: float = 2.0, min_half_life: int = 10_000) -> tuple[int, int]:
    """(scored hits of the leader, switches) of a switch test replayed on the record; `adaptive`'s test with
    variance "request" (its defaults); "session": squares of per-session sums; "batch": of per-batch sums."""
    n = len(experts)
    step = 2.0 ** (1.0 / max(min_half_life, half_life * cap))
    g = 1.0
    diff = [[0.0] * n for _ in range(n)]
    sq = [[0.0] * n for _ in range(n)]
    per_session: dict[int, list[list[float]]] = defaultdict(lambda: [[0.0] * n for _ in range(n)])
    acc = [[0.0] * n for _ in range(n)]
    in_batch = lead = hits = switches = 0
    for t, sid, accesses, unit in rec:
        u = [unit[e] for e in experts]
        if t >= score_from:
            hits += u[lead]
        g *= step ** accesses
        if g > 1e60:  # renormalise (squares of sums scale with g squared)
            diff = [[w / g for w in row] for row in diff]
            acc = [[w / g for w in row] for row in acc]
            sq = [[w / (g * g if variance == "session" else g) for w in row] for row in sq]
            for s in per_session.values():
                for row in s:
                    row[:] = [w / g for w in row]
            g = 1.0
        if not any(u):
            continue
        for i in range(n):
            for j in range(n):
                d = u[i] - u[j]
                if i == j or not d:
                    continue
                diff[i][j] += g * d
                if variance == "request":
                    sq[i][j] += g * d * d
                elif variance == "session":
                    s = per_session[sid][i]
                    sq[i][j] += 2 * s[j] * g * d + (g * d) ** 2
                    s[j] += g * d
                else:
                    acc[i][j] += g * d
        if variance == "batch":
            in_batch += 1
            if in_batch == batch:
                for i in range(n):
                    for j in range(n):
                        sq[i][j] += acc[i][j] ** 2 / g
                        acc[i][j] = 0.0
                in_batch = 0
        best, margin = lead, 0.0
        for i in range(n):
            if i != lead:
                var = 2 * sq[i][lead] / (g * g) if variance == "session" else sq[i][lead] / g
                m = diff[i][lead] / g - z * math.sqrt(max(var, 0.0))
                if m > margin:
                    best, margin = i, m
        if best != lead:
            lead, switches = best, switches + 1
    return hits, switches


def oracle(rec, score_from: float, experts: Sequence[int], window: int) -> int:
    """Scored hits of the best expert per `window` consecutive scored requests, in hindsight."""
    scored = [u for t, _, _, u in rec if t >= score_from]
    return sum(max(sum(u[e] for u in scored[i:i + window]) for e in experts) for i in range(0, len(scored), window))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--conversation", default=str(er.SHARED / "mooncake_conversation_first30min.jsonl"))
    ap.add_argument("--poisson", default=str(er.SHARED / "mooncake_synthetic_poisson.jsonl"))
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--validate", action="store_true", help="also replay the shipped adaptive on every fold")
    args = ap.parse_args()
    sources = [er.TraceSource("conversation", args.conversation, minute_folds=True),
               er.TraceSource("poisson", args.poisson)] + [
        er.TraceSource(f"bursty-{'sessions' if s else 'no-sessions'}/{seed}", sessions=s, seed=seed)
        for s in (True, False) for seed in er.SYNTHETIC_SEEDS]
    jobs = [(s, f, z, args.validate) for s in sources for f in er.folds_of(s) for z in SIZES]
    with ProcessPoolExecutor(args.jobs) as ex:
        cells = list(ex.map(record, jobs))
    four, five = [0, 1, 2, 3], [0, 1, 2, 3, 4]

    def rate(hits, c):
        return 100.0 * hits / max(c[4], 1)

    def standalone(c, e):
        return rate(sum(u[e] for t, _, _, u in c[6] if t >= c[3]), c)

    variants = {
        "adaptive as shipped (4 experts, request variance, z 2)": lambda c: switch_rule(c[6], c[3], c[5], four)[0],
        "oracle per fold, 4 experts": lambda c: oracle(c[6], c[3], four, 1 << 30),
        "oracle per 500 requests, 4 experts": lambda c: oracle(c[6], c[3], four, 500),
        "oracle per fold, 5 experts": lambda c: oracle(c[6], c[3], five, 1 << 30),
        "oracle per 2000 requests, 5 experts": lambda c: oracle(c[6], c[3], five, 2000),
        "oracle per 500 requests, 5 experts": lambda c: oracle(c[6], c[3], five, 500),
        "oracle per 100 requests, 5 experts": lambda c: oracle(c[6], c[3], five, 100),
        "5 experts, request variance, z 2": lambda c: switch_rule(c[6], c[3], c[5], five)[0],
    } | {f"5 experts, session variance, z {z}": (lambda z: lambda c: switch_rule(c[6], c[3], c[5], five, z,
                                                                                  "session")[0])(z)
         for z in (1.5, 2.0, 3.0)} | {
        f"5 experts, batch means of {b}, z 2": (lambda b: lambda c: switch_rule(c[6], c[3], c[5], five, 2.0,
                                                                                 "batch", b)[0])(b)
        for b in (8, 32)} | {
        "4 experts, session variance, z 2": lambda c: switch_rule(c[6], c[3], c[5], four, 2.0, "session")[0],
    }
    shipped = {(c[0], c[1], c[2]): rate(switch_rule(c[6], c[3], c[5], four)[0], c) for c in cells}
    traces = list(dict.fromkeys(c[0] for c in cells))
    print("Estimated host hit rate: the leader's shadow hits on the scored requests (no convergence cost).")
    print("gain = the variant minus adaptive as shipped (estimated); margin = the variant minus the best of lru, arc,"
          " s3fifo alone (vLLM's policies not replayed here); gap = share of LRU->Belady closed on the conversation "
          "trace's worst fold, targets 30 / 30 / 15%.\n")
    for label, fn in variants.items():
        est = {(c[0], c[1], c[2]): rate(fn(c), c) for c in cells}
        gaps = []
        for z in SIZES:
            cs = [c for c in cells if c[0] == "conversation" and c[2] == z]
            gaps.append(min(100 * (est[(c[0], c[1], z)] - standalone(c, 3)) / (c[7] - standalone(c, 3)) for c in cs))
        print(f"{label}: worst-fold gap {' / '.join(f'{g:.1f}' for g in gaps)}%"
              f" ({'PASS' if all(g >= TARGET[z] for g, z in zip(gaps, SIZES)) else 'MISS'})")
        for tr in traces:
            cs = [c for c in cells if c[0] == tr]
            gain = [est[(c[0], c[1], c[2])] - shipped[(c[0], c[1], c[2])] for c in cs]
            margin = [est[(c[0], c[1], c[2])] - max(standalone(c, e) for e in (1, 2, 3)) for c in cs]
            print(f"    {tr:22s} gain {min(gain):+.2f} .. {max(gain):+.2f}   least margin {min(margin):+.2f}")
    if args.validate:
        errs = [shipped[(c[0], c[1], c[2])] - c[8] for c in cells]
        print(f"\nestimate of adaptive's own rule minus its real replay, points: min {min(errs):+.2f}, "
              f"median {sorted(errs)[len(errs) // 2]:+.2f}, max {max(errs):+.2f} over {len(errs)} cells")
    return 0


if __name__ == "__main__":
    sys.exit(main())
