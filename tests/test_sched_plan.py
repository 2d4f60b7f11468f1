"""Load or recompute (`LoadPlanner`), the shared hint derivation, the `kvtier.scheduler` keys, and HRRN's ready
order."""

from __future__ import annotations

import dataclasses

import pytest

from kvtier.scheduler_hooks.dual_queue_policy import SCHEDULER_KEYS, DualQueueConfig, DualQueuePolicy
from kvtier.scheduler_hooks.hint_derivation import (
    PrefetchPhase,
    Residency,
    count_inflight,
    derive_tier_hint,
    walk_prefix,
)
from kvtier.scheduler_hooks.load_plan import (
    LoadAction,
    LoadCostModel,
    LoadPlanConfig,
    LoadPlanner,
    PlanContext,
)
from kvtier.scheduler_hooks.prefix_walk import HOST, RESIDENT, SSD, walk_chunks
from kvtier.scheduler_hooks.tier_hint import TierHint, TierState

COST = LoadCostModel()  # Llama-3-8B on an H100, 1.5 GB/s SSD
KV = COST.kv_bytes_per_token
# a 16k-token prompt: 512 on the GPU, 3,584 in host memory, 10,240 only on SSD, 2,048 new
SSD_CASE = dict(prompt_tokens=16_384, gpu_tokens=512, host_end=4096, hit_end=14_336, ssd_tokens=10_240,
                ssd_bytes=10_240 * KV)
READ_S = 10_240 * KV / 1.5e9  # 0.89 s


def test_cost_model_numbers():
    assert COST.ssd_read_s(10_240 * KV) == pytest.approx(READ_S)
    assert COST.ssd_read_s(10_240 * KV, share=0.5) == pytest.approx(2 * READ_S)
    assert COST.prefill_s(0, 5000) == 0.0
    # 13k tokens: ~1.1 s from the SSD, ~0.5 s to recompute (the arithmetic)
    assert COST.ssd_read_s(13_000 * KV) == pytest.approx(1.14, abs=0.01)
    assert COST.prefill_s(13_000) == pytest.approx(0.51, abs=0.02)
    with pytest.raises(ValueError, match="ssd_read_bytes_per_s"):
        LoadCostModel(ssd_read_bytes_per_s=0)


def test_idle_gpu_recomputes_the_ssd_part_and_a_waiting_request_prefetches_it():
    p = LoadPlanner(LoadPlanConfig(recompute_gpu_weight=0.0))  # the request's own first token only
    idle = p.plan(**SSD_CASE, context=PlanContext(gpu_wait_s=0.0))
    assert (idle.host, idle.ssd, idle.use_tokens) == (LoadAction.LOAD, LoadAction.RECOMPUTE, 4096)
    assert idle.ttft_s < READ_S and idle.ttft_s < idle.recompute_ttft_s  # never slower than no cache
    busy = p.plan(**SSD_CASE, context=PlanContext(gpu_wait_s=2.0))  # the read hides behind 2 s of GPU work
    assert (busy.host, busy.ssd, busy.use_tokens) == (LoadAction.LOAD, LoadAction.PREFETCH, 14_336)
    assert busy.ready_s == pytest.approx(READ_S) and busy.ttft_s == pytest.approx(2.0 + busy.gpu_s)
    assert busy.fallback_use_tokens == 4096 and busy.fallback_gpu_s == pytest.approx(idle.gpu_s)
    # the SSD's backlog and its sharing with write-back count: behind 2 s of reads the read is exposed again
    late = p.plan(**SSD_CASE, context=PlanContext(gpu_wait_s=2.0, ssd_wait_s=2.0, ssd_read_share=0.5))
    assert late.ssd is LoadAction.RECOMPUTE and late.ready_s == 0.0
    assert p.stats["plans"] == 3 and p.stats["plan_prefetch"] == 1 and p.stats["plan_recompute_ssd"] == 2


