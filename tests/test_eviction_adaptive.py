"""The `adaptive` policy: the tier follows whichever expert's full-size shadow leads on recent traffic.

Checked here: with one expert it IS that expert (the same hit on every access); it follows the better expert
and switches when the traffic changes; a lead made of noise does not make it switch; victims respect pins and sizes
and may be collected before removal; after a switch the old leader's residents go first; the shadows stay within the
capacity; bad settings are refused."""

from __future__ import annotations

import random

import pytest

from kvtier.replay.runner import ReplayClock, simulate
from kvtier.replay.traces import TraceRequest
from kvtier.storage_backends.eviction import make_policy
from kvtier.storage_backends.eviction.adaptive import AdaptivePolicy


def _req(i: int, t: float, chain, answer: int = 50) -> TraceRequest:
    return TraceRequest(i, t, tuple(chain), 512 * len(chain), answer, 0, None, 1)


def conversations(n_sessions: int, seed: int) -> list[TraceRequest]:
    """Multi-turn sessions every 2 s: each turn appends 4 chunks (the last a partial tail the next turn drops); the
    answer length sets the reading time (20 tokens: ~6 s, 600 tokens: ~90 s)."""
    rng = random.Random(seed)
    events, nid = [], 1
    for s in range(n_sessions):
        t, chain, depth = 2.0 * s, [0], 1
        while True:
            chain = chain + list(range(nid, nid + 4))
            nid += 4
            answer = rng.choice((20, 600))
            events.append((t, tuple(chain), answer))
            chain = chain[:-1]
            if rng.random() > (0.3 if depth == 1 else 0.8):
                break
            t += (6.0 if answer == 20 else 90.0) + rng.expovariate(1 / 3.0)
            depth += 1
    events.sort(key=lambda e: e[0])
    return [_req(i, t, c, a) for i, (t, c, a) in enumerate(events)]


def hot_set_and_scans(n: int, seed: int, t0: float = 0.0, first_id: int = 10**6) -> list[TraceRequest]:
    """One-chunk requests without sessions: 60% go to a hot set of 80 keys, 40% are keys never seen again (a scan).
    Scan-resistant policies (S3-FIFO, ARC) keep the hot set in a 100-entry tier; LRU lets the scan push it out."""
    rng = random.Random(seed)
    out, nid = [], first_id
    for i in range(n):
        if rng.random() < 0.6:
            key = rng.randrange(80)
        else:
            key, nid = nid, nid + 1
        out.append(_req(i, t0 + 0.01 * i, (key,)))
    return out


def reread_once(n: int, seed: int, t0: float, first_id: int) -> list[TraceRequest]:
    """One-chunk requests: every key is read twice, the second time about 40 accesses after the first, then never
    again. LRU (and a 100-entry tier) hits every second read; S3-FIFO's small queue (10 entries) has dropped the key
    by then and admits it to its main queue only on that second read, which is its last."""
    rng = random.Random(seed)
    slots: list[int | None] = [None] * (n + 80)
    nid = first_id
    for i in range(n):
        if slots[i] is None:
            slots[i] = nid
            j = i + 35 + rng.randrange(10)
            while j < len(slots) and slots[j] is not None:
                j += 1
            if j < len(slots):
                slots[j] = nid
            nid += 1
    return [_req(i, t0 + 0.01 * i, (k,)) for i, k in enumerate(slots[:n])]


def replay(reqs, name: str, cap: int, **kw):
    """Replay through the production replay loop; returns the per-access hit flags and the policy."""
    clock = ReplayClock()
    policy = make_policy(name, clock=clock, **kw)
    policy.set_capacity(cap)
    flags: list[bool] = []
    simulate(reqs, policy, cap, clock=clock, host_flags=flags)
    return flags, policy


def rate(flags: list[bool], start: int = 0, end: int | None = None) -> float:
    part = flags[start:end]
    return sum(part) / len(part)


@pytest.mark.parametrize("expert", ["lru", "arc", "s3fifo", "answer-length"])
def test_one_expert_is_that_expert(expert):
    """With a single expert the tier evicts exactly as the expert alone: the same hit or miss on every access."""
    reqs = conversations(300, seed=5)
    alone, _ = replay(reqs, expert, 60)
    followed, pol = replay(reqs, "adaptive", 60, experts=(expert,))
    assert sum(alone) > 0
    assert followed == alone
    assert pol.switches == 0


def test_follows_the_better_expert_and_switches_when_the_traffic_changes():
    phase1 = hot_set_and_scans(6000, seed=1)
    phase2 = reread_once(6000, seed=2, t0=100.0, first_id=10**7)
    reqs = phase1 + [_req(len(phase1) + r.index, r.timestamp, r.hash_ids) for r in phase2]
    cap, n1 = 100, len(phase1)
    lru, _ = replay(reqs, "lru", cap)
    s3, _ = replay(reqs, "s3fifo", cap)
    ada, pol = replay(reqs, "adaptive", cap, experts=("s3fifo", "lru"), min_half_life=500)
    # the two phases really favour different experts, by far
    assert rate(s3, 2000, n1) > rate(lru, 2000, n1) + 0.1
    assert rate(lru, n1 + 2000) > rate(s3, n1 + 2000) + 0.2
    # the tier is within a point of the better one in each phase once it has had time to notice
    assert rate(ada, 2000, n1) >= rate(s3, 2000, n1) - 0.01
    assert rate(ada, n1 + 2000) >= rate(lru, n1 + 2000) - 0.01
    assert pol.config.experts[pol.leader] == "lru"
    assert 1 <= pol.switches <= 3


