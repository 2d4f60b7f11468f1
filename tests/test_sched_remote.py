"""`kvtier simulate`'s shared tier (issue 13): replicas, write-through, REMOTE hints, the store's capacity.

Hand-built scenarios with exact token and eviction counts (simulated time only; no wall-clock assertion)."""

from __future__ import annotations

import pytest

from kvtier.scheduler_hooks.dual_queue_policy import DualQueueConfig
from kvtier.scheduler_hooks.tier_hint import TierState
from kvtier.sim.base import SimConfig, SimRequest
from kvtier.sim.cost_model import get_profile
from kvtier.sim.remote import Cluster, RemoteConfig, route

COST = get_profile("llama3-8b-h100")
BLOCK_BYTES = 512 * COST.kv_bytes_per_token  # one full 512-token block: 64 MiB
NO_STARVE = DualQueueConfig(starvation_multiple=1e9, starvation_floor_s=1e9)
BIG_QUEUE = RemoteConfig(write_queue_mb=1024)  # every write of one request fits the replica's write queue


def req(rid: str, arrival: float, blocks, output: int = 10) -> SimRequest:
    blocks = tuple(blocks)
    return SimRequest(rid, arrival, blocks, 512 * len(blocks), output)


def cluster(reqs, scheduler: str, replicas: int, remote: RemoteConfig | None) -> Cluster:
    return Cluster(reqs, SimConfig(scheduler=scheduler, policy=NO_STARVE), replicas, "round-robin", remote)


def conversation():
    """Turn 1 on replica 0, turn 2 (its history + 2 new blocks) on replica 1, turn 3 on replica 0 again."""
    t1 = list(range(1, 9))
    t2 = t1 + [9, 10]
    return [req("t1", 0.0, t1), req("t2", 5.0, t2), req("t3", 10.0, t2 + [11, 12])]


@pytest.mark.parametrize("scheduler", ["dual-queue", "fcfs+prefetch", "fcfs"])
def test_turn_on_the_other_replica_loads_the_history_from_the_shared_tier(scheduler):
    reqs = conversation()
    assert [[r.rid for r in p] for p in route(reqs, 2)] == [["t1", "t3"], ["t2"]]
    with_remote = cluster(reqs, scheduler, 2, BIG_QUEUE)
    res = with_remote.run()
    assert res.completed == 3
    r0, r1 = res.per_replica
    remote_key = "remote_sync" if scheduler == "fcfs" else "remote"
    assert r1.tokens[remote_key] == 8 * 512  # t2: t1's 8 blocks, written through by replica 0
    assert r1.tokens["computed"] == 2 * 512
    # t3 back on replica 0: t1's 8 blocks from its own tiers, t2's 2 new ones (computed on replica 1) from the store
    assert r0.tokens["host"] + r0.tokens["gpu"] == 8 * 512 and r0.tokens[remote_key] == 2 * 512
    assert r0.tokens["computed"] == 8 * 512 + 2 * 512
    assert res.hits["remote"] == 10 * 512
    assert with_remote.store.reads == 2  # t2 and t3, each once
    assert with_remote.store.writes == 12  # every full block once (t2's blocks 1-8 not sent again)

    local = cluster(reqs, scheduler, 2, None).run()
    assert local.hits["remote"] == 0 and "remote" not in local.per_replica[1].tokens
    assert local.per_replica[1].tokens["computed"] == 10 * 512  # without the shared tier t2 recomputes everything
    assert local.per_replica[0].tokens["computed"] == 8 * 512 + 4 * 512  # and t3 recomputes t2's new blocks
    assert local.recomputed_tokens == 10 * 512  # blocks another replica had computed
    assert res.recomputed_tokens == 0


def test_recompute_baseline_has_no_shared_tier():
    c = cluster(conversation(), "recompute", 2, BIG_QUEUE)
    res = c.run()
    assert c.store is None and res.remote_stats is None and res.hits["remote"] == 0
    assert res.per_replica[1].tokens["computed"] == 10 * 512


def test_remote_request_is_prefetched_and_does_not_block_a_host_request():
    reqs = [req("A", 0.00, range(1, 22)),  # 20 blocks only in the shared tier + 1 new
            req("B", 0.01, [101, 102, 103, 104, 105])]  # 4 blocks in this replica's host tier + 1 new
    remote = RemoteConfig()
    runs = {}
    for s in ("dual-queue+always-load", "dual-queue", "fcfs"):
        c = cluster(reqs, s, 1, remote)
        c.store.seed(range(1, 21), BLOCK_BYTES)
        sim = c.sims[0]
        sim.seed([101, 102, 103, 104], "host")
        hints = []
        add = sim.policy.add
        sim.policy.add = lambda h, need=0, _add=add: (hints.append(h), _add(h, need))[1]
        res = c.run()
        assert res.completed == 2
        runs[s] = (sim, res, hints)
    for s in ("dual-queue+always-load", "dual-queue"):
        sim, res, hints = runs[s]
        a = next(h for h in hints if h.request_id == "A")
        assert a.state is TierState.REMOTE and a.remote_tokens == 20 * 512 and a.remote_bytes == 20 * BLOCK_BYTES
        assert a.plan is None  # production's derivation: a shared-tier part is always prefetched
        assert sim.read_order == ["A"]  # prefetched at arrival
        assert sim.dispatch_order == ["B", "A"]  # B (host-resident) was not held behind A's read
        assert sim.queue["B"] == pytest.approx(0.0, abs=1e-9)
        assert sim.queue["A"] == pytest.approx(20 * BLOCK_BYTES / remote.bytes_per_s + remote.latency_s, rel=1e-9)
        assert res.per_replica[0].tokens["remote"] == 20 * 512 and res.per_replica[0].tokens["host"] == 4 * 512
    fsim, fres, _ = runs["fcfs"]  # the fair baseline sees the tier too: a synchronous read, B waits behind it
    assert fsim.dispatch_order == ["A", "B"] and fres.per_replica[0].tokens["remote_sync"] == 20 * 512
    assert fsim.queue["B"] > 20 * BLOCK_BYTES / remote.bytes_per_s - 0.01