def test_decisions_are_counted_in_metrics():
    from prometheus_client import REGISTRY

    def sample(name, **labels):
        return REGISTRY.get_sample_value(name, labels) or 0.0

    before = (sample("kvtier_load_plan_decisions_total", tier="ssd", action="recompute"),
              sample("kvtier_load_plan_decisions_total", tier="ssd", action="prefetch"),
              sample("kvtier_load_plan_decisions_total", tier="host", action="load"),
              sample("kvtier_load_plan_recomputed_tokens_total", tier="ssd"))
    p = LoadPlanner(LoadPlanConfig(recompute_gpu_weight=0.0))
    p.plan(**SSD_CASE)  # idle: recompute the SSD part, load the host part
    p.plan(**SSD_CASE, context=PlanContext(gpu_wait_s=3.0))  # prefetch
    after = (sample("kvtier_load_plan_decisions_total", tier="ssd", action="recompute"),
             sample("kvtier_load_plan_decisions_total", tier="ssd", action="prefetch"),
             sample("kvtier_load_plan_decisions_total", tier="host", action="load"),
             sample("kvtier_load_plan_recomputed_tokens_total", tier="ssd"))
    assert [a - b for a, b in zip(after, before)] == [1, 1, 2, 14_336 - 4096]


def test_gpu_weight_committed_reads_and_the_switch():
    ctx = PlanContext(gpu_wait_s=0.5)  # the read is exposed by ~0.39 s; recomputing costs ~0.35 GPU-s more
    own = LoadPlanner(LoadPlanConfig(recompute_gpu_weight=0.0))
    assert own.plan(**SSD_CASE, context=ctx).ssd is LoadAction.RECOMPUTE
    heavy = LoadPlanner(LoadPlanConfig(recompute_gpu_weight=3.0)).plan(**SSD_CASE, context=ctx)
    assert heavy.ssd is LoadAction.PREFETCH  # GPU seconds also delay the requests queued behind it
    assert LoadPlanner().plan(**SSD_CASE).ssd is LoadAction.PREFETCH  # the default: only an idle GPU recomputes
    assert own.plan(**SSD_CASE, ssd_committed=True).ssd is LoadAction.PREFETCH  # its read is issued
    off = LoadPlanner(LoadPlanConfig(load_or_recompute=False)).plan(**SSD_CASE)
    assert off.ssd is LoadAction.PREFETCH and off.use_tokens == 14_336
    # a per-candidate wait (HRRN: a short job goes sooner) is asked with each candidate's GPU seconds
    asked: list[float] = []
    own.plan(**SSD_CASE, context=PlanContext(gpu_wait_fn=lambda s: asked.append(s) or 0.0))
    assert len(asked) == 3 and asked == sorted(asked, reverse=True)


def test_host_part_is_recomputed_only_when_loading_it_is_slower():
    case = dict(prompt_tokens=8192, gpu_tokens=0, host_end=6144, hit_end=6144, ssd_tokens=0, ssd_bytes=0)
    assert LoadPlanner().plan(**case).host is LoadAction.LOAD
    slow = LoadPlanner(LoadPlanConfig(cost=dataclasses.replace(COST, host_load_bytes_per_s=1e8),
                                      recompute_gpu_weight=0.0))
    plan = slow.plan(**case)  # 0.8 GB over 0.1 GB/s = 8 s
    assert (plan.host, plan.ssd, plan.use_tokens) == (LoadAction.RECOMPUTE, LoadAction.NONE, 0)
    nothing = LoadPlanner().plan(prompt_tokens=100, gpu_tokens=0, host_end=0, hit_end=0, ssd_tokens=0, ssd_bytes=0)
    assert (nothing.host, nothing.ssd, nothing.use_tokens) == (LoadAction.NONE, LoadAction.NONE, 0)


