"""The discrete-event simulator: exact orders of service on hand-built scenarios, and `kvtier simulate` end to end."""

from __future__ import annotations

import json
import random
from dataclasses import replace
from pathlib import Path

import pytest

from kvtier.cli import main as cli_main
from kvtier.scheduler_hooks.dual_queue_policy import DualQueueConfig
from kvtier.sim.base import SimConfig, SimRequest, load_trace
from kvtier.sim.cost_model import PROFILES, get_profile
from kvtier.sim.engine import Simulator, calibrate_time_scale, simulate

NO_STARVE = DualQueueConfig(starvation_floor_s=1e9)
COST = get_profile("llama3-8b-h100")
BLOCK_READ_S = 512 * COST.kv_bytes_per_token / COST.ssd_read_bytes_per_s  # one 512-token block from SSD
BLOCK_WRITE_S = 512 * COST.kv_bytes_per_token / COST.ssd_write_bytes_per_s  # and to it


def req(rid: str, arrival: float, blocks, input_tokens: int | None = None, output: int = 10) -> SimRequest:
    blocks = tuple(blocks)
    return SimRequest(rid, arrival, blocks, input_tokens or 512 * len(blocks), output)


def make(reqs, scheduler: str, seed: dict[str, list[int]] | None = None, **kw) -> Simulator:
    cfg = SimConfig(scheduler=scheduler, policy=kw.pop("policy", NO_STARVE), **kw)
    sim = Simulator(reqs, cfg)
    for tier, blocks in (seed or {}).items():
        sim.seed(blocks, tier)
    return sim


# --- hand-built scenarios ------------------------------------------------------------------------------------------


def test_ssd_request_does_not_block_host_request():
    reqs = [
        req("A", 0.00, range(1, 22)),  # 20 blocks of history on SSD only + 1 new block
        req("B", 0.01, [101, 102, 103, 104, 105]),  # 4 blocks in host memory + 1 new
        req("C", 0.02, [201, 202]),  # nothing cached
    ]
    seed = {"ssd": list(range(1, 21)), "host": [101, 102, 103, 104]}
    runs = {}
    for s in ("fcfs", "fcfs+prefetch", "dual-queue+always-load"):
        sim = make(reqs, s, seed)
        res = sim.run()
        assert res.completed == 3
        runs[s] = (sim, res)
    fcfs, fres = runs["fcfs"]
    assert fcfs.dispatch_order == ["A", "B", "C"]
    assert fres.tokens["ssd_sync"] == 20 * 512 and fres.tokens["ssd_prefetch"] == 0
    assert fcfs.queue["B"] > 20 * BLOCK_READ_S  # B waited behind A's synchronous SSD read and its prefill
    pre, _ = runs["fcfs+prefetch"]
    assert pre.dispatch_order == ["A", "B", "C"] and pre.queue["B"] > 20 * BLOCK_READ_S - 0.01
    dual, dres = runs["dual-queue+always-load"]  # Bidaw: A waits for its prefetch, B and C go first
    assert dual.dispatch_order == ["B", "C", "A"]
    assert dual.queue["B"] == pytest.approx(0.0, abs=1e-9)  # GPU idle at its arrival: served at once
    assert dual.queue["C"] < 0.2
    # A waited for its prefetch only, and that read shared the SSD with the write-back of B's and C's 3 computed
    # blocks (queued meanwhile, all done before the read): the read ends when the device has done both
    assert dual.queue["A"] == pytest.approx(20 * BLOCK_READ_S + 3 * BLOCK_WRITE_S, rel=1e-6)
    assert dres.tokens["ssd_prefetch"] == 20 * 512 and dres.tokens["ssd_sync"] == 0
    assert dres.tokens["host"] == 4 * 512
    assert dual.read_order == ["A"]
    assert dres.ssd_write_gb == pytest.approx(4 * 512 * COST.kv_bytes_per_token / 1e9)  # B, C and A's new block


