"""The answer-length policy and its parts: ghost Belady bucket statistics, the censoring-aware reuse model,
session inference from prefix chains, the answer-length lower bound, bounded memory, and end-to-end behaviour on
synthetic conversations (it must use the signals)."""

from __future__ import annotations

import random

import pytest

from kvtier.replay.runner import ReplayClock, simulate
from kvtier.replay.traces import TraceRequest
from kvtier.storage_backends.eviction import make_policy
from kvtier.storage_backends.eviction.answer_length import AnswerLengthConfig, AnswerLengthPolicy
from kvtier.storage_backends.eviction.ghost_cache import GhostBelady, ReuseBuckets, key_hash, key_sample
from kvtier.storage_backends.eviction.reuse_model import ReuseModel
from kvtier.storage_backends.eviction.sessions import SessionTracker

BUCKETS = ReuseBuckets((2.0, 10.0, 50.0, 250.0))


# ------------------------------------------------------------------ ghost cache


def test_buckets():
    assert BUCKETS.index(0.0) == 0 and BUCKETS.index(1.99) == 0 and BUCKETS.index(2.0) == 1
    assert BUCKETS.index(249.0) == 3 and BUCKETS.index(250.0) == 4 == len(BUCKETS)
    g = ReuseBuckets.geometric(2.0, 3600.0, 1.5)
    assert g.edges[0] == 2.0 and g.horizon == 3600.0 and list(g.edges) == sorted(g.edges)


def test_ghost_belady_bucket_statistics():
    """Capacity 1: short reuses (1 s apart, back to back) are Belady hits, long ones (120 s) are not."""
    ghost = GhostBelady(BUCKETS, sample_rate=1, window=10_000, refresh=10_000)
    t = 0.0
    longs = []
    for i in range(40):
        ghost.record(("s", i), t, 1)
        ghost.record(("s", i), t + 1.0, 1)  # reuse time 1 s -> bucket 0, always a hit at capacity 1
        longs.append((("l", i), t))
        ghost.record(("l", i), t + 1.5, 1)  # first touch of a long-reuse key
        t += 3.0
    for key, t0 in longs:
        ghost.record(key, t0 + 121.5, 1)  # reuse time 120 s -> bucket 3
    ghost.rerun(1)
    st = ghost.stats()
    assert st.reuses[0] == 40 and st.hits[0] == 40
    assert st.reuses[3] == 40
    # all 40 long keys were live at once over one slot: Belady can keep at most one of them
    assert st.hits[3] <= 1
    assert ghost.hit_prob[0] == 1.0 and ghost.hit_prob[3] <= 1 / 40
    assert ghost.hit_prob == sorted(ghost.hit_prob, reverse=True)  # non-increasing in the reuse time


def test_ghost_memory_is_bounded_and_sampling_is_deterministic():
    ghost = GhostBelady(BUCKETS, sample_rate=4, window=128, refresh=32)
    for i in range(5000):
        ghost.record(i % 700, float(i), 64)
        assert ghost.memory_items() <= 128
    assert ghost.runs > 0
    picked = [k for k in range(4000) if key_sample(k, 4)]
    assert 700 < len(picked) < 1300 and picked == [k for k in range(4000) if key_sample(k, 4)]


def test_ghost_first_run_comes_early_then_the_cadence_holds():
    """`first_run` sampled accesses trigger the first Belady run (default: two refreshes' worth); later runs come
    every `refresh` sampled accesses once the window holds two refreshes' worth."""
    default = GhostBelady(BUCKETS, sample_rate=1, window=4096, refresh=256)
    early = GhostBelady(BUCKETS, sample_rate=1, window=4096, refresh=256)
    early.first_run = 64
    assert default.first_run == 512
    runs_at = {id(default): [], id(early): []}
    for i in range(1100):
        for g in (default, early):
            if g.record(i % 50, float(i), 8):
                runs_at[id(g)].append(i + 1)
    assert runs_at[id(default)] == [512, 768, 1024]
    assert runs_at[id(early)] == [64, 512, 768, 1024]