def test_calibration_moves_the_estimates():
    p = LoadPlanner(LoadPlanConfig(calibration_weight=0.5))
    p.observe_ssd_read(int(0.5e9), 1.0)  # the device really reads 0.5 GB/s
    assert p.cost.ssd_read_bytes_per_s == pytest.approx(1.0e9)
    base = COST.prefill_s(4000, 1000)
    p.observe_prefill(4000, 1000, 3 * base)  # prefill 3x slower than modelled
    assert p.cost.prefill_s(4000, 1000) == pytest.approx(2 * base)
    fixed = LoadPlanner(LoadPlanConfig(calibrate=False))
    fixed.observe_ssd_read(int(0.5e9), 1.0)
    assert fixed.cost.ssd_read_bytes_per_s == 1.5e9
    # a slower SSD changes the decision: the same wait no longer hides the read
    ctx = PlanContext(gpu_wait_s=1.2)
    assert LoadPlanner(LoadPlanConfig(recompute_gpu_weight=0.0)).plan(**SSD_CASE, context=ctx).ssd is \
        LoadAction.PREFETCH
    slow = LoadPlanner(LoadPlanConfig(calibration_weight=1.0, recompute_gpu_weight=0.0))
    slow.observe_ssd_read(int(0.5e9), 1.0)
    assert slow.plan(**SSD_CASE, context=ctx).ssd is LoadAction.RECOMPUTE


def test_scheduler_keys_are_parsed_and_errors_name_the_key():
    cfg = DualQueueConfig.from_keys({"ready_order": "hrrn", "ssd_read_gbps": 3.0, "prefill_us_per_token": 50,
                                     "recompute_gpu_weight": 2, "starvation_multiple": 6, "delay_hit": False},
                                    gpu_capacity=100, kv_bytes_per_token=2048)
    assert cfg.ready_order == "hrrn" and cfg.gpu_capacity == 100 and not cfg.delay_hit
    assert cfg.load_plan.cost.ssd_read_bytes_per_s == 3e9
    assert cfg.load_plan.cost.prefill_s_per_token == pytest.approx(5e-5)
    assert cfg.load_plan.cost.kv_bytes_per_token == 2048 and cfg.load_plan.recompute_gpu_weight == 2.0
    assert DualQueueConfig.from_keys({"kv_bytes_per_token": 64}, kv_bytes_per_token=2048).load_plan.cost \
        .kv_bytes_per_token == 64
    for bad, key in (({"ssd_read_gbs": 1.0}, "ssd_read_gbs"), ({"ssd_read_gbps": -1}, "ssd_read_gbps"),
                     ({"ready_order": "lifo"}, "ready_order"), ({"load_or_recompute": "yes"}, "load_or_recompute"),
                     ({"delay_hit_threshold_tokens": 0}, "delay_hit_threshold_tokens"),
                     ({"delay_hit_own_loads": "yes"}, "delay_hit_own_loads"),
                     ({"calibration_weight": 2}, "calibration_weight"), ({"kv_bytes_per_token": 1.5}, "kv_bytes")):
        with pytest.raises(ValueError, match=f"kvtier.scheduler.*{key}"):
            DualQueueConfig.from_keys(bad)
    assert "ready_order" in SCHEDULER_KEYS and "recompute_gpu_weight" in SCHEDULER_KEYS
    assert DualQueueConfig.from_keys({"delay_hit_own_loads": True}).delay_hit_own_loads
    assert not DualQueueConfig.from_keys({}).delay_hit_own_loads  # production keeps the idle-GPU guarantee


# --- hint derivation -----------------------------------------------------------------------------------------------


def test_walk_prefix_follows_the_workers_rules():
    # host, host, ssd, host, ssd, missing, host: the walk stops at the first chunk resident nowhere
    chunks = [("host", 256, 0), ("host", 256, 0), ("ssd", 256, 9), ("host", 256, 0), ("ssd", 256, 9), (None, 256, 0),
              ("host", 256, 0)]
    assert walk_prefix(chunks) == Residency(host_end=512, hit_end=1280, ssd_tokens=512, ssd_bytes=18)
    assert walk_prefix([]) == Residency()
    walk = walk_chunks(chunks, lambda c, _run: c)
    assert walk.residency == walk_prefix(chunks) and walk.stop == 5
    owners = [("a", 256), ("a", 256), (None, 256), ("b", 256)]
    assert count_inflight(owners, "me") == 512 and count_inflight(owners, "a") == 0
    assert count_inflight([("b", 10), ("a", 10)], "a") == 10


