"""Rolling-origin folds (`kvtier.replay.folds`) and the bursty synthetic family (`kvtier.replay.synthetic`): exact
windows and warm-up, capacities on the scored window, worst-fold selection, a fold replay against a direct replay,
and the generator's determinism and documented structure with and without sessions."""

from __future__ import annotations

import math
import random
import statistics

import pytest

from kvtier.replay.folds import (
    Fold,
    fold_requests,
    gap_closed,
    replay_fold,
    rolling_folds,
    rolling_folds_for,
    worst_fold,
)
from kvtier.replay.runner import parse_capacity, replay_one
from kvtier.replay.synthetic import BurstySpec, bursty_trace, mmpp_arrivals
from kvtier.replay.traces import TraceRequest, recover_sessions


def reqs_at(times, chains=None):
    chains = chains or [(i,) for i in range(len(times))]
    return [TraceRequest(i, t, tuple(c), 512 * len(c), 10, i, None, 1) for i, (t, c) in enumerate(zip(times, chains))]


def test_rolling_folds_default_windows_are_the_conversation_minutes():
    assert [(f.name, f.score_from_s, f.score_until_s) for f in rolling_folds()] == [
        ("10-15 min", 600.0, 900.0), ("15-20 min", 900.0, 1200.0), ("20-25 min", 1200.0, 1500.0),
        ("25-30 min", 1500.0, 1800.0)]
    # a step that does not divide the span: the last window is cut at the end
    assert [(f.score_from_s, f.score_until_s) for f in rolling_folds(600, 500, 1800)] == [
        (600, 1100), (1100, 1600), (1600, 1800)]


def test_fold_requests_exact_windows_and_warm_up_before():
    times = [0.0, 599.999, 600.0, 750.0, 899.999, 900.0, 1200.0, 1799.0]
    reqs = reqs_at(times)
    expect = {  # fold -> (replayed, scored) indices, by hand
        "10-15 min": ([0, 1, 2, 3, 4], [2, 3, 4]),
        "15-20 min": ([0, 1, 2, 3, 4, 5], [5]),
        "20-25 min": ([0, 1, 2, 3, 4, 5, 6], [6]),
        "25-30 min": ([0, 1, 2, 3, 4, 5, 6, 7], [7]),
    }
    for f in rolling_folds():
        replayed, scored = fold_requests(reqs, f)
        assert ([r.index for r in replayed], [r.index for r in scored]) == expect[f.name]
    # every request from minute 10 on is scored in exactly one fold
    scored_once = sorted(r.index for f in rolling_folds() for r in fold_requests(reqs, f)[1])
    assert scored_once == [2, 3, 4, 5, 6, 7]


def test_rolling_folds_for_scale_to_the_span():
    reqs = reqs_at([float(t) for t in range(0, 91)])  # t = 0, 1, ..., 90 s
    folds = rolling_folds_for(reqs, n=4)
    # the first third (t < 30) is warm-up only; [30, 90] is cut into 4 windows of 15 s, the last one closed
    got = [[r.index for r in fold_requests(reqs, f)[1]] for f in folds]
    assert got == [list(range(30, 45)), list(range(45, 60)), list(range(60, 75)), list(range(75, 91))]
    assert [f.name for f in folds] == ["30-45 s", "45-60 s", "60-75 s", "75-90 s"]
    with pytest.raises(ValueError):
        rolling_folds_for(reqs_at([5.0, 5.0]))


def test_capacity_is_a_fraction_of_the_replayed_requests_unique_blocks():
    # warm-up: 200 unique blocks; scored window: 40 unique blocks (10 of them also seen in the warm-up): 230 in all
    warm = [tuple(range(i * 20, i * 20 + 20)) for i in range(10)]
    scored = [tuple(range(190, 210)), tuple(range(1000, 1020)), tuple(range(1000, 1010))]
    reqs = reqs_at([1.0 * i for i in range(10)] + [20.0, 21.0, 22.0], warm + scored)
    fold = Fold("w", 20.0, 30.0)
    r = replay_fold(reqs, fold, "lru", 0.1)
    assert r.host_capacity_blocks == 23  # round(0.1 * 230), neither 0.1 * 40 (the window) nor 0.1 * 250
    assert replay_fold(reqs, fold, "lru", 0.002).host_capacity_blocks == 1  # round(0.46), at least one
    with pytest.raises(ValueError):
        replay_fold(reqs, fold, "lru", 1.5)


def test_worst_fold_and_gap_closed():
    assert worst_fold({"a": 0.3, "b": 0.1, "c": 0.1, "d": 0.2}) == ("b", 0.1)  # the smallest, first on ties
    name, value = worst_fold({"a": 0.3, "b": math.nan, "c": -0.5})
    assert name == "b" and math.isnan(value)  # undefined counts as the worst
    with pytest.raises(ValueError):
        worst_fold({})
    assert gap_closed(0.2, 0.1, 0.5) == pytest.approx(0.25)
    assert math.isnan(gap_closed(0.2, 0.3, 0.3))