# ------------------------------------------------------------------ reuse model


def test_reuse_model_hazard_and_censoring():
    m = ReuseModel(BUCKETS, n_classes=2, prior_strength=0.0)
    items = [m.start(0, 0.0) for _ in range(100)]
    for it in items[:50]:
        m.returned(it, 1.0)  # bucket 0
    m.advance(15.0)  # the 50 waiting items lived through buckets 0 and 1
    for it in items[50:75]:
        m.returned(it, 20.0)  # bucket 2
    assert m.at_risk[0][0] == 100 and m.events[0][0] == 50
    assert m.at_risk[0][1] == 50  # 25 returned in bucket 2 are counted there, not in 1
    assert m.at_risk[0][2] == 25  # the 25 returned items; the 25 still waiting have not lived through bucket 2
    m.advance(1000.0)  # past the horizon: the rest never came back
    assert m.items == 0
    hz = m.hazards()[0]
    assert hz[0] == pytest.approx(0.5) and hz[1] == pytest.approx(0.0) and hz[2] == pytest.approx(0.5)
    assert m.return_probability(0) == pytest.approx(0.75)
    pot = m.potential_table([1.0, 1.0, 1.0, 1.0])[0]
    assert pot[0] == pytest.approx(0.75) and pot[1] == pytest.approx(0.5) and pot[4] == 0.0
    pot_h = m.potential_table([1.0, 1.0, 0.0, 0.0])[0]
    assert pot_h[0] == pytest.approx(0.5)  # returns in bucket 2 would not be hits
    dens = m.density_table([1.0, 1.0, 1.0, 1.0])[0]
    assert all(d >= 0 for d in dens)

    # A return counts the whole buckets it lived through itself, even when nothing advanced the model meanwhile.
    m = ReuseModel(BUCKETS, n_classes=1, prior_strength=0.0)
    it = m.start(0, 0.0)
    m.returned(it, 20.0)  # lived through buckets 0 and 1, returned in bucket 2
    assert m.at_risk[0].tolist() == [1, 1, 1, 0] and m.events[0].tolist() == [0, 0, 1, 0]


def test_reuse_model_timing_ratios():
    """Timing keys say *when* relative to what the items' own classes expect (observed / expected returns)."""
    m = ReuseModel(BUCKETS, n_classes=2, prior_strength=0.0, n_timing=2)
    early, late = [], []
    for i in range(40):
        for key, out in ((0, early), (1, late)):
            it = m.start(i % 2, 0.0)  # both classes carry both keys, 20 items each
            it.timing = key
            out.append(it)
    for it in early[:20]:
        m.returned(it, 1.0)  # bucket 0, 10 per class
    for it in late[:20]:
        m.returned(it, 20.0)  # bucket 2, 10 per class
    m.advance(1000.0)
    assert m.timing_events[0][0] == 20 and m.timing_events[1][2] == 20
    assert m.timing_at_risk[0][0].tolist() == [20, 10, 10, 10] and m.timing_at_risk[1][1][2] == 20
    hz = m.hazards()
    assert hz[0][0] == pytest.approx(0.25) and hz[0][2] == pytest.approx(1 / 3)
    raw = m.timing_ratios(hz, strength=0.0)
    assert raw[0][0] == pytest.approx(20 / (40 * 0.25)) and raw[1][0] == 0.0  # 20 seen, 10 expected; 0 seen
    assert raw[0][2] == 0.0 and raw[1][2] == pytest.approx(20 / (40 / 3))  # key 0's 20 survivors never return
    assert raw[0][1] == 1.0 and raw[1][3] == 1.0  # nothing happens there: no reshaping
    shrunk = m.timing_ratios(hz, strength=40.0)  # 40 pseudo-items at the pooled hazard (20/80)
    assert shrunk[0][0] == pytest.approx((20 + 10) / (10 + 10))
    assert m.return_probability(0) == pytest.approx(0.5)  # whether: the classes' business, unchanged

    # A key that only rides on a class (key 0 = class 0, key 1 = class 1) earns no reshaping of its own.
    m = ReuseModel(BUCKETS, n_classes=2, prior_strength=0.0, n_timing=2)
    for cls, returns in ((0, 20), (1, 4)):
        items = [m.start(cls, 0.0) for _ in range(40)]
        for it in items:
            it.timing = cls
        for it in items[:returns]:
            m.returned(it, 1.0)
    m.advance(1000.0)
    conf = m.timing_ratios(m.hazards(), strength=0.0)
    assert conf[0][0] == pytest.approx(1.0) and conf[1][0] == pytest.approx(1.0)