def test_the_workers_walk_asks_lazily_and_keeps_an_unpinned_host_chunk_out_of_the_host_run():
    """`walk_chunks` as the worker's lookup drives it: `locate` learns whether the host run is unbroken (the worker
    pins only there), is asked nothing past the first chunk resident nowhere, and a `RESIDENT` chunk (in the host
    tier, not pinned) counts as a hit without ending or extending the host run."""
    places = [HOST, RESIDENT, HOST, SSD, RESIDENT, None, HOST]
    asked = []

    def locate(i: int, in_host_run: bool) -> tuple[str | None, int, int]:
        asked.append((i, in_host_run))
        return places[i], 32, 7

    walk = walk_chunks(range(len(places)), locate)
    assert walk.residency == Residency(host_end=96, hit_end=160, ssd_tokens=32, ssd_bytes=7) and walk.stop == 5
    assert asked == [(0, True), (1, True), (2, True), (3, True), (4, False), (5, False)]


def test_derive_tier_hint_without_and_with_a_plan():
    res = Residency(host_end=4096, hit_end=14_336, ssd_tokens=10_240, ssd_bytes=10_240 * KV)
    h = derive_tier_hint("r", 5.0, gpu_tokens=512, residency=res, prompt_tokens=16_384)
    assert (h.state, h.gpu_tokens, h.host_tokens, h.ssd_tokens, h.plan) == (TierState.PREPARING, 512, 3584, 10_240,
                                                                              None)
    assert derive_tier_hint("r", 5.0, gpu_tokens=512, residency=res, prefetch="inflight").state is TierState.LOADING
    done = derive_tier_hint("r", 5.0, gpu_tokens=512, residency=res, prefetch=PrefetchPhase.DONE)
    assert (done.state, done.host_tokens, done.ssd_tokens) == (TierState.READY, 3584, 0)
    miss = derive_tier_hint("r", 5.0, gpu_tokens=0, residency=Residency(), inflight_tokens=512)
    assert miss.state is TierState.MISS and miss.inflight_tokens == 512
    # with the planner: an idle GPU recomputes the SSD part, so the request is READY with the plan attached
    planner = LoadPlanner(LoadPlanConfig(recompute_gpu_weight=0.0))
    idle = derive_tier_hint("r", 5.0, gpu_tokens=512, residency=res, prompt_tokens=16_384, planner=planner,
                            context=PlanContext(gpu_wait_s=0.0))
    assert idle.state is TierState.READY and idle.plan.ssd is LoadAction.RECOMPUTE and idle.use_tokens == 4096
    assert idle.ssd_tokens == 10_240 and idle.uncached_tokens == 16_384 - 4096  # residency is still reported
    busy = derive_tier_hint("r", 5.0, gpu_tokens=512, residency=res, prompt_tokens=16_384, planner=planner,
                            context=PlanContext(gpu_wait_s=3.0))
    assert busy.state is TierState.PREPARING and busy.plan.ssd is LoadAction.PREFETCH and busy.use_tokens == 14_336
    issued = derive_tier_hint("r", 5.0, gpu_tokens=512, residency=res, prompt_tokens=16_384, planner=planner,
                              prefetch="inflight")
    assert issued.state is TierState.LOADING and issued.plan.ssd is LoadAction.PREFETCH  # a read in flight is kept