def test_promoted_request_keeps_its_arrival_order():
    reqs = [
        req("L", 0.00, range(1000, 1040)),  # long prefill keeps the GPU busy ~1 s
        req("A", 0.01, [1, 2]),  # 1 SSD block: promoted at ~0.055 s, after D and E arrived
        req("D", 0.02, [11, 12, 13, 14, 15]),  # host-resident
        req("E", 0.03, [31, 32]),  # miss
    ]
    sim = make(reqs, "dual-queue", {"ssd": [1], "host": [11, 12, 13, 14]})
    res = sim.run()
    assert res.completed == 4
    assert sim.read_order == ["A"]
    assert sim.queue["A"] > BLOCK_READ_S  # it was still waiting for the GPU when promoted
    assert sim.dispatch_order == ["L", "A", "D", "E"]


def test_disk_hrrn_issues_small_reads_first():
    reqs = [
        req("S1", 0.00, list(range(1, 11)) + [11]),  # 10 SSD blocks: starts reading at once
        req("S2", 0.01, list(range(21, 29)) + [29]),  # 8 SSD blocks
        req("S3", 0.02, [41, 42]),  # 1 SSD block: overtakes S2 under HRRN
    ]
    seed = {"ssd": list(range(1, 11)) + list(range(21, 29)) + [41]}
    dual = make(reqs, "dual-queue+always-load", seed)
    assert dual.run().completed == 3
    assert dual.read_order == ["S1", "S3", "S2"]
    fifo = make(reqs, "fcfs+prefetch", seed)
    assert fifo.run().completed == 3
    assert fifo.read_order == ["S1", "S2", "S3"]


def test_oversized_request_is_skipped_not_blocking():
    reqs = [
        req("L", 0.0, range(1, 13), input_tokens=6000, output=2000),  # holds 8,000 of 10,000 tokens for ~60 s
        req("X", 0.1, range(21, 31), input_tokens=5000, output=100),  # needs 5,100: does not fit
        req("Y", 0.2, range(41, 43), input_tokens=1000, output=100),  # fits
    ]
    dual = make(reqs, "dual-queue", gpu_kv_tokens=10_000)
    res = dual.run()
    assert res.completed == 3 and res.rejected == 0
    assert dual.dispatch_order == ["L", "Y", "X"]
    decode_wall = 2000 * COST.tpot_s
    assert dual.queue["Y"] < 5.0 < decode_wall - 1.0 < dual.queue["X"]
    assert res.policy_stats["skipped_oversized"] >= 1
    fcfs = make(reqs, "fcfs", gpu_kv_tokens=10_000)
    fcfs.run()
    assert fcfs.dispatch_order == ["L", "X", "Y"]
    assert fcfs.queue["Y"] > decode_wall - 1.0  # blocked behind X


def test_too_large_for_the_gpu_is_rejected():
    reqs = [req("ok", 0.0, [1]), req("never", 0.1, range(10, 30), input_tokens=10_000, output=10)]
    res = make(reqs, "dual-queue", gpu_kv_tokens=5_000).run()
    assert res.completed == 1 and res.rejected == 1 and res.requests == 2