def test_reuse_model_bounded_items():
    m = ReuseModel(BUCKETS, n_classes=1, max_items=10)
    got = [m.start(0, 0.0) for _ in range(25)]
    assert sum(x is not None for x in got) == 10 and m.items == 10 and m.dropped == 15


# ------------------------------------------------------------------ sessions


def test_session_inference_from_chains():
    tr = SessionTracker()
    s1, f1 = tr.begin([0, 1, 2, 3], 0.0)
    assert not f1 and s1.depth == 1
    assert s1.prev_gap is None
    s2, f2 = tr.begin([0, 1, 2, 4, 5], 10.0)  # repeats the parent's chain minus its partial last chunk
    assert f2 and s2 is s1 and s1.depth == 2 and s1.new_blocks == 2  # chunks 4 and 5
    assert s1.prev_gap == 10.0
    s3, f3 = tr.begin([0, 7, 8], 11.0)  # only the shared system prompt matches: a new conversation
    assert not f3 and s3 is not s1
    s4, f4 = tr.begin([0, 1, 2, 4, 5, 9], 30.0)  # the parent's last chunk was full: extended as is
    assert f4 and s4 is s1 and s1.depth == 3
    assert tr.session_of_chain([0, 1, 2, 4, 5, 9]) is s1


def test_session_tracker_is_bounded():
    tr = SessionTracker(max_sessions=20)
    for i in range(200):
        tr.begin([0, 1000 + 2 * i, 1001 + 2 * i], float(i))
    assert len(tr) <= 20 and tr.forgotten >= 180


# ------------------------------------------------------------------ synthetic conversations


def conversations(n_sessions: int, seed: int) -> list[TraceRequest]:
    """Sessions every 2 s; each turn adds 3 history chunks and a partial tail chunk; the answer length sets the
    reading time (20 tokens -> ~6 s, 600 tokens -> ~90 s); deeper conversations continue more often."""
    rng = random.Random(seed)
    events = []
    nid = 1
    for s in range(n_sessions):
        t = 2.0 * s
        chain = [0]
        depth = 1
        while True:
            new = list(range(nid, nid + 4))
            nid += 4
            chain = chain + new
            answer = rng.choice((20, 600))
            events.append((t, tuple(chain), answer))
            chain = chain[:-1]  # the partial tail is not part of the next turn
            if rng.random() > (0.3 if depth == 1 else 0.8):
                break
            t += (6.0 if answer == 20 else 90.0) + rng.expovariate(1 / 3.0)
            depth += 1
    events.sort(key=lambda e: e[0])
    return [
        TraceRequest(i, t, c, 512 * len(c) - 100, a, 0, None, 1) for i, (t, c, a) in enumerate(events)
    ]


def _replay(reqs, name, cap, **kw):
    clock = ReplayClock()
    p = make_policy(name, production=False, clock=clock, **kw)
    p.set_capacity(cap)
    c = simulate(reqs, p, cap, clock=clock)
    return c["host_hits"] / c["accesses"], p


