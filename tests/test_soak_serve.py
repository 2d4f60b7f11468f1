"""A short soak of `vllm serve` with kvtier under faults (`testing/soak.py`, the same code as
`benchmarks/soak_serve.py`, on a 2-3 minute schedule).

The demo model under `kvtier serve` with kvtier's connector (host tier of 4 MiB, an SSD tier of 12 MiB on its own
small tmpfs, evicting all the time, a real Redis as the shared tier, `on_unavailable: degrade`) and the dual-queue
scheduler hook, loaded by `vllm bench serve` at concurrency 8 with cumulative multi-turn prompts. Faults while it
runs: the SSD tier's file system filled to ENOSPC (~20 s; SKIPPED, and reported, where mounting is refused), Redis
killed and restarted, then the server SIGKILLed at the tail of a client round, one byte of its journal flipped, and
the server started again on the same SSD directory. Asserted: no request failed but those in flight at the kill, no
greedy mismatch against a plain vLLM server, the SSD tier within its capacity at every sample, hits of each tier
after each fault, each fault's episode logged exactly once when it starts and once when it clears, and the server
back after the kill. The RSS / fd slopes are only reported (too short to judge).
"""

from __future__ import annotations

import pytest

from kvtier.launch.redis_server import redis_server_binary
from kvtier.testing.soak import SoakConfig, run_soak
from kvtier.testing.soak_report import TIERS, count_episodes, slope
from kvtier.testing.soak_workload import RoundResult, attribute_failures

SHORT = {"minutes": 0, "schedule": ("enospc", "redis", "kill+journal"), "warmup_requests": 16, "gap_s": 20.0,
         "enospc_s": 20.0, "redis_down_s": 5.0, "conversations": 8, "rate": 3.0, "sample_s": 1.0, "rss_warmup_s": 10.0}


@pytest.fixture(scope="module")
def soak(tmp_path_factory):
    pytest.importorskip("vllm")
    pytest.importorskip("redis")
    try:
        redis_server_binary()
    except RuntimeError as e:
        pytest.skip(str(e))
    work = tmp_path_factory.mktemp("soak")
    return run_soak(SoakConfig(workdir=work, json_path=work / "soak.json", plot_path=work / "soak.png", **SHORT))


@pytest.mark.slow
@pytest.mark.needs("vllm_cpu_engine")
def test_no_request_fails_but_those_in_flight_at_the_kill(soak):
    assert soak.requests > 0 and soak.rounds
    assert soak.failed_outside == 0, soak.rounds
    assert all(r["exit"] == 0 or r["failed_inflight_at_kill"] for r in soak.rounds), soak.rounds


@pytest.mark.slow
@pytest.mark.needs("vllm_cpu_engine")
def test_greedy_tokens_equal_the_reference_server(soak):
    assert soak.greedy_checked >= 3
    assert soak.greedy_mismatches == 0, soak.mismatch_examples


@pytest.mark.slow
@pytest.mark.needs("vllm_cpu_engine")
def test_ssd_tier_within_capacity_at_every_sample(soak):
    assert len(soak.samples) >= 20
    assert any(s.ssd_used > 0 for s in soak.samples)
    assert soak.ssd_over_capacity == [], soak.ssd_over_capacity[:3]


@pytest.mark.slow
@pytest.mark.needs("vllm_cpu_engine")
def test_every_tier_hits_after_each_fault(soak):
    done = [f for f in soak.faults if f.status == "done"]
    assert {f.name for f in done} >= {"redis", "kill+journal"}, [(f.name, f.status, f.reason) for f in soak.faults]
    for f in done:
        assert all(f.hits_after[t] > 0 for t in TIERS), (f.name, f.hits_after)


@pytest.mark.slow
@pytest.mark.needs("vllm_cpu_engine")
def test_each_fault_logged_once_when_it_starts_and_once_when_it_clears(soak):
    for f in soak.faults:
        if f.status == "SKIPPED":
            assert f.name == "enospc" and f.reason  # reported, with the reason, never silently
            continue
        started = {k: v for k, v in f.episodes.items() if v[0]}
        if f.name == "enospc":
            assert started, f.episodes  # the full disk was noticed
            assert all(v == [1, 1] for v in started.values()), f.episodes
        elif f.name == "redis":
            assert f.episodes["shared"] == [1, 1], f.episodes
        else:  # kill+journal: the damaged record is reported once, at the restart
            assert f.episodes["journal-damage"][0] == 1, f.episodes


@pytest.mark.slow
@pytest.mark.needs("vllm_cpu_engine")
def test_server_came_back_after_the_kill(soak):
    kill = next(f for f in soak.faults if f.name == "kill+journal")
    assert kill.server_back_s is not None and kill.life_after == kill.life_before + 1
    assert kill.details["leftover_processes"] == 0
    assert any(s.life == kill.life_after for s in soak.samples)


# ---------------------------------------------------------------- the harness's own accounting (no servers)
def test_failures_are_attributed_to_a_kill_only_when_sent_before_it():
    res = RoundResult("r", requests=5, started=100.0, ended=200.0, returncode=0,
                      starts=[110.0, 150.0, 151.0, 152.0, 160.0], errors=["", "reset", "reset", "", "refused"])
    assert attribute_failures(res, kills=[155.0]) == (2, 1)  # the request sent at 160 s failed outside
    assert attribute_failures(res, kills=[]) == (0, 3)
    assert attribute_failures(res, kills=[250.0]) == (0, 3)  # a kill after the round explains nothing in it
    short = RoundResult("r", requests=5, started=100.0, ended=200.0, returncode=1, starts=[110.0], errors=[""])
    assert attribute_failures(short, kills=[]) == (0, 4)  # requests without a record count as failed


def test_episode_messages_are_counted_by_kind():
    log = ("WARNING kvtier: shared store redis://h:1 is unreachable during write (X): its chunks count as misses "
           "(recomputed, or served by the local tiers) until it answers again; retrying every 1 s\n"
           "INFO kvtier: shared store redis://h:1 answers again after 7.1 s; it is used again\n")
    assert count_episodes(log, "redis") == {"shared": [1, 1]}
    log = ("ERROR SSD journal append failed under /x (No space left): chunks are not stored\n"
           "INFO SSD journal appends succeed again (12 occurrences)\n"
           "WARNING SSD journal /x/journal: skipped 2 damaged byte range(s) (155 bytes), 0 record(s)\n")
    assert count_episodes(log, "enospc")["journal"] == [1, 1]
    assert count_episodes(log, "enospc")["disk-full"] == [0, 0]
    assert count_episodes(log, "journal") == {"journal-damage": [1, 0]}


def test_slope_is_least_squares():
    assert slope([0, 1, 2, 3], [1, 3, 5, 7]) == pytest.approx(2.0)
    assert slope([0, 1, 2], [5, 5, 5]) == pytest.approx(0.0)
    assert slope([0, 1], [0, 1]) != slope([0, 1], [0, 1])  # NaN: too few points