def test_delay_hit_waits_for_a_prefix_being_computed_instead_of_recomputing_it():
    """The computing window: A's 10-block prefill is one chunk, so the next admission opens as it starts; B arrives
    while A computes the prefix they share."""
    reqs = [
        req("A", 0.00, list(range(1, 11)) + [11]),
        req("B", 0.01, list(range(1, 11)) + [12]),  # same 10-block prefix
    ]
    plain = make(reqs, "dual-queue")
    pres = plain.run()
    assert plain.dispatch_order == ["A", "B"]
    assert plain.queue["B"] > 0.1  # its job still ran after A's: only its admission came early
    assert pres.tokens["computed"] == 11 * 512 + 11 * 512  # B recomputed A's in-flight prefix
    assert pres.recomputed == {"inflight": 10 * 512, "plan": 0, "evicted": 0}
    dh = make(reqs, "dual-queue+delay-hit", None)
    dres = dh.run()
    assert dh.dispatch_order == ["A", "B"]
    assert dres.tokens["computed"] == 11 * 512 + 512  # B waited for A's blocks, then loaded them
    assert dres.recomputed_tokens == 0 and dres.policy_stats["deferred_delay_hit"] >= 1
    assert dres.tokens["gpu"] == 10 * 512
    # the threshold is configurable: above the in-flight size, B is not deferred
    high = make(reqs, "dual-queue+delay-hit", policy=replace(NO_STARVE, delay_hit_threshold_tokens=6000))
    assert high.run().recomputed["inflight"] == 10 * 512


def test_delay_hit_sees_a_prefix_that_an_admission_after_its_arrival_computes():
    """A and B wait behind L; when A is admitted B's hint changes (production counts in-flight chunks live), so B
    is held until A's prefix lands instead of recomputing it."""
    reqs = [req("L", 0.0, range(100, 140)), req("A", 0.01, list(range(1, 11)) + [11]),
            req("B", 0.02, list(range(1, 11)) + [12])]
    plain = make(reqs, "dual-queue").run()
    dh = make(reqs, "dual-queue+delay-hit").run()
    assert plain.recomputed["inflight"] == 10 * 512 and dh.recomputed_tokens == 0
    assert dh.tokens["gpu"] == 10 * 512 and dh.tokens["computed"] == plain.tokens["computed"] - 10 * 512


def test_a_long_prefill_lands_its_earlier_chunks_before_the_next_admission():
    """A 20,480-token prefill runs in chunks of 8,192: when the next request is admitted (the last chunk starts),
    the blocks of the first two chunks (32 of 40) have landed; only the last chunk's 8 are in flight."""
    reqs = [req("A", 0.0, range(1, 41)), req("B", 0.01, list(range(1, 41)) + [99])]
    res = make(reqs, "dual-queue").run()
    assert res.recomputed["inflight"] == 8 * 512
    assert res.tokens["computed"] == 40 * 512 + 9 * 512


def test_a_prefetch_that_never_progresses_is_given_up_not_spun_on():
    # A policy that keeps offering a waiting request whose prefix is all in host memory (nothing to read: no read is
    # issued, nothing changes): `_issue_prefetch` must end the call and count a give-up, not ask again forever.
    # C's long prefill holds the GPU, B is admitted behind it, D waits.
    reqs = [req("C", 0.00, range(301, 331)), req("B", 0.01, [101, 102, 103]), req("D", 0.02, [101, 102, 104])]
    seed = {"host": [101, 102]}
    sim = make(reqs, "dual-queue+always-load", seed)
    real_next, calls = sim.policy.next_prefetch, [0]

    def stuck_next(now):
        calls[0] += 1
        if calls[0] > 1000:
            raise AssertionError("next_prefetch asked 1000 times: the retry loop spins")
        return "D" if "D" in sim.waiting else real_next(now)

    sim.policy.next_prefetch = stuck_next
    res = sim.run()
    assert res.completed == 3 and sim.read_order == [] and sim.dispatch_order == ["C", "B", "D"]
    assert res.policy_stats["prefetch_giveups"] >= 1 and calls[0] < 200  # two asks per event at most
    assert make(reqs, "dual-queue+always-load", seed).run().policy_stats["prefetch_giveups"] == 0