def test_answer_length_uses_the_signals():
    reqs = conversations(900, seed=3)
    al, pol = _replay(reqs, "answer-length", 120)
    lru, _ = _replay(reqs, "lru", 120)
    arc, _ = _replay(reqs, "arc", 120)
    s3, _ = _replay(reqs, "s3fifo", 120)
    assert al > 1.1 * max(lru, arc, s3), (al, lru, arc, s3)
    # it learned that the next turn after a long answer comes late: a higher lower bound than after a short one
    short_b, long_b = pol._lb_bucket[0], pol._lb_bucket[4]
    assert long_b > short_b
    assert pol.buckets.lower(long_b) >= 30.0
    # and the timing rows: after a long answer the hazard of an early return is below the short answer's
    ratios = pol.reuse.timing_ratios(pol.reuse.hazards(), pol.cfg.timing_strength)
    key_short, key_long = pol._timing_key(0, 10.0), pol._timing_key(4, 10.0)
    early = pol.buckets.index(5.0)
    assert ratios[key_short][early] > 1.0 > ratios[key_long][early]


def test_user_pace_reshapes_timing():
    """Two kinds of users with the same answers: fast ones come back after ~5 s, slow ones after ~100 s. Only
    the previous gap tells them apart; with it the policy hits more than without it."""
    rng = random.Random(11)
    events, nid = [], 1
    for s in range(700):
        t, chain, pace = 2.0 * s, [0], (5.0 if s % 2 else 100.0)
        for _turn in range(6):
            chain = chain + list(range(nid, nid + 3))
            nid += 3
            events.append((t, tuple(chain), 100))
            t += pace * (0.8 + 0.4 * rng.random())
    events.sort(key=lambda e: e[0])
    reqs = [TraceRequest(i, t, c, 512 * len(c), a, 0, None, 1) for i, (t, c, a) in enumerate(events)]
    with_gap, pol = _replay(reqs, "answer-length", 300)
    without, _ = _replay(reqs, "answer-length", 300, gap_timing=False)
    assert with_gap > 1.04 * without, (with_gap, without)  # 1.065x with the default buckets
    ratios = pol.reuse.timing_ratios(pol.reuse.hazards(), pol.cfg.timing_strength)
    fast, slow = pol._timing_key(2, 5.0), pol._timing_key(2, 100.0)
    assert ratios[fast][pol.buckets.index(5.0)] > 1.0 > ratios[slow][pol.buckets.index(5.0)]


def test_first_victims_are_dead_chunks():
    """Mid-run, the first victims should be chunks nobody reads again (tails, ended conversations)."""
    reqs = conversations(300, seed=5)
    cut = int(0.7 * len(reqs))
    past, future = reqs[:cut], reqs[cut:]
    clock = ReplayClock()
    p = AnswerLengthPolicy(clock=clock, config=AnswerLengthConfig())
    p.set_capacity(10_000)
    simulate(past, p, 10_000, clock=clock)  # no evictions: it only learns
    clock.now = past[-1].timestamp + 1.0
    read_later = {h for r in future for h in r.hash_ids}
    first = list(p.victims(20, lambda _k: True))
    assert len(first) == 20
    lru = make_policy("lru")
    for r in past:
        for k in r.hash_ids:
            lru.on_access(k) if k in lru else lru.on_insert(k, 1)
    dead_al = sum(k not in read_later for k in first)
    dead_lru = sum(k not in read_later for k in lru.victims(20, lambda _k: True))
    assert dead_al >= 18 and dead_al >= dead_lru


def test_memory_of_learning_state_is_bounded():
    cfg = AnswerLengthConfig(
        max_sessions=50, ghost_window=256, ghost_refresh=64, max_items=100, max_ghost_keys=100,
        ghost_sample_rate=1,
    )
    clock = ReplayClock()
    p = AnswerLengthPolicy(clock=clock, config=cfg)
    p.set_capacity(64)
    reqs = conversations(400, seed=11)
    used = 0
    for r in reqs:
        clock.now = r.timestamp
        p.on_request(r.hash_ids, r.timestamp)
        for k in r.hash_ids:
            if k in p:
                p.on_access(k)
                continue
            if used >= 64:
                for v in p.victims(1, lambda _k: True):
                    p.on_remove(v)
                    used -= 1
            p.on_insert(k, 1)
            used += 1
        p.on_request_finished(r.hash_ids, r.output_length, r.timestamp)
        m = p.memory_items()
        assert m["ghost_trace"] <= 256 and m["reuse_items"] <= 100 and m["ghost_keys"] <= 100
        assert m["heap"] <= 4 * m["units"] + 4096
        assert m["sessions"] <= 50 + 64  # sessions holding resident chunks are never forgotten
        assert m["ctx"] == 0  # no request in flight between requests
        assert len(p) == used <= 64
    assert p.ghost.runs > 10 and p.stats()["ghost_runs"] == p.ghost.runs  # it did learn, within its window