def test_shared_tier_capacity_is_respected_lru():
    reqs = conversation()[:2]
    cap_blocks = 3
    remote = RemoteConfig(capacity_gb=(cap_blocks + 0.5) * BLOCK_BYTES / 1e9, write_queue_mb=1024)
    c = cluster(reqs, "dual-queue", 2, remote)
    res = c.run()
    st = c.store
    # t1 wrote its 8 blocks in order: the store kept the 3 newest, evicting 5; t2's prefix (block 1) is gone,
    # so it gets no remote hit (a prefix stops at its first missing chunk) and writes its own blocks 1-5, 9, 10
    assert list(st.data) == [5, 9, 10]  # LRU order: t2 wrote 1-5, 9, 10 after t1's 6-8 were kept
    assert res.hits["remote"] == 0
    assert st.writes == 8 + 7 and st.evictions == 8 + 7 - cap_blocks
    assert len(st.data) == cap_blocks and st.used <= remote.capacity_gb * 1e9
    assert res.remote_stats["evictions"] == 12


def test_write_queue_bound_drops_writes():
    c = cluster(conversation()[:1], "dual-queue", 2, RemoteConfig())  # 256 MiB per replica: 4 blocks of 64 MiB
    c.run()
    assert c.store.writes == 4 and c.store.dropped_writes == 4
    assert c.store.dropped_write_bytes == 4 * BLOCK_BYTES


def test_sticky_routing_keeps_a_conversation_on_its_replica():
    reqs = conversation() + [req("other", 1.0, [0, 500, 501])]  # a new conversation (sharing only block 0)
    reqs.sort(key=lambda r: r.arrival)
    assert [[r.rid for r in p] for p in route(reqs, 2, "sticky")] == [["t1", "t2", "t3"], ["other"]]
    c = Cluster(reqs, SimConfig(scheduler="dual-queue", policy=NO_STARVE), 2, "sticky", BIG_QUEUE)
    res = c.run()
    assert res.hits["remote"] == 0 and c.store.reads == 0  # every turn served by its own replica's tiers


def test_cli_replicas_with_a_shared_tier(tmp_path, capsys):
    import json

    from kvtier.cli import main as cli_main

    trace = tmp_path / "conv.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": int(r.arrival * 1000), "input_length": r.input_tokens,
                                         "output_length": r.output_tokens, "hash_ids": list(r.blocks)}) + "\n"
                             for r in conversation()))
    out = tmp_path / "r.json"
    rc = cli_main(["simulate", str(trace), "--scheduler", "recompute,dual-queue", "--replicas", "2", "--remote",
                   "--remote-write-queue-mb", "1024", "--time-scale", "1", "--json", str(out), "--no-progress"])
    assert rc == 0
    runs = {r["scheduler"]: r for r in json.loads(out.read_text())["runs"]}
    assert runs["recompute"]["hits"]["remote"] == 0 and runs["recompute"]["remote"] is None
    assert runs["dual-queue"]["hits"]["remote"] == 10 * 512 and runs["dual-queue"]["completed"] == 3
    assert runs["dual-queue"]["remote"]["gbps"] == 10.0 and len(runs["dual-queue"]["per_replica"]) == 2
    assert "local+remote" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="--remote-gbps must be > 0"):
        cli_main(["simulate", str(trace), "--remote-gbps", "0", "--time-scale", "1", "--no-progress"])
    with pytest.raises(SystemExit, match="--replicas must be >= 1"):
        cli_main(["simulate", str(trace), "--replicas", "0", "--time-scale", "1", "--no-progress"])


@pytest.mark.parametrize("scheduler", ["fcfs", "dual-queue+hrrn"])
def test_one_replica_without_a_store_is_the_plain_simulator(scheduler):
    from kvtier.sim.engine import simulate

    reqs = conversation() + [req("x", 0.02, range(300, 330)), req("y", 0.03, [1, 2, 3, 700])]
    cfg = SimConfig(scheduler=scheduler, policy=NO_STARVE, gpu_kv_tokens=40_000)
    plain = simulate(reqs, cfg)
    one = Cluster(reqs, cfg, 1, "round-robin", None).run()
    assert one.per_replica[0].to_json() == plain.to_json() | {"decision_us_mean": one.per_replica[0].decision_us_mean}
    assert one.mean_queue_s == plain.mean_queue_s and one.p99_ttft_s == plain.p99_ttft_s