def test_a_prefix_is_read_from_the_ssd_once_for_two_requests():
    seed = {"ssd": list(range(1, 11))}
    reqs = [
        req("A", 0.00, list(range(1, 11)) + [11]),  # its read of the 10 SSD blocks starts at once
        req("B", 0.01, list(range(1, 11)) + [12]),  # same prefix: PREPARING; when its turn comes A's read has
    ]  # brought the blocks into host memory: nothing left to read
    for name in ("dual-queue+always-load", "dual-queue+delay-hit+always-load"):
        sim = make(reqs, name, seed)
        res = sim.run()
        assert sim.read_order == ["A"], name
        assert res.tokens["ssd_prefetch"] == 10 * 512 and res.tokens["host"] == 10 * 512, name
        assert res.recomputed_tokens == 0 and res.tokens["computed"] == 2 * 512
        assert res.ssd_read_gb == pytest.approx(10 * 512 * COST.kv_bytes_per_token / 1e9)
        assert sim.queue["B"] >= 10 * BLOCK_READ_S - 0.011


def test_delay_hit_covers_a_prefix_another_request_is_reading():
    """A's prefetch of a 20-block SSD prefix is in flight when B (same prefix) arrives and when L's job ends. At the
    idle GPU the load plan recomputes SSD parts: without delay-hit B's first (its own read would come after A's;
    a recompute of blocks in flight, counted `inflight`), then A's. With it, B waits for A's read and the plan
    recomputes A's part, which B then takes from the GPU. With `+own-loads` A waits for its own read too: nothing
    is recomputed, both take the prefix from host memory (a longer wait here: the trade it makes). Those three use
    the re-plan's eager rule; by default the re-plan charges a recompute with the GPU's busy share, which is 1.0
    when L ends (busy since the first admission): A and B wait for the read as with `+own-loads`."""
    reqs = [req("L", 0.0, range(100, 180)), req("A", 2.0, list(range(1, 21)) + [21]),
            req("B", 2.01, list(range(1, 21)) + [22])]
    seed = {"ssd": list(range(1, 21))}
    plain = make(reqs, "dual-queue+eager-replan", seed)
    pres = plain.run()
    assert plain.read_order == ["A"] and plain.dispatch_order == ["L", "B", "A"]
    assert pres.recomputed == {"inflight": 20 * 512, "plan": 0, "evicted": 0}
    assert pres.policy_stats["replan_recompute_ssd"] == 2  # B, then A (B is computing A's prefix meanwhile)
    assert pres.tokens["gpu"] == 20 * 512  # A took B's computed prefix from the GPU
    dh = make(reqs, "dual-queue+delay-hit+eager-replan", seed)
    dres = dh.run()
    assert dh.read_order == ["A"] and dh.dispatch_order == ["L", "A", "B"]
    assert dres.recomputed == {"inflight": 0, "plan": 20 * 512, "evicted": 0}
    assert dres.policy_stats["replan_recompute_ssd"] == 1 and dres.tokens["gpu"] == 20 * 512
    own = make(reqs, "dual-queue+delay-hit+own-loads+eager-replan", seed)
    ores = own.run()
    assert own.read_order == ["A"] and own.dispatch_order == ["L", "A", "B"]
    assert ores.recomputed == {"inflight": 0, "plan": 0, "evicted": 0}
    assert ores.policy_stats["replan_recompute_ssd"] == 0
    assert ores.tokens["ssd_prefetch"] == 20 * 512 and ores.tokens["host"] == 20 * 512
    assert ores.tokens["computed"] == pres.tokens["computed"] - 20 * 512
    assert ores.ssd_read_gb == pytest.approx(20 * 512 * COST.kv_bytes_per_token / 1e9)  # one read for both
    assert own.queue["A"] > dh.queue["A"]
    for name in ("dual-queue", "dual-queue+delay-hit"):  # the default re-plan at a GPU that was busy throughout
        busy = make(reqs, name, seed)
        bres = busy.run()
        assert bres.recomputed == ores.recomputed and bres.policy_stats["replan_recompute_ssd"] == 0, name
        assert bres.tokens == ores.tokens and busy.queue == pytest.approx(own.queue), name


