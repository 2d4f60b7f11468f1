"""The Belady-loss breakdown tool (`kvtier.replay.eviction_loss`): exact categories on a handcrafted trace, and
per-policy hit counts that are the replay's own (`replay.simulate`)."""

from __future__ import annotations

from kvtier.replay.eviction_loss import GAP_EDGES, Category, breakdown, categories, format_breakdown, host_hits
from kvtier.replay.runner import ReplayClock, build_policy, simulate
from kvtier.replay.traces import TraceRequest


def _trace(events):
    return [TraceRequest(i, t, tuple(c), 512 * len(c), 20, 0, None, 1) for i, (t, c) in enumerate(events)]


def test_categories_and_exact_hits_on_a_handcrafted_trace():
    # block 1 heads every chain (first-block); 2 and 3 come back once each (2nd access), 2 once more (3rd)
    reqs = _trace([(0, [1, 2]), (10, [1, 3]), (20, [1, 2]), (100, [1, 3]), (400, [1, 2])])
    assert GAP_EDGES == (15.0, 30.0, 60.0, 120.0, 300.0)
    cats = categories(reqs)
    assert cats == [None, None,
                    Category("first-block", 0), None,
                    Category("first-block", 0), Category("2nd-access", 1),
                    Category("first-block", 3), Category("2nd-access", 3),
                    Category("first-block", 5), Category("3rd+-access", 5)]
    assert categories(reqs, score_from=100)[:6] == [None] * 6  # earlier requests are not scored
    # capacity 2, LRU: block 1 always stays; 3 pushes 2 out and 2 pushes 3 out, so only block 1 hits
    assert host_hits(reqs, "lru", 2) == [False, False, True, False, True, False, True, False, True, False]
    bd = breakdown(reqs, ["lru", "belady"], 2)
    assert bd.total == 10 and bd.first_touches == 3 and sum(bd.accesses.values()) == 7
    assert dict(bd.hits["lru"]) == {Category("first-block", 0): 2, Category("first-block", 3): 1,
                                    Category("first-block", 5): 1}
    # one slot: every request reads two blocks through it, so even Belady never hits
    one = breakdown(reqs, ["belady"], 1)
    assert sum(one.hits["belady"].values()) == 0
    assert "first-block gap 0-15 s" in format_breakdown(bd, ["lru", "belady"])


def test_hits_are_the_replays_own():
    """On conversation-shaped traffic, every policy's per-access flags add up to replay.simulate's own counters
    (a separate run: one flag per access, the hits where the counters put them)."""
    events, nid, t = [], 1, 0.0
    for s in range(60):
        chain = [0]
        for turn in range(1 + s % 4):
            chain = chain + list(range(nid, nid + 3))
            nid += 3
            events.append((t + 7.0 * s + 40.0 * turn, list(chain)))
    events.sort(key=lambda e: e[0])
    reqs = _trace(events)
    for name in ("lru", "answer-length", "belady"):
        flags = host_hits(reqs, name, 40)
        clock = ReplayClock()
        p = build_policy(name, clock, 40)
        if name == "belady":
            p.set_future([h for r in reqs for h in r.hash_ids])
        c = simulate(reqs, p, 40, clock=clock)
        assert sum(flags) == c["host_hits"] > 0, name
        assert len(flags) == c["accesses"] == sum(len(r.hash_ids) for r in reqs), name
