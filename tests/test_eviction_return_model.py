"""The return model (`eviction.return_model`): unbiased delayed labels, what it learns, robustness, bounded memory,
and its effect inside the answer-length policy."""

from __future__ import annotations

import math
import random

import pytest

from kvtier.storage_backends.eviction import make_policy
from kvtier.storage_backends.eviction.return_model import ReturnModel
from kvtier.replay.runner import ReplayClock, simulate
from kvtier.replay.traces import TraceRequest


def _x(answer: int = 100, gap: float = 30.0, depth: int = 2, new: int = 3, chain: int = 10) -> tuple[float, ...]:
    return ReturnModel.features(answer, gap, depth, new, chain)


def test_labels_wait_the_whole_horizon_in_start_order():
    """A return known early is labelled only when its horizon has passed, after the older non-return: the window
    never holds the quick returns of waits whose non-returning peers are not labelled yet."""
    m = ReturnModel(horizon_s=10.0, min_labels=2, refit=1000)
    w1 = m.start(0.0, _x(answer=1))
    w2 = m.start(1.0, _x(answer=2))
    m.returned(w2, 2.0)  # back after 1 s
    assert m.labels == 0
    m.expire(10.5)  # w1's horizon passed without a return; w2's has not
    assert [y for _, y in m._rows] == [0.0] and m.labels == 1
    m.expire(11.5)
    assert [y for _, y in m._rows] == [0.0, 1.0]
    m.returned(w1, 12.0)  # too late: already labelled, nothing changes
    assert m.labels == 2
    w3 = m.start(20.0, _x())
    m.returned(w3, 35.0)  # back, but after the horizon: a 'no'
    m.expire(40.0)
    assert [y for _, y in m._rows] == [0.0, 1.0, 0.0]
    w4 = m.start(50.0, _x())
    m.cancel(w4)  # a cancelled wait gets no label
    m.expire(100.0)
    assert m.labels == 3


def test_it_learns_which_waits_come_back():
    """Short answers come back within the horizon 80% of the time, long ones 10%: after a window of labels the odds
    ratio of a short-answer wait is well above 1 and a long one's below; before the first fit it has no opinion."""
    rng = random.Random(4)
    m = ReturnModel(horizon_s=60.0, refit=50, min_labels=100)
    assert m.odds_ratio(_x(answer=20)) is None
    t = 0.0
    for _ in range(1500):
        t += 1.0
        short = rng.random() < 0.5
        w = m.start(t, _x(answer=20 if short else 900, gap=rng.uniform(20, 60)))
        if rng.random() < (0.8 if short else 0.1):
            w.back = t + rng.uniform(1, 50)  # what returned() records when the turn comes
    m.expire(t + 61.0)
    assert m.fits > 0 and m.labels == 1500
    r_short, r_long = m.odds_ratio(_x(answer=20, gap=40)), m.odds_ratio(_x(answer=900, gap=40))
    # true odds ratios against the pooled base rate (0.45): 0.8 -> 4.9x, 0.1 -> 0.14x
    assert r_short > 3.0 and r_long < 0.25, (r_short, r_long)


def test_soft_labels_and_the_pace_feature():
    """With label_of, a return's label is a weight (here: only returns within 5 s count fully); the pace feature
    alone separates quick and slow users."""
    rng = random.Random(5)
    m = ReturnModel(horizon_s=100.0, refit=50, min_labels=100, label_of=lambda gap: 1.0 if gap < 5 else 0.25)
    t = 0.0
    for _ in range(1200):
        t += 1.0
        fast = rng.random() < 0.5
        w = m.start(t, _x(gap=10.0 if fast else 150.0))
        w.back = t + (rng.uniform(1, 4) if fast else rng.uniform(20, 90))  # everyone returns
    m.expire(t + 101.0)
    ys = sorted({y for _, y in m._rows})
    assert ys == [0.25, 1.0]
    assert m.odds_ratio(_x(gap=10.0)) > 2.0 > 0.5 > m.odds_ratio(_x(gap=150.0))