def test_load_plan_recomputes_an_unhidden_ssd_read_and_prefetches_a_hidden_one():
    # GPU idle: reading 20 blocks (0.89 s) is slower than recomputing them (~0.4 s): recompute, at once - by the
    # idle-GPU re-plan (default weight) or already at arrival (weight 0: the request's own first token only)
    reqs = [req("A", 0.0, range(1, 22))]
    seed = {"ssd": list(range(1, 21))}
    load = make(reqs, "dual-queue+always-load", seed)
    lres = load.run()
    assert lres.tokens["ssd_prefetch"] == 20 * 512 and load.queue["A"] == pytest.approx(20 * BLOCK_READ_S)
    own = replace(NO_STARVE, load_plan=replace(NO_STARVE.load_plan, recompute_gpu_weight=0.0))
    for policy, stat in ((NO_STARVE, "replan_recompute_ssd"), (own, "plan_recompute_ssd")):
        plan = make(reqs, "dual-queue", seed, policy=policy)
        pres = plan.run()
        assert plan.queue["A"] == 0.0 and pres.tokens["ssd_prefetch"] == 0 and pres.ssd_read_gb == 0
        assert pres.recomputed == {"inflight": 0, "plan": 20 * 512, "evicted": 0}
        assert pres.policy_stats[stat] == 1 and plan.read_order == []
        assert plan.ttft["A"] < load.ttft["A"]  # never slower than no cache
    # behind a long job (L: 80 blocks, ~3.3 s of prefill) the read is hidden: prefetch
    reqs = [req("L", 0.0, range(100, 180)), req("A", 0.01, range(1, 22))]
    sim = make(reqs, "dual-queue", seed)
    res = sim.run()
    assert res.tokens["ssd_prefetch"] == 20 * 512 and res.recomputed["plan"] == 0
    assert sim.read_order == ["A"] and res.policy_stats["plan_prefetch"] >= 1


def test_recompute_baseline_has_no_host_or_ssd_tier():
    # a GPU cache of 5 blocks: u's 3 blocks push t1's first 2 out; t2 recomputes t1's history (its prefix stops at
    # block 1); a seeded host/SSD copy does not exist in this engine
    reqs = [req("t1", 0.0, [1, 2, 3, 4]), req("u", 2.0, [21, 22, 23]), req("t2", 5.0, [1, 2, 3, 4, 5])]
    res = make(reqs, "recompute", {"ssd": [1, 2], "host": [1, 2]}, gpu_kv_tokens=5 * 512 + 20).run()
    assert res.completed == 3
    assert res.tokens["host"] == res.tokens["ssd_prefetch"] == res.tokens["ssd_sync"] == res.tokens["gpu"] == 0
    assert res.ssd_write_gb == 0 and res.ssd_read_gb == 0 and res.ssd_util == 0
    assert res.tokens["computed"] == 4 * 512 + 3 * 512 + 5 * 512
    assert res.recomputed["evicted"] == 2 * 512 + 4 * 512  # t1 recomputed the seeded blocks, t2 t1's history
    # the same with kvtier's tiers: t2 loads t1's history from the host tier
    tiered = make(reqs, "dual-queue", gpu_kv_tokens=5 * 512 + 20).run()
    assert tiered.tokens["host"] >= 2 * 512 and tiered.tokens["host"] + tiered.tokens["gpu"] == 4 * 512
    assert tiered.recomputed_tokens == 0 and tiered.tokens["computed"] == 4 * 512 + 3 * 512 + 512