def test_idle_gpu_replan_promotes_the_request_that_gains_most():
    planner = LoadPlanner()
    p = DualQueuePolicy(DualQueueConfig(starvation_floor_s=1e9))
    res = Residency(host_end=4096, hit_end=14_336, ssd_tokens=10_240, ssd_bytes=10_240 * KV)
    for rid, arr in (("s1", 1.0), ("s2", 2.0)):
        h = derive_tier_hint(rid, arr, gpu_tokens=512, residency=res, prompt_tokens=16_384, planner=planner,
                             context=PlanContext(gpu_wait_s=3.0))
        p.add(h, 100)
    assert p.pick(3.0) is None
    assert p.replan_idle(lambda h: 0.01) is None  # a read this short beats recomputing: keep waiting
    assert p.replan_idle(lambda h: READ_S, free_gpu=50) is None  # neither fits the free memory
    rid = p.replan_idle(lambda h: READ_S * (2 if h.request_id == "s2" else 1))
    assert rid == "s2" and p.hint("s2").state is TierState.READY and p.hint("s2").plan.ssd is LoadAction.RECOMPUTE
    assert p.pick(3.0) == "s2" and p.preparing_ids() == ["s1"]
    assert p.planner.stats["replan_recompute_ssd"] == 1


def test_idle_gpu_replan_leaves_a_prefix_another_request_brings_to_delay_hit():
    """Delay hit covers loads too: with avoidance on, a request whose SSD part another request's read (or prefill)
    is bringing (`inflight_tokens`) is not recomputed at an idle GPU, nor with `delay_hit_own_loads` one whose own
    read is issued; the others still are."""
    res = Residency(host_end=4096, hit_end=14_336, ssd_tokens=10_240, ssd_bytes=10_240 * KV)
    for delay_hit, expect in ((True, "s1"), (False, "s2")):
        p = DualQueuePolicy(DualQueueConfig(starvation_floor_s=1e9, delay_hit=delay_hit))
        for rid, arr, inflight in (("s1", 1.0, 0), ("s2", 2.0, 10_240)):
            h = derive_tier_hint(rid, arr, gpu_tokens=512, residency=res, prompt_tokens=16_384, planner=p.planner,
                                 context=PlanContext(gpu_wait_s=3.0), inflight_tokens=inflight)
            p.add(h, 100)
        # s2 gains most (its read is the longer one) but its prefix is on its way
        assert p.replan_idle(lambda h: READ_S * (2 if h.request_id == "s2" else 1)) == expect, delay_hit
        assert p.hint(expect).state is TierState.READY
    p = DualQueuePolicy(DualQueueConfig(starvation_floor_s=1e9, delay_hit=True))
    h = derive_tier_hint("s2", 2.0, gpu_tokens=512, residency=res, prompt_tokens=16_384, planner=p.planner,
                         context=PlanContext(gpu_wait_s=3.0), inflight_tokens=10_240)
    p.add(h, 100)
    assert p.replan_idle(lambda h: 10 * READ_S) is None and p.preparing_ids() == ["s2"]
    # its own read in flight (LOADING): replanned unless `delay_hit_own_loads` (then it waits for its read)
    for own, expect in ((True, None), (False, "s1")):
        p = DualQueuePolicy(DualQueueConfig(starvation_floor_s=1e9, delay_hit=True, delay_hit_own_loads=own))
        h = derive_tier_hint("s1", 1.0, gpu_tokens=512, residency=res, prompt_tokens=16_384, planner=p.planner,
                             context=PlanContext(gpu_wait_s=3.0))
        p.add(h, 100)
        assert p.next_prefetch(3.0) == "s1" and p.loading_ids() == ["s1"]
        assert p.replan_idle(lambda h: 10 * READ_S) == expect, own


# --- HRRN ready order ----------------------------------------------------------------------------------------------


def ready(rid: str, arrival: float, uncached: int, inflight: int = 0) -> TierHint:
    return TierHint(rid, host_tokens=512, state=TierState.READY, arrival=arrival, prompt_tokens=512 + uncached,
                    inflight_tokens=inflight)