def test_fold_replay_equals_a_direct_truncated_replay():
    rng = random.Random(3)
    chains = [tuple(rng.randrange(60) for _ in range(rng.randint(1, 6))) for _ in range(400)]
    reqs = reqs_at([0.25 * i for i in range(400)], chains)  # t in [0, 100)
    fold = Fold("mid", 50.0, 75.0)
    truncated = [r for r in reqs if r.timestamp < 75.0]
    uniq = len({h for r in truncated for h in r.hash_ids})
    for policy in ("lru", "answer-length"):
        got = replay_fold(reqs, fold, policy, 0.2)
        direct = replay_one(truncated, policy, parse_capacity("0.2", uniq), score_from=50.0)
        assert (got.accesses, got.host_hits, got.ssd_hits, got.misses, got.host_evictions) == (
            direct.accesses, direct.host_hits, direct.ssd_hits, direct.misses, direct.host_evictions)
        assert got.accesses == sum(len(r.hash_ids) for r in truncated if r.timestamp >= 50.0)
        untruncated = replay_one(reqs, policy, parse_capacity("0.2", uniq), score_from=50.0)
        assert untruncated.accesses > got.accesses  # the truncation matters


# ------------------------------------------------------------------ bursty synthetic family


SMALL = dict(duration_s=600.0)


def test_generator_is_deterministic_per_seed():
    for sessions in (True, False):
        a = bursty_trace(BurstySpec(sessions=sessions, seed=5, **SMALL))
        assert a == bursty_trace(BurstySpec(sessions=sessions, seed=5, **SMALL))
        assert a != bursty_trace(BurstySpec(sessions=sessions, seed=6, **SMALL))
        assert [r.index for r in a] == list(range(len(a)))
        assert all(x.timestamp <= y.timestamp for x, y in zip(a, a[1:]))


def test_sessions_variant_turns_extend_their_parent():
    spec = BurstySpec(sessions=True, seed=7, **SMALL)
    reqs = bursty_trace(spec)
    follow = [r for r in reqs if r.parent is not None]
    assert follow and len(follow) < len(reqs)
    for r in follow:
        p = reqs[r.parent]
        assert p.index < r.index and r.session == p.session and r.turn == p.turn + 1
        assert r.hash_ids[:len(p.hash_ids)] == p.hash_ids and len(r.hash_ids) > len(p.hash_ids)
        # the reading gap's lower bound grows with the previous answer's length
        assert r.timestamp - p.timestamp >= spec.gap_floor_s + spec.gap_per_token_s * p.output_length - 0.002
    # most conversations never return (1 - p_next = 70% after a first turn; a few returns fall past the end);
    # the structure is what Mooncake session recovery finds from the chains
    returned = {r.parent for r in follow}
    early = [r for r in reqs if r.parent is None and r.timestamp < spec.duration_s / 2]
    assert 0.55 <= sum(r.index not in returned for r in early) / len(early) <= 0.8
    recovered = recover_sessions([r.hash_ids for r in reqs])
    assert [(s, p, t) for s, p, t in recovered] == [(r.session, r.parent, r.turn) for r in reqs]


def test_no_sessions_variant_shares_only_document_prefixes():
    spec = BurstySpec(sessions=False, seed=7, **SMALL)
    reqs = bursty_trace(spec)
    assert all(r.parent is None and r.turn == 1 and r.session == r.index for r in reqs)
    chains = {r.hash_ids for r in reqs}
    for r in reqs:  # no request starts with another request's whole prompt
        assert not any(r.hash_ids[:k] in chains for k in range(1, len(r.hash_ids)))
    readers: dict[int, int] = {}
    for r in reqs:
        for h in set(r.hash_ids):
            readers[h] = readers.get(h, 0) + 1
    prefixes = set()
    for r in reqs:  # the blocks a request shares with others are a prefix of it (block 0, then a document)
        shared = [readers[h] > 1 for h in r.hash_ids]
        k = shared.index(False) if False in shared else len(shared)
        assert not any(shared[k:]) and k < len(r.hash_ids) - 1  # at least two own blocks follow
        if k > 1:
            prefixes.add(r.hash_ids[1:k])
    assert 1 < len(prefixes) <= spec.documents
    assert all(p is None for _, p, _ in recover_sessions([r.hash_ids for r in reqs]))


def test_arrivals_are_bursty_at_the_documented_mean_rate():
    def dispersion(spec: BurstySpec) -> tuple[float, float]:
        times = mmpp_arrivals(random.Random(spec.seed), spec)
        counts = [0] * int(spec.duration_s // 10)
        for t in times:
            counts[int(t // 10)] += 1
        return len(times) / spec.duration_s, statistics.variance(counts) / statistics.mean(counts)

    rate, bursty = dispersion(BurstySpec(seed=1, duration_s=20_000.0, rate=2.0))
    assert rate == pytest.approx(2.0, rel=0.15) and bursty > 3.0
    rate, flat = dispersion(BurstySpec(seed=1, duration_s=20_000.0, rate=2.0, burst_factor=1.0))
    assert rate == pytest.approx(2.0, rel=0.05) and flat < 1.3  # a plain Poisson process: variance = mean


@pytest.mark.parametrize("sessions", [True, False])
def test_default_sizes_fit_a_few_second_replay(sessions):
    for seed in (1, 2):
        reqs = bursty_trace(BurstySpec(sessions=sessions, seed=seed))
        assert 3000 <= len(reqs) <= 5000
        assert 30_000 <= len({h for r in reqs for h in r.hash_ids}) <= 60_000
        assert reqs[-1].timestamp < 1800.0