def test_host_eviction_pushes_blocks_to_ssd_and_dual_queue_prefetches_them():
    # host tier of 4 blocks, GPU prefix cache of 6: the second conversation evicts the first one's history to SSD
    block_bytes = 512 * COST.kv_bytes_per_token
    reqs = [
        req("t1", 0.0, [1, 2, 3, 4]),
        req("u1", 5.0, [11, 12, 13, 14, 15, 16]),
        req("t2", 10.0, [1, 2, 3, 4, 5]),  # follow-up turn of t1: its history is on SSD only by now
    ]
    for s, key in (("fcfs", "ssd_sync"), ("dual-queue+always-load", "ssd_prefetch")):
        sim = make(reqs, s, host_bytes=4 * block_bytes, gpu_kv_tokens=6 * 512 + 40)
        res = sim.run()
        assert res.completed == 3
        assert res.tokens[key] == 4 * 512, (s, res.tokens)
        assert res.ssd_write_gb == pytest.approx(11 * block_bytes / 1e9)
        assert res.tokens["gpu"] == 0 and res.tokens["computed"] == 11 * 512


# --- the whole simulator -------------------------------------------------------------------------------------------


def synthetic_trace(path: Path, sessions: int = 40, seed: int = 7) -> int:
    """A small multi-turn Mooncake-format trace: shared system block 0, growing histories, reading gaps."""
    rng = random.Random(seed)
    lines = []
    next_block = 1
    for _s in range(sessions):
        t = rng.uniform(0, 120)
        history = [0]
        for _ in range(rng.randint(1, 5)):
            new = rng.randint(1, 12)
            history = history + list(range(next_block, next_block + new))
            next_block += new
            inp = 512 * (len(history) - 1) + rng.randint(1, 512)
            lines.append({"timestamp": int(t * 1000), "input_length": inp, "output_length": rng.randint(5, 600),
                          "hash_ids": list(history)})
            t += rng.uniform(15, 90)
            history = history + [next_block]  # the answer becomes part of the next prompt
            next_block += 1
    lines.sort(key=lambda o: o["timestamp"])
    path.write_text("".join(json.dumps(o) + "\n" for o in lines))
    return len(lines)


@pytest.fixture(scope="module")
def trace(tmp_path_factory) -> tuple[Path, int]:
    p = tmp_path_factory.mktemp("sim") / "trace.jsonl"
    n = synthetic_trace(p)
    return p, n


def test_cli_single_scheduler_end_to_end(trace, tmp_path, capsys):
    path, n = trace
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    rc = cli_main(["simulate", str(path), "--scheduler", "dual-queue", "--json", str(out), "--plot", str(png),
                   "--no-progress", "--host-gb", "3"])
    assert rc == 0
    d = json.loads(out.read_text())
    for k in ("mean_queue_s", "p50_ttft_s", "p99_ttft_s", "mean_ttft_s", "completed", "p50_queue_s", "p99_queue_s",
              "gpu_util", "ssd_util", "load_factor", "time_scale"):
        assert k in d, k
    assert d["completed"] == d["requests"] == n and d["rejected"] == 0
    assert 0 <= d["mean_queue_s"] <= d["mean_ttft_s"]
    assert d["p50_ttft_s"] <= d["p99_ttft_s"] <= d["max_ttft_s"]
    assert 0 < d["gpu_util"] <= 1.0 and 0 <= d["ssd_util"] <= 1.0
    assert d["load_factor"] == pytest.approx(0.85, abs=0.05)
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"
    printed = capsys.readouterr().out
    assert "load factor" in printed and "dual-queue" in printed
    # how its host tier differs from the engine's, each difference that applies to the simulator (issue 50)
    from kvtier.replay.engine_model import differences

    assert "differs from the engine's" in printed
    assert all(f"- {d.aspect}: simulate" in printed for d in differences("simulate")), printed


