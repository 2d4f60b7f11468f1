"""Unit tests of the scheduling policy core: tier hints, disk-HRRN, the dual queue, FCFS baseline."""

from __future__ import annotations

import dataclasses

import pytest

from kvtier.scheduler_hooks.dual_queue_policy import (
    DualQueueConfig,
    DualQueuePolicy,
    FCFSPolicy,
    make_scheduling_policy,
)
from kvtier.scheduler_hooks.hrrn import DiskHRRNQueue, GiB, response_ratio
from kvtier.scheduler_hooks.tier_hint import TierHint, TierState, classify

MiB = 1 << 20


def ready(rid: str, arrival: float, host: int = 512, inflight: int = 0) -> TierHint:
    return TierHint(rid, host_tokens=host, state=TierState.READY, arrival=arrival, inflight_tokens=inflight)


def miss(rid: str, arrival: float) -> TierHint:
    return TierHint(rid, state=TierState.MISS, arrival=arrival)


def preparing(rid: str, arrival: float, nbytes: int) -> TierHint:
    return TierHint(rid, ssd_tokens=max(nbytes // (128 * 1024), 1), ssd_bytes=nbytes, state=TierState.PREPARING,
                    arrival=arrival)


def serve_all(policy, now: float, free: int | None = None) -> list[str]:
    """Admit requests one after the other at time `now` until `pick` returns None."""
    out = []
    while (rid := policy.pick(now, free)) is not None:
        policy.dispatched(rid, now)
        out.append(rid)
    return out


# --- tier hints ----------------------------------------------------------------------------------------------------


def test_tier_hint_is_frozen_validated_and_classified():
    h = TierHint("r", gpu_tokens=16, host_tokens=32, ssd_tokens=64, ssd_bytes=64 * 128 * 1024, state="preparing",
                 arrival=1.5, inflight_tokens=8)
    assert h.state is TierState.PREPARING and h.cached_tokens == 112 and h.needs_ssd
    with pytest.raises(dataclasses.FrozenInstanceError):
        h.gpu_tokens = 0  # type: ignore[misc]
    with pytest.raises(ValueError):
        TierHint("r", host_tokens=-1)
    assert h.with_state(TierState.LOADING).state is TierState.LOADING and h.state is TierState.PREPARING
    assert classify(0, 0, 0) is TierState.MISS
    assert classify(10, 0, 0) is TierState.READY
    assert classify(0, 10, 5) is TierState.PREPARING
    assert classify(0, 10, 5, loading=True) is TierState.LOADING
    assert TierState.READY.schedulable and TierState.MISS.schedulable
    assert not TierState.PREPARING.schedulable and not TierState.LOADING.schedulable


# --- disk-HRRN -----------------------------------------------------------------------------------------------------


def test_response_ratio_formula():
    assert response_ratio(10.0, 0.0, GiB) == pytest.approx(11.0)
    assert response_ratio(10.0, 6.0, 2 * GiB) == pytest.approx(3.0)
    assert response_ratio(1.0, 5.0, GiB) == 1.0  # not yet arrived: no waiting credit


def test_hrrn_prefers_small_reads_then_waiting_time_wins():
    q = DiskHRRNQueue()
    q.push("a", 0.0, 1 * GiB)
    q.push("b", 0.0, 4 * GiB)
    q.push("c", 5.0, GiB // 2)
    # t=6: a = 1+6/1 = 7, b = 1+6/4 = 2.5, c = 1+1/0.5 = 3
    assert q.ordered(6.0) == ["a", "c", "b"]
    # t=10: a = 11, c = 1+5/0.5 = 11 (tie: the smaller read first), b = 3.5
    assert q.ordered(10.0) == ["c", "a", "b"]
    assert q.ratio("b", 10.0) == pytest.approx(3.5)
    # t=0.5: only a and b have arrived; equal ratio -> smaller first; c has no credit yet
    assert q.peek(0.5) == "a"
    assert [q.pop(10.0), q.pop(10.0), q.pop(10.0), q.pop(10.0)] == ["c", "a", "b", None]


def test_hrrn_starvation_puts_old_entries_first_and_push_updates_size():
    q = DiskHRRNQueue()
    q.push("big", 0.0, 100 * GiB)
    q.push("old", 1.0, 50 * GiB)
    q.push("small", 9.0, MiB)
    assert q.peek(10.0) == "small"
    assert q.ordered(10.0, starve_after_s=8.5) == ["big", "old", "small"]
    assert q.peek(10.0, starve_after_s=9.5) == "big"
    assert q.peek(10.0, eligible=lambda r: r != "small") == "old"  # old: 9/50 > big: 10/100
    q.push("big", 99.0, MiB // 2)  # re-push: new size, original arrival and position kept
    assert q.get("big").arrival == 0.0 and q.peek(10.0) == "big"
    assert q.remove("big") and not q.remove("big") and len(q) == 2 and "big" not in q


# --- dual queue ----------------------------------------------------------------------------------------------------


def test_ready_queue_is_fcfs_by_arrival_not_by_add_order():
    p = DualQueuePolicy()
    p.add(ready("r3", 3.0), 10)
    p.add(miss("r1", 1.0), 10)
    p.add(ready("r2", 2.0), 10)
    assert serve_all(p, 4.0) == ["r1", "r2", "r3"]
    assert len(p) == 0


def test_promoted_request_is_inserted_at_its_arrival_position():
    p = DualQueuePolicy()
    p.add(ready("a", 1.0), 1)
    p.add(preparing("s", 2.0, GiB), 1)
    p.add(ready("c", 3.0), 1)
    p.add(ready("d", 4.0), 1)
    assert p.pick(5.0) == "a"
    p.dispatched("a", 5.0)
    assert p.next_prefetch(5.0) == "s"
    assert p.hint("s").state is TierState.LOADING and "s" in p.loading_ids()
    assert p.pick(5.0) == "c"  # s is loading: not schedulable, does not block c
    p.prefetch_done("s", 6.0)  # promoted at t=6, after c and d arrived: goes before them (arrival 2)
    assert p.ready_ids() == ["s", "c", "d"]
    assert p.hint("s").state is TierState.READY and p.hint("s").ssd_tokens == 0
    assert serve_all(p, 6.0) == ["s", "c", "d"]
    assert p.stats["promoted"] == 1


def test_update_moves_between_queues_and_keeps_arrival():
    p = DualQueuePolicy()
    p.add(ready("a", 1.0), 1)
    p.add(ready("b", 2.0), 1)
    # b's host data was evicted: the connector now reports it on SSD
    p.update(dataclasses.replace(preparing("b", 2.0, GiB), arrival=77.0))
    assert p.ready_ids() == ["a"] and p.preparing_ids() == ["b"]
    assert p.hint("b").arrival == 2.0  # arrival is the original one, whatever a later hint says
    p.update(ready("b", 50.0))
    assert p.ready_ids() == ["a", "b"]


def test_oversized_requests_are_skipped_not_blocking():
    p = DualQueuePolicy(DualQueueConfig(starvation_floor_s=100.0))  # nobody starves in this test
    p.add(ready("huge", 1.0), 1000)
    p.add(ready("small", 2.0), 100)
    p.add(ready("mid", 3.0), 300)
    assert p.pick(3.5, free_gpu=350) == "small"
    p.dispatched("small", 3.5)
    assert p.pick(3.5, free_gpu=250) is None  # nothing fits
    assert p.pick(3.5, free_gpu=300) == "mid"
    assert p.stats["skipped_oversized"] >= 3
    assert p.pick(3.5, free_gpu=1000) == "huge"
    # the FCFS baseline blocks on the same head instead
    f = FCFSPolicy()
    f.add(ready("huge", 1.0), 1000)
    f.add(ready("small", 2.0), 100)
    assert f.pick(3.5, free_gpu=350) is None
    assert f.pick(3.5, free_gpu=1000) == "huge"


def test_delay_hit_defers_until_inflight_prefix_lands():
    cfg = DualQueueConfig(delay_hit=True, delay_hit_threshold_tokens=100, starvation_floor_s=1e9)
    p = DualQueuePolicy(cfg)
    p.add(ready("sibling", 1.0, inflight=512), 10)
    p.add(ready("other", 2.0), 10)
    p.add(ready("tiny", 3.0, inflight=99), 10)  # below the threshold: not deferred
    assert p.deferred_ids() == ["sibling"]
    assert p.pick(4.0) == "other"
    p.dispatched("other", 4.0)
    assert p.pick(4.0) == "tiny"
    assert p.stats["deferred_delay_hit"] >= 1
    p.update(ready("sibling", 1.0, inflight=0))  # the in-flight load landed
    assert p.pick(4.0) == "sibling"
    # without delay-hit avoidance the same request goes first (and would recompute its prefix)
    q = make_scheduling_policy("dual-queue")
    q.add(ready("sibling", 1.0, inflight=512), 10)
    q.add(ready("other", 2.0), 10)
    assert q.pick(4.0) == "sibling"
    # the threshold is configurable
    r = DualQueuePolicy(dataclasses.replace(cfg, delay_hit_threshold_tokens=1000))
    r.add(ready("sibling", 1.0, inflight=512), 10)
    r.add(ready("other", 2.0), 10)
    assert r.pick(4.0) == "sibling"


def test_starvation_bound_stops_skipping_for_an_old_oversized_request():
    p = DualQueuePolicy(DualQueueConfig(starvation_multiple=2.0, starvation_floor_s=0.5, mean_window=4))
    for i in range(4):  # four requests that each waited 1 s: mean 1 s, bound 2 s
        p.add(ready(f"w{i}", float(i)), 1)
        p.dispatched(f"w{i}", float(i) + 1.0)
    assert p.mean_wait == pytest.approx(1.0) and p.starvation_threshold() == pytest.approx(2.0)
    p.add(ready("big", 10.0), 100)
    p.add(ready("s1", 10.5), 10)
    p.add(ready("s2", 10.6), 10)
    assert p.pick(11.0, free_gpu=50) == "s1"  # big waited 1 s: skipped
    p.dispatched("s1", 11.0)
    assert p.pick(12.5, free_gpu=50) is None  # big waited 2.5 s > 2 s: s2 must not overtake it again
    assert p.order(12.5, free_gpu=50)[0] == "big"
    assert p.pick(12.5, free_gpu=100) == "big"
    assert p.stats["starvation_overrides"] >= 1
    # a request larger than the whole GPU can never run: the bound does not hold the queue for it
    q = DualQueuePolicy(DualQueueConfig(starvation_multiple=2.0, starvation_floor_s=0.5, gpu_capacity=80))
    q.add(ready("never", 0.0), 100)
    q.add(ready("s", 1.0), 10)
    assert q.pick(50.0, free_gpu=50) == "s"


def test_starvation_bound_overrides_delay_hit_and_hrrn():
    p = DualQueuePolicy(DualQueueConfig(starvation_multiple=1.0, starvation_floor_s=3.0))
    p.add(ready("stuck", 0.0, inflight=4096), 1)  # its in-flight producer never reports back
    p.add(ready("x", 1.0), 1)
    assert p.pick(2.0) == "x"
    p.dispatched("x", 2.0)
    p.add(ready("y", 2.5), 1)
    assert p.pick(2.9) == "y"  # stuck waited 2.9 s < 3 s
    assert p.pick(3.5) == "stuck"  # bound reached: served despite the deferral
    # preparing queue: a huge old read is issued before a small new one once it starves
    q = DualQueuePolicy(DualQueueConfig(starvation_multiple=1.0, starvation_floor_s=3.0))
    q.add(preparing("huge", 0.0, 100 * GiB), 1)
    q.add(preparing("small", 1.9, MiB), 1)
    assert q.prefetch_order(2.0) == ["small", "huge"]
    assert q.prefetch_order(3.5) == ["huge", "small"]
    assert q.next_prefetch(3.5) == "huge"


def test_mean_wait_uses_a_sliding_window():
    p = DualQueuePolicy(DualQueueConfig(mean_window=2, starvation_multiple=3.0, starvation_floor_s=0.0))
    for rid, arr, at in (("a", 0.0, 10.0), ("b", 0.0, 1.0), ("c", 0.0, 3.0)):
        p.add(miss(rid, arr), 1)
        p.dispatched(rid, at)
    assert p.mean_wait == pytest.approx(2.0)  # (1 + 3) / 2: the 10 s wait left the window
    assert p.starvation_threshold() == pytest.approx(6.0)


def test_order_lists_admissible_then_skipped_then_loading_then_preparing():
    p = DualQueuePolicy(DualQueueConfig(starvation_floor_s=1e9))
    p.add(ready("a", 1.0), 40)
    p.add(ready("big", 2.0), 500)
    p.add(ready("deferred", 3.0, inflight=1000), 10)
    p.add(miss("b", 4.0), 40)
    p.add(ready("c", 5.0), 40)  # does not fit once a and b are counted
    p.add(preparing("p_large", 0.0, 8 * GiB), 1)
    p.add(preparing("p_small", 0.5, GiB), 1)
    p.add(preparing("p_load", 1.0, GiB), 1)
    assert p.next_prefetch(6.0) == "p_small"  # 5.5/1 > 5.0/1 > 6/8; issued: becomes LOADING
    assert p.order(6.0, free_gpu=100, with_prefetch_order=True) == [
        "a", "b", "big", "deferred", "c", "p_small", "p_load", "p_large"]
    assert p.order(6.0, with_prefetch_order=True) == [
        "a", "big", "b", "c", "deferred", "p_small", "p_load", "p_large"]
    assert p.order(6.0, free_gpu=100)[:6] == ["a", "b", "big", "deferred", "c", "p_small"]
    assert set(p.order(6.0, free_gpu=100)[6:]) == {"p_load", "p_large"}


def test_remove_and_unknown_ids():
    p = DualQueuePolicy()
    p.add(ready("a", 1.0), 1)
    p.add(preparing("b", 2.0, GiB), 1)
    assert p.remove("a") and p.remove("b") and not p.remove("zzz")
    assert len(p) == 0 and p.pick(3.0) is None and p.next_prefetch(3.0) is None
    p.dispatched("zzz", 3.0)  # ignored
    p.prefetch_done("zzz", 3.0)  # ignored


def test_fcfs_prefetch_baseline_blocks_on_its_head_io():
    f = make_scheduling_policy("fcfs+prefetch")
    f.add(preparing("s", 1.0, GiB), 1)
    f.add(ready("r", 2.0), 1)
    assert f.pick(3.0) is None  # head waits for its SSD read: head-of-line blocking
    assert f.next_prefetch(3.0) == "s" and f.next_prefetch(3.0) is None
    f.prefetch_done("s", 4.0)
    assert serve_all(f, 4.0) == ["s", "r"]
    plain = make_scheduling_policy("fcfs")
    plain.add(preparing("s", 1.0, GiB), 1)
    assert plain.next_prefetch(3.0) is None and plain.pick(3.0) == "s"  # reads happen on the critical path
    with pytest.raises(ValueError):
        make_scheduling_policy("lifo")