def test_hrrn_ready_order_by_uncached_service_with_the_starvation_bound():
    p = DualQueuePolicy(DualQueueConfig(ready_order="hrrn", starvation_multiple=1.0, starvation_floor_s=20.0))
    p.add(ready("long", 0.0, 16_000), 10)
    p.add(ready("short", 1.0, 500), 10)
    p.add(ready("mid", 2.0, 4000), 10)
    p.add(ready("burst-long", 3.0, 8000), 10)
    p.add(ready("burst-short", 3.0, 1000), 10)
    now = 3.0
    expect = sorted(p.ids(), key=lambda r: -(now + 1e-3 - p.hint(r).arrival) / p.service_s(p.hint(r)))
    assert p.order(now) == expect and expect[0] == "short" and expect.index("long") < expect.index("burst-long")
    assert expect.index("burst-short") < expect.index("burst-long")  # equal waits: the shorter first
    assert p.pick(now) == "short"
    arrival = DualQueuePolicy(DualQueueConfig(starvation_floor_s=20.0))
    for rid in p.ids():
        arrival.add(p.hint(rid), 10)
    assert arrival.pick(now) == "long"  # Bidaw's FCFS by arrival
    # memory: an admissible one is counted against free memory, one that does not fit goes later, not first
    p.update(ready("short", 1.0, 500), gpu_need=1000)
    others = [r for r in expect if r != "short"]
    assert p.order(now, free_gpu=25) == others[:2] + [r for r in expect if r not in others[:2]]  # 10 + 10 fit
    assert p.pick(now, free_gpu=25) == expect[1] and p.stats["skipped_oversized"] >= 1
    # delay hit: a deferred request is passed over whatever its ratio
    p.update(ready("short", 1.0, 500, inflight=4096), gpu_need=10)
    assert p.pick(now) == expect[1] and "short" in p.order(now)[-2:]
    # the starvation bound: once 'long' waited 20 s it goes first (by arrival), then HRRN again
    assert p.pick(20.5) == "long" and p.order(20.5)[0] == "long"
    p.dispatched("long", 20.5)
    assert p.pick(20.5) != "long"


def test_hrrn_service_exponent_is_the_aging_weight_of_the_ready_order():
    now = 2.5
    hints = [ready("old-long", 0.0, 8000), ready("new-short", 2.3, 500), ready("mid", 1.0, 3000),
             ready("burst-a", 2.4, 2000), ready("burst-b", 2.4, 600)]
    picks, orders = {}, {}
    for beta in (0.0, 1.0, 2.0):
        p = DualQueuePolicy(DualQueueConfig(ready_order="hrrn", starvation_floor_s=20.0, hrrn_service_exponent=beta))
        for h in hints:
            p.add(h, 10)
        expect = sorted(p.ids(), key=lambda r: -(now + 1e-3 - p.hint(r).arrival) / p.service_s(p.hint(r)) ** beta)
        orders[beta], picks[beta] = p.order(now), p.pick(now)
        assert orders[beta] == expect and picks[beta] == expect[0], beta
    assert orders[0.0] == ["old-long", "mid", "new-short", "burst-a", "burst-b"]  # 0: by waiting time alone (FCFS)
    # services 0.30, 0.11 and 0.022 s: plain HRRN takes the mid one, a larger weight keeps the short one first
    assert picks[0.0] == "old-long" and picks[1.0] == "mid" and picks[2.0] == "new-short"
    assert orders[1.0].index("burst-b") < orders[1.0].index("burst-a")  # equal waits: the shorter first
    cfg = DualQueueConfig.from_keys({"ready_order": "hrrn", "hrrn_service_exponent": 1.5})
    assert cfg.hrrn_service_exponent == 1.5 and "hrrn_service_exponent" in SCHEDULER_KEYS
    with pytest.raises(ValueError, match="kvtier.scheduler.hrrn_service_exponent"):
        DualQueueConfig.from_keys({"hrrn_service_exponent": -1})