def test_cli_all_schedulers_with_given_time_scale(trace, tmp_path):
    path, n = trace
    out = tmp_path / "all.json"
    rc = cli_main(["simulate", str(path), "--scheduler", "all", "--json", str(out), "--no-progress",
                   "--time-scale", "0.5", "--host-gb", "3", "--eviction", "fifo"])
    assert rc == 0
    d = json.loads(out.read_text())
    assert d["time_scale"] == 0.5
    assert [r["scheduler"] for r in d["runs"]] == ["fcfs", "fcfs+prefetch", "recompute", "dual-queue",
                                                  "dual-queue+delay-hit", "dual-queue+hrrn",
                                                  "dual-queue+hrrn+delay-hit"]
    for r in d["runs"]:
        assert r["completed"] == n and r["eviction"] == "fifo" and r["time_scale"] == 0.5
    with pytest.raises(SystemExit):
        cli_main(["simulate", str(path), "--eviction", "no-such-policy", "--no-progress"])
    with pytest.raises(SystemExit):
        cli_main(["simulate", str(path), "--scheduler", "lifo", "--no-progress"])


def test_every_scheduler_completes_and_fcfs_serves_in_arrival_order(trace):
    path, n = trace
    reqs = load_trace(path)
    assert len(reqs) == n
    base = SimConfig(host_bytes=3 * 10**9, time_scale=0.1)  # compressed in time: queues build up
    results = {}
    for s in ("fcfs", "fcfs+prefetch", "dual-queue", "dual-queue+delay-hit"):
        sim = Simulator(reqs, replace(base, scheduler=s))
        res = sim.run()
        results[s] = res
        assert res.completed == n
        assert sorted(sim.dispatch_order, key=int) == [r.rid for r in reqs]
        assert all(0 <= sim.queue[r] <= sim.ttft[r] for r in sim.queue)
        if s.startswith("fcfs"):
            assert sim.dispatch_order == [r.rid for r in reqs]
        total = sum(r.input_tokens for r in reqs)
        assert total <= sum(res.tokens.values()) <= total + n  # a fully cached prompt still computes 1 token
    assert results["fcfs"].mean_queue_s > 1.0  # the load really queues
    # determinism
    again = simulate(reqs, replace(base, scheduler="dual-queue")).to_json()
    first = results["dual-queue"].to_json()
    again.pop("decision_us_mean"), first.pop("decision_us_mean")  # wall-clock timing
    assert again == first


def test_calibration_hits_the_target_load(trace):
    reqs = load_trace(trace[0])
    base = SimConfig(host_bytes=3 * 10**9)
    scale, work = calibrate_time_scale(reqs, base, load=0.7)
    span = reqs[-1].arrival - reqs[0].arrival
    sim = Simulator(reqs, replace(base, scheduler="fcfs", time_scale=scale))
    sim.run()
    assert sim.gpu_busy_s / (span * scale) == pytest.approx(0.7, abs=0.03)
    assert work == pytest.approx(sim.gpu_busy_s, rel=0.05)


def test_every_production_eviction_policy_runs_in_the_simulator(trace):
    from kvtier.storage_backends.eviction import production_policy_names

    reqs = load_trace(trace[0])[:80]
    total = sum(r.input_tokens for r in reqs)
    block_bytes = 512 * COST.kv_bytes_per_token
    for name in production_policy_names():  # a GPU prefix cache of 64 blocks, a host tier of 24
        res = simulate(reqs, SimConfig(scheduler="dual-queue", eviction=name, host_bytes=24 * block_bytes,
                                       gpu_kv_tokens=64 * 512, time_scale=0.5))
        assert res.completed == len(reqs) and res.eviction == name, name
        # every prompt token is accounted for exactly once (a fully cached prompt still computes one token), and
        # the host tier both served history and had to evict it to SSD (the policy really governed it)
        assert total <= sum(res.tokens.values()) <= total + len(reqs), (name, res.tokens)
        assert res.tokens["host"] > 0 and res.ssd_write_gb > 0, (name, res.tokens)