def test_collected_victims_and_reinsertion():
    """A caller that collects victims first, or keeps some, leaves the policy consistent."""
    clock = ReplayClock()
    p = AnswerLengthPolicy(clock=clock)
    p.on_request([0, 1, 2, 3], 0.0)
    for k in (0, 1, 2, 3):
        p.on_insert(k, 1)
    p.on_request_finished([0, 1, 2, 3], 50, 0.0)
    got = list(p.victims(2, lambda k: k != 0))
    assert len(got) == 2 and 0 not in got
    p.on_remove(got[0])  # the caller keeps got[1]
    again = list(p.victims(3, lambda _k: True))
    assert got[1] in again and got[0] not in again and len(set(again)) == 3
    for k in again:
        p.on_remove(k)
    assert len(p) == 0 and list(p.victims(1, lambda _k: True)) == []


def test_orphans_without_request_calls():
    """LMCache-only use without any request context: every chunk is an orphan; it still evicts sensibly."""
    p = make_policy("answer-length", clock=lambda: 0.0)
    for k in range(10):
        p.on_insert(k, 1)
    p.on_access(3)
    v = list(p.victims(4, lambda _k: True))
    assert len(v) == 4 and len(set(v)) == 4


def test_retired_knobs_are_refused():
    """The reuse predictor's knobs went with it (issue 29): a configuration that still names one fails loudly, for
    the policy and for adaptive's answer-length expert alike, instead of being ignored."""
    for key in ("use_predictor", "predictor_window", "gate_margin", "max_label_delay", "use_chain"):
        with pytest.raises(ValueError, match=rf"answer-length: unknown option\(s\) \['{key}'\]"):
            make_policy("answer-length", clock=lambda: 0.0, **{key: 1})
    with pytest.raises(ValueError, match=r"answer-length: unknown option\(s\) \['use_predictor'\]"):
        make_policy("adaptive", clock=lambda: 0.0, answer_length={"use_predictor": False})


def test_no_look_ahead_in_replays():
    """The policy's decisions over a trace's first part are the same whether or not the rest of the trace
    follows: nothing it decides can depend on requests that have not arrived yet."""
    reqs = conversations(300, seed=4)
    cut = len(reqs) // 2

    def victims_of(rs):
        clock = ReplayClock()
        p = AnswerLengthPolicy(clock=clock)
        p.set_capacity(80)
        seen = []
        orig = p.victims

        def spy(need, evictable):
            out = list(orig(need, evictable))
            seen.append((clock.now, tuple(out)))
            return iter(out)

        p.victims = spy
        simulate(rs, p, 80, clock=clock)
        return seen

    part, full = victims_of(reqs[:cut]), victims_of(reqs)
    assert len(part) > 100 and full[: len(part)] == part


# ------------------------------------------------------------------ sampling hash


def test_ghost_salt_draws_another_sample():
    """Salt 0 is the default hash; another salt samples other keys (about as many), and the policy's ghost then
    records exactly the keys that hash samples."""
    assert all(key_hash(k) == key_hash(k, 0) for k in range(1000))
    a = {k for k in range(8000) if key_hash(k) % 8 == 0}
    b = {k for k in range(8000) if key_hash(k, 3) % 8 == 0}
    assert 800 < len(b) < 1200 and len(a & b) < 0.3 * len(b)
    reqs = conversations(120, seed=2)
    _, pol = _replay(reqs, "answer-length", 80, ghost_salt=3, ghost_sample_rate=4)
    seen = {e[0] for e in pol.ghost._trace}
    assert seen and all(key_hash(k, 3) % 4 == 0 for k in seen)
    assert any(key_hash(k) % 4 for k in seen)  # not the default sample