def test_the_session_expert_leads_where_sessions_carry_the_signal():
    reqs = conversations(900, seed=3)
    best_classic = max(rate(replay(reqs, p, 120)[0]) for p in ("lru", "arc", "s3fifo"))
    al = rate(replay(reqs, "answer-length", 120)[0])
    ada_flags, pol = replay(reqs, "adaptive", 120)
    assert al > 1.1 * best_classic
    assert rate(ada_flags) >= al - 0.002
    assert pol.config.experts[pol.leader] == "answer-length"


def test_a_lead_made_of_noise_does_not_switch():
    """LRU and FIFO hit alike on uniform random traffic (neither can know more): the sign test keeps the first
    expert in the lead although the two shadows' counts keep differing by chance."""
    rng = random.Random(7)
    reqs = [_req(i, 0.01 * i, (rng.randrange(400),)) for i in range(20000)]
    _, pol = replay(reqs, "adaptive", 100, experts=("fifo", "lru"), min_half_life=500)
    assert pol.sq[0][1] > 0  # they did disagree
    assert pol.switches == 0


def test_victims_skip_pins_and_free_enough_bytes_when_collected_first():
    pol = AdaptivePolicy(experts=("lru", "s3fifo"))
    for k in range(10):
        pol.on_insert(k, 100)
    pinned = {0, 1}
    got = list(pol.victims(250, lambda k: k not in pinned))  # collected before any removal (LMCache's way)
    assert len(got) == len(set(got)) == 3
    assert not pinned & set(got)
    for k in got:
        pol.on_remove(k)
    assert len(pol) == 7 and all(k not in pol for k in got)
    # nothing evictable: no victim, no endless loop
    assert list(pol.victims(100, lambda k: False)) == []


def test_unannounced_capacity_is_the_high_water_mark():
    """Without set_capacity (LMCache's host tier never announces one) the shadows take the tier's largest size;
    with one expert the tier still evicts as that expert does."""
    lru = make_policy("lru")
    pol = AdaptivePolicy(experts=("lru",))
    rng = random.Random(3)
    resident: dict[int, None] = {}
    cap = 20
    for _ in range(3000):
        k = rng.randrange(60)
        if k in resident:
            lru.on_access(k)
            pol.on_access(k)
            continue
        if len(resident) >= cap:
            v_lru = next(iter(lru.victims(1, lambda _k: True)))
            v_pol = next(iter(pol.victims(1, lambda _k: True)))
            assert v_pol == v_lru
            lru.on_remove(v_lru)
            pol.on_remove(v_pol)
            del resident[v_pol]
        resident[k] = None
        lru.on_insert(k, 1)
        pol.on_insert(k, 1)
    assert pol._capacity() == cap
    assert all(n <= cap for n in pol.memory_items().values())


def test_shadows_stay_within_the_capacity():
    reqs = conversations(400, seed=9)
    _, pol = replay(reqs, "adaptive", 50)
    items = pol.memory_items()
    assert items["resident"] <= 50
    assert all(items[f"shadow_{e}"] <= 50 for e in pol.config.experts)


@pytest.mark.parametrize("kw", [{"bogus": 1}, {"experts": ("lru", "lru")}, {"experts": ()},
                                {"experts": ("belady",)}, {"experts": ("adaptive",)}, {"switch_z": -1}])
def test_bad_settings_are_refused(kw):
    with pytest.raises(ValueError):
        make_policy("adaptive", **kw)


def sliding_window(n: int, seed: int, t0: float, first_id: int) -> list[TraceRequest]:
    """One-chunk requests over a window of 50 keys that slides by one key every 10 requests: recency is all there
    is, so LRU keeps the window while LFU keeps whatever was counted most before."""
    rng = random.Random(seed)
    return [_req(i, t0 + 0.01 * i, (first_id + i // 10 + rng.randrange(50),)) for i in range(n)]


def test_after_a_switch_the_old_leaders_residents_go_first():
    """LFU leads on a hot set (its counts keep it through the scans); then the traffic slides and LRU takes the lead.
    The tier still holds the hot set, which LRU's shadow dropped long ago: those residents must be the first victims,
    else they sit in the tier for good (LRU's own order never names them) and shrink it for the new leader."""
    phase1 = hot_set_and_scans(6000, seed=4)
    phase2 = sliding_window(6000, seed=5, t0=100.0, first_id=10**7)
    reqs = phase1 + [_req(len(phase1) + r.index, r.timestamp, r.hash_ids) for r in phase2]
    cap, n1 = 100, len(phase1)
    lru, _ = replay(reqs, "lru", cap)
    lfu, _ = replay(reqs, "lfu", cap)
    ada, pol = replay(reqs, "adaptive", cap, experts=("lfu", "lru"), min_half_life=500)
    assert rate(lfu, 2000, n1) > rate(lru, 2000, n1) + 0.05
    assert rate(lru, n1 + 2000) > rate(lfu, n1 + 2000) + 0.2
    assert rate(ada, 2000, n1) >= rate(lfu, 2000, n1) - 0.01
    assert rate(ada, n1 + 2000) >= rate(lru, n1 + 2000) - 0.01
    assert pol.config.experts[pol.leader] == "lru" and pol.switches >= 1