def test_profiles_are_documented_numbers():
    llama = PROFILES["llama3-8b-h100"]
    assert llama.kv_bytes_per_token == 128 * 1024
    assert llama.ssd_read_bytes_per_s == 1.5e9 and llama.host_bytes == 200 * 10**9
    assert 300_000 < llama.gpu_kv_tokens < 450_000  # ~50 GB of KV on an 80 GB GPU next to 16 GB of weights
    opt = PROFILES["opt-13b-a800"]
    assert opt.kv_bytes_per_token == 800 * 1024 and opt.gpu_kv_tokens < 60_000
    # prefill grows superlinearly with context; decode share grows with output
    assert llama.prefill_time(2000, 8000) > llama.prefill_time(2000, 0) > 0 == llama.prefill_time(0, 8000)
    assert llama.decode_gpu_time(200, 1000) > llama.decode_gpu_time(100, 1000)
    with pytest.raises(ValueError):
        get_profile("gpt-9")


def test_demo_slice_dual_queue_beats_fcfs():
    """The shipped Mooncake slice (real arrival gaps) at the default 85% FCFS load."""
    path = Path(__file__).resolve().parent.parent / "demo_data" / "mooncake_conversation_slice.jsonl"
    if not path.exists():
        pytest.skip("demo_data/mooncake_conversation_slice.jsonl not shipped")
    reqs = load_trace(path)
    base = SimConfig(host_bytes=20 * 10**9)  # the slice touches far less than the full trace: shrink the host tier
    scale, _ = calibrate_time_scale(reqs, base, load=0.85)
    fcfs = simulate(reqs, replace(base, scheduler="fcfs", time_scale=scale))
    dual = simulate(reqs, replace(base, scheduler="dual-queue", time_scale=scale))
    assert fcfs.completed == dual.completed == len(reqs) - fcfs.rejected
    assert fcfs.tokens["ssd_sync"] > 0 and dual.tokens["ssd_prefetch"] > 0  # the slice exercises the SSD tier
    assert dual.mean_queue_s < fcfs.mean_queue_s
    assert dual.p99_ttft_s <= fcfs.p99_ttft_s


def test_shared_prefix_workload_has_the_documented_property(tmp_path, capsys):
    from kvtier.sim.workloads import SharedPrefixSpec, generate_shared_prefix, shared_prefix_stats

    spec = SharedPrefixSpec(requests=1500, seed=3)
    lines = generate_shared_prefix(spec)
    assert lines == generate_shared_prefix(spec) and lines != generate_shared_prefix(replace(spec, seed=4))
    st = shared_prefix_stats(lines)
    assert st["requests"] == 1500 and abs(st["share_fraction"] - 0.38) < 0.04
    assert shared_prefix_stats(generate_shared_prefix(replace(spec, shared_fraction=0.0)))["share_fraction"] < 0.02
    assert all(o["hash_ids"][0] == 0 and len(o["hash_ids"]) == -(-o["input_length"] // 512) for o in lines)
    assert [o["timestamp"] for o in lines] == sorted(o["timestamp"] for o in lines)
    out = tmp_path / "shared.jsonl"
    assert cli_main(["workload", "shared-prefix", str(out), "--requests", "300", "--seed", "3"]) == 0
    assert "share >= 6K prefix tokens" in capsys.readouterr().out
    reqs = load_trace(out)
    assert len(reqs) == 300 and reqs[0].blocks[0] == 0
    with pytest.raises(ValueError):
        SharedPrefixSpec(prefix_min=9000, prefix_max=100)
    # the command says what is wrong in one line (exit status 1), no traceback, and writes nothing
    with pytest.raises(SystemExit, match=r"^kvtier workload: requests >= 1"):
        cli_main(["workload", "shared-prefix", str(tmp_path / "none.jsonl"), "--requests", "0"])
    unwritable = r"^kvtier workload: cannot write .*shared\.jsonl/out\.jsonl: .*shared\.jsonl: File exists$"
    with pytest.raises(SystemExit, match=unwritable):  # its directory is a file
        cli_main(["workload", "shared-prefix", str(out / "out.jsonl"), "--requests", "10"])
    assert not (tmp_path / "none.jsonl").exists()
