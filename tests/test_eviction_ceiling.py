"""The analysis side of `benchmarks/eviction_ceiling.py`: its answer-length subclass with an outside odds ratio per
session (`SessionOddsPolicy`, a hook that lives with the benchmark, not in the policy) and its logistic fit."""

from __future__ import annotations

import importlib.util
import random
from pathlib import Path

import numpy as np

from kvtier.replay.runner import ReplayClock, simulate
from kvtier.replay.traces import TraceRequest
from kvtier.storage_backends.eviction import make_policy


def _ceiling():
    path = Path(__file__).resolve().parent.parent / "benchmarks" / "eviction_ceiling.py"
    spec = importlib.util.spec_from_file_location("eviction_ceiling", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _pace_world(n_sessions: int = 400, seed: int = 3) -> list[TraceRequest]:
    """Sessions every 2 s, two turns of 6 chunks each, the same answers. Quick users answer the first turn after
    50 s and come back 15 s after the second; slow users answer after 170 s and never come back."""
    rng = random.Random(seed)
    events, nid = [], 1
    for s in range(n_sessions):
        t0 = 2.0 * s
        quick = rng.random() < 0.5
        first = [0] + list(range(nid, nid + 6))
        nid += 6
        second = first + list(range(nid, nid + 6))
        nid += 6
        t1 = t0 + (50.0 if quick else 170.0)
        events += [(t0, tuple(first), 200), (t1, tuple(second), 200)]
        if quick:
            events.append((t1 + 15.0, tuple(second + [nid]), 200))
            nid += 1
    events.sort(key=lambda e: e[0])
    return [TraceRequest(i, t, c, 512 * len(c), a, 0, None, 1) for i, (t, c, a) in enumerate(events)]


def _rate(reqs, p, cap: int, clock: ReplayClock) -> float:
    p.set_capacity(cap)
    c = simulate(reqs, p, cap, clock=clock)
    return c["host_hits"] / c["accesses"]


def test_session_odds_hook():
    """'No opinion' (None) leaves the policy's decisions as they are; 'never' (0) for every session throws the
    quick users' history out first and loses their third turns; a perfect oracle of the third turn keeps them."""
    ceiling = _ceiling()
    reqs = _pace_world()
    chains = [r.hash_ids for r in reqs]
    back = {c[:-6] for c in chains if len(c) == 13} | {c[:-1] for c in chains if len(c) == 14}  # turns followed up
    clock = ReplayClock()
    base = _rate(reqs, make_policy("answer-length", production=False, clock=clock), 60, clock)
    calls = []

    def none(chain, answer):
        calls.append(answer)
        return None

    for odds, expect in ((none, "same"), (lambda chain, a: 0.0, "lower"),
                         (lambda chain, a: 1.0 if tuple(chain) in back else 0.02, "higher")):
        clock = ReplayClock()
        rate = _rate(reqs, ceiling.SessionOddsPolicy(odds, clock=clock), 60, clock)
        if expect == "same":
            assert rate == base and len(calls) == len(reqs) and set(calls) == {200}
        elif expect == "lower":
            assert rate < 0.9 * base, (rate, base)
        else:
            assert rate > 1.1 * base, (rate, base)


def test_logistic_fit_learns_a_separable_signal():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(400, 2))
    y = (x[:, 0] + 0.1 * rng.normal(size=400) > 0).astype(float)
    intercept, coef, base = ceiling_fit = _ceiling().fit_logistic(x, y)
    assert ceiling_fit is not None and 0.4 < base < 0.6
    assert coef[0] > 2.0 and abs(coef[1]) < 0.5 * coef[0] and abs(intercept) < 1.0
    assert _ceiling().fit_logistic(x, np.ones(400)) is None  # nothing to tell apart