@pytest.mark.parametrize("world", ["constant", "separable", "one-class", "saturated"])
def test_degenerate_windows_never_raise(world):
    """Constant features, a perfectly separable window, or a window of one label: refits neither raise nor give a
    non-finite ratio; with one class only there is no correction at all."""
    m = ReturnModel(horizon_s=1.0, refit=10, min_labels=20)
    for i in range(200):
        if world == "constant":
            x, back = _x(), (i % 2 == 0)
        elif world == "separable":
            x, back = _x(answer=10 if i % 2 else 1000), bool(i % 2)
        elif world == "saturated":  # one 'no' among 200, far out on every feature
            x = _x(answer=10**9, gap=1e7, depth=10**6, new=10**6, chain=10**6) if i == 100 else _x(answer=10 + i)
            back = i != 100
        else:
            x, back = _x(answer=10 + i), True
        w = m.start(float(i), x)
        if back:
            m.returned(w, i + 0.5)
    m.expire(500.0)
    assert m.labels == 200
    for probe in (_x(), _x(answer=10), _x(answer=1000)):
        r = m.odds_ratio(probe)
        if world == "one-class":
            assert r is None
        else:
            assert r is not None and math.isfinite(r) and 1 / m.max_ratio <= r <= m.max_ratio
    if world == "constant":
        assert m.odds_ratio(_x()) == pytest.approx(1.0, abs=0.05)  # half come back, whatever the features say


def test_memory_is_bounded():
    m = ReturnModel(horizon_s=1e9, window=50, max_pending=30, refit=10, min_labels=10)
    waits = [m.start(float(i), _x()) for i in range(100)]
    assert m.memory_items()["return_pending"] <= 30
    assert all(w.done for w in waits[:70])  # dropped from the pending queue, never labelled
    m.horizon_s = 1.0
    m.expire(1e6)
    assert m.labels == 30 and m.memory_items()["return_rows"] == 30
    for i in range(100):
        m.start(2e6 + i, _x())
    m.expire(3e6)
    assert m.memory_items()["return_rows"] == 50


# ------------------------------------------------------------------ inside the answer-length policy


def _pace_world(n_sessions: int = 600, seed: int = 3) -> list[TraceRequest]:
    """Sessions every 2 s, two turns of 6 chunks each, the same answers. Quick users answer the first turn after
    50 s and come back 15 s after the second; slow users answer after 170 s and never come back. Both gaps fall in
    one pace bucket of the class model (45-180 s): only the return model's continuous pace separates them."""
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


def _replay(reqs, cap, **kw):
    clock = ReplayClock()
    p = make_policy("answer-length", production=False, clock=clock, **kw)
    p.set_capacity(cap)
    c = simulate(reqs, p, cap, clock=clock)
    return c["host_hits"] / c["accesses"], p


def test_the_return_model_keeps_the_conversations_that_come_back():
    reqs = _pace_world()
    kw = dict(fallback=(), return_refit=32, return_horizon_s=120.0, return_strength=0.5)
    without, _ = _replay(reqs, 60, return_model=False, **kw)
    with_m, pol = _replay(reqs, 60, return_model=True, **kw)
    st = pol.stats()
    assert st["return_fits"] > 0 and st["return_labels"] > 200, st
    assert with_m > 1.1 * without, (with_m, without, st)
    quick = pol.returns.odds_ratio(ReturnModel.features(200, 50.0, 2, 6, 13))
    slow = pol.returns.odds_ratio(ReturnModel.features(200, 170.0, 2, 6, 13))
    assert quick > 3.0 > 0.3 > slow, (quick, slow)


def test_session_odds_hook():
    """The analysis hook overrides the model: 'never' (0) for every session throws the quick users' history out
    first and loses their third turns; 'no opinion' (None) leaves the policy as it is."""
    reqs = _pace_world(400)
    base, _ = _replay(reqs, 60, fallback=(), return_model=False)
    clock = ReplayClock()
    for odds, expect in ((lambda chain, a: None, "same"), (lambda chain, a: 0.0, "lower")):
        p = make_policy("answer-length", production=False, clock=clock, fallback=(), return_model=False)
        p.set_capacity(60)
        p.session_odds = odds
        clock.now = 0.0
        c = simulate(reqs, p, 60, clock=clock)
        rate = c["host_hits"] / c["accesses"]
        if expect == "same":
            assert rate == base
        else:
            assert rate < 0.9 * base, (rate, base)