def test_starvation_lookahead_serves_old_requests_before_the_bound_is_reached():
    """With a 20 s bound, older ready requests served in arrival order must each start within it: a request goes
    first only if its service fits in the slack of every older one (the oldest always does); otherwise HRRN's
    choice among those that do. Nobody has waited 20 s in these cases, so the plain bound does not act."""
    def policy(lookahead: bool, *hints: TierHint) -> DualQueuePolicy:
        p = DualQueuePolicy(DualQueueConfig(ready_order="hrrn", starvation_multiple=1.0, starvation_floor_s=20.0,
                                            starvation_lookahead=lookahead))
        for h in hints:
            p.add(h, 10)
        return p

    # two old 16k-token prefills (0.67 s each) and a short one with the highest ratio
    pair = (ready("old-a", 0.0, 16_000), ready("old-b", 0.0, 16_000), ready("mid", 5.0, 1000))
    on, off = policy(True, *pair), policy(False, *pair)
    s_old, s_mid = on.service_s(on.hint("old-a")), on.service_s(on.hint("mid"))
    tight = 20.0 - s_old - 0.5 * s_mid  # old-b starts after old-a: 'mid' first would start it past 20 s
    roomy = 20.0 - s_old - 2.0 * s_mid
    assert off.pick(tight) == "mid" and off.order(tight)[0] == "mid"
    assert on.pick(tight) == "old-a" and on.order(tight)[0] == "old-a"
    assert on.stats["lookahead_overrides"] >= 1
    assert on.pick(roomy) == off.pick(roomy) == "mid" and on.order(roomy)[0] == "mid"
    # not only the oldest: 'y' fits in the slack of the two requests before it, 'z' (HRRN's choice) does not
    quad = (ready("h", 0.0, 16_000), ready("j", 0.5, 16_000), ready("y", 1.0, 1000), ready("z", 2.0, 500))
    on, off = policy(True, *quad), policy(False, *quad)
    now = 21.0 - 2.0 * s_old  # y's own slack is 0: z must not go before it; h and j still have room for y
    assert now < 20.0
    assert off.pick(now) == "z" and on.pick(now) == "y" and on.order(now)[0] == "y"
    cfg = DualQueueConfig.from_keys({"ready_order": "hrrn", "starvation_lookahead": True})
    assert cfg.starvation_lookahead and "starvation_lookahead" in SCHEDULER_KEYS
    with pytest.raises(ValueError, match="kvtier.scheduler.starvation_lookahead"):
        DualQueueConfig.from_keys({"starvation_lookahead": 1})


def test_shipped_hrrn_config_holds_the_simulators_tuned_knobs():
    """`configs/vllm-kv-transfer-hrrn.json` is the configuration `benchmarks/scheduler_sim.py` reports as kvtier's
    best (its `TUNED`, chosen on the tuning half): the same ready order and knobs, parsed as the connector parses
    them, so the shipped file and the benchmark's figures cannot drift apart."""
    import importlib.util
    import json
    from pathlib import Path

    repo = Path(__file__).resolve().parent.parent
    spec = importlib.util.spec_from_file_location("scheduler_sim", repo / "benchmarks" / "scheduler_sim.py")
    sim = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sim)
    shipped = json.loads((repo / "configs" / "vllm-kv-transfer-hrrn.json").read_text())
    cfg = DualQueueConfig.from_keys(shipped["kv_connector_extra_config"]["kvtier.scheduler"])
    tuned = sim.TUNED
    assert cfg.ready_order == ("hrrn" if "+hrrn" in tuned["scheduler"] else "arrival")
    assert "+delay-hit" not in tuned["scheduler"] or cfg.delay_hit
    assert (cfg.starvation_multiple, cfg.hrrn_service_exponent, cfg.starvation_lookahead, cfg.mean_window,
            cfg.load_plan.recompute_gpu_weight) == (
        tuned["starvation_multiple"], tuned["hrrn_service_exponent"], tuned["starvation_lookahead"],
        tuned["mean_window"], tuned["recompute_gpu_weight"])
    assert cfg == sim.policy_config(tuned, ready_order=cfg.ready_order)  # nothing else differs either


# --- the idle-GPU re-plan under load -------------------------------------------------------------------------------


def test_gpu_load_is_the_busy_share_of_the_last_window():
    from kvtier.scheduler_hooks.gpu_load import GpuLoad

    g = GpuLoad(window_s=10.0)
    assert g.load == 0.0  # no evidence: the re-plan keeps its plain rule
    g.observe(0.0, 0.0)
    assert g.load == 0.0
    g.observe(5.0, 5.0)
    assert g.load == 1.0
    g.observe(10.0, 5.0)
    assert g.load == 0.5
    g.observe(20.0, 5.0)  # the busy 5 s left the window
    assert g.load == 0.0
    g.observe(24.0, 7.0)
    assert g.load == pytest.approx(2.0 / 14.0)  # one sample at or before the window's start is kept
    g.observe(15.0, 1.0)  # a clock that went backwards restarts the window
    assert g.load == 0.0


def test_recompute_now_charges_the_work_arriving_during_the_read():
    """Recompute at an idle GPU iff fallback_gpu_s + load * read_s < read_s + gpu_s: at load 0 whenever that is
    the earlier first token; under load only where the recompute also leaves the arrivals their idle time."""
    planner = LoadPlanner()
    plan = planner.plan(**SSD_CASE, context=PlanContext(gpu_wait_s=3.0))
    assert plan.ssd is LoadAction.PREFETCH
    extra = plan.fallback_gpu_s - plan.gpu_s  # GPU seconds the cache saves
    assert 0 < extra < READ_S
    boundary = 1.0 - extra / READ_S  # the load at which waiting and recomputing leave the same work
    assert LoadPlanner.idle_gain_s(plan, READ_S, 0.0) == pytest.approx(READ_S - extra)
    assert LoadPlanner.idle_gain_s(plan, READ_S, boundary) == pytest.approx(0.0, abs=1e-12)
    assert planner.recompute_now(plan, READ_S).ssd is LoadAction.RECOMPUTE
    assert planner.recompute_now(plan, READ_S, boundary - 0.01).ssd is LoadAction.RECOMPUTE
    assert planner.recompute_now(plan, READ_S, boundary + 0.01) is None
    assert planner.recompute_now(plan, READ_S, 1.0) is None  # a saturated GPU has no idle time to give
    assert planner.recompute_now(plan, extra - 0.01, 0.0) is None  # the read lands before the extra work ends


def test_idle_gpu_replan_uses_the_busy_share_the_engine_reports():
    res = Residency(host_end=4096, hit_end=14_336, ssd_tokens=10_240, ssd_bytes=10_240 * KV)

    def policy(counts: bool) -> DualQueuePolicy:
        p = DualQueuePolicy(DualQueueConfig(starvation_floor_s=1e9, idle_replan_counts_arrivals=counts))
        p.add(derive_tier_hint("s1", 1.0, gpu_tokens=512, residency=res, prompt_tokens=16_384, planner=p.planner,
                               context=PlanContext(gpu_wait_s=3.0)), 100)
        return p

    plan = policy(True).hint("s1").plan
    boundary = 1.0 - (plan.fallback_gpu_s - plan.gpu_s) / READ_S
    for load, counts, expect in ((boundary + 0.02, True, None), (boundary - 0.02, True, "s1"),
                                 (boundary + 0.02, False, "s1"), (0.0, True, "s1")):
        p = policy(counts)
        p.observe_gpu_busy(100.0, 0.0)
        p.observe_gpu_busy(130.0, 30.0 * load)  # busy `load` of the last 30 s
        assert p.arriving_load() == pytest.approx(load if counts else 0.0)
        assert p.replan_idle(lambda h: READ_S) == expect, (load, counts)
        assert p.hint("s1").state is (TierState.READY if expect else TierState.PREPARING)
    assert DualQueueConfig().idle_replan_counts_arrivals  # the default
    assert not DualQueueConfig.from_keys({"idle_replan_counts_arrivals": False}).idle_replan_counts_arrivals
    with pytest.raises(ValueError, match="idle_replan_counts_arrivals"):
        DualQueueConfig.from_keys({"idle_replan_counts_arrivals": 1})
