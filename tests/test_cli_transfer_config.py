"""`--kv-transfer-config FILE` of `kvtier simulate` and `kvtier replay` (`kvtier.replay.transfer_config`): the offline
tools run exactly the scheduler and eviction keys a shipped vLLM configuration sets, refuse flags that contradict
it, name a wrong key, and say which keys they cannot model."""

from __future__ import annotations

import json
import logging
import re
from dataclasses import replace
from pathlib import Path

import pytest

from kvtier.cli import main as cli_main
from kvtier.replay.transfer_config import load_transfer_config, scheduler_name
from kvtier.scheduler_hooks.dual_queue_config import DualQueueConfig
from kvtier.scheduler_hooks.dual_queue_policy import make_scheduling_policy
from kvtier.storage_backends.config import ConfigError

REPO = Path(__file__).resolve().parent.parent
HRRN = REPO / "configs" / "vllm-kv-transfer-hrrn.json"
PLAIN = REPO / "configs" / "vllm-kv-transfer.json"
SLICE = REPO / "demo_data" / "mooncake_conversation_slice.jsonl"
SESSIONS = REPO / "demo_data" / "mooncake_conversation_sessions.jsonl"
GIB = 1 << 30


def _scheduler_keys(path: Path) -> dict:
    return json.loads(path.read_text())["kv_connector_extra_config"].get("kvtier.scheduler", {})


def _copy_with(tmp_path: Path, name: str = "ktc.json", **scheduler_keys) -> Path:
    """configs/vllm-kv-transfer-hrrn.json with `scheduler_keys` set in kvtier.scheduler (None: removed)."""
    spec = json.loads(HRRN.read_text())
    sched = spec["kv_connector_extra_config"]["kvtier.scheduler"]
    for k, v in scheduler_keys.items():
        if v is None:
            sched.pop(k)
        else:
            sched[k] = v
    out = tmp_path / name
    out.write_text(json.dumps(spec))
    return out


# --- the loader ------------------------------------------------------------------------------------------------------


def test_hrrn_config_is_what_the_production_parser_builds_from_its_keys():
    tc = load_transfer_config(str(HRRN))
    assert tc.scheduler == DualQueueConfig.from_keys(_scheduler_keys(HRRN))  # the production hook's parser
    assert tc.scheduler.hrrn_service_exponent == 1.5
    assert (tc.scheduler.ready_order, tc.scheduler.starvation_lookahead, tc.scheduler.mean_window) == ("hrrn", True,
                                                                                                      1024)
    assert tc.scheduler_name == "dual-queue+hrrn+delay-hit"
    # configs/lmcache-kvtier.yaml: no cache_policy (LMCache's LRU), no kvtier.eviction_policy, 5 GiB host memory
    assert (tc.host_policy, tc.cache_policy, tc.ssd_policy, tc.host_bytes) == ("lru", None, "lru", 5 * GIB)
    assert Path(tc.lmcache_file) == REPO / "configs" / "lmcache-kvtier.yaml"
    plain = load_transfer_config(str(PLAIN))
    assert plain.scheduler == DualQueueConfig() and plain.scheduler_name == "dual-queue+delay-hit"


@pytest.mark.parametrize("keys, name", [
    ({}, "dual-queue+delay-hit"),
    ({"delay_hit": False}, "dual-queue"),
    ({"ready_order": "hrrn", "delay_hit": False}, "dual-queue+hrrn"),
    ({"delay_hit_own_loads": True}, "dual-queue+delay-hit+own-loads"),
    ({"load_or_recompute": False, "idle_replan_counts_arrivals": False},
     "dual-queue+delay-hit+always-load+eager-replan"),
])
def test_scheduler_name_builds_a_policy_running_exactly_the_config(keys, name):
    cfg = DualQueueConfig.from_keys(keys)
    assert scheduler_name(cfg) == name
    assert make_scheduling_policy(name, cfg).config == cfg


def test_own_loads_without_delay_hit_has_no_name_of_its_own():
    cfg = DualQueueConfig.from_keys({"delay_hit": False, "delay_hit_own_loads": True})
    assert scheduler_name(cfg) == "dual-queue"  # the key has no effect without delay_hit
    assert make_scheduling_policy("dual-queue", cfg).config == replace(cfg, delay_hit_own_loads=False)


@pytest.mark.parametrize("edit, named", [
    ({"hrrn_service_exponant": 2.0}, "hrrn_service_exponant"),  # a misspelt key
    ({"hrrn_service_exponent": -1}, "kvtier.scheduler.hrrn_service_exponent"),  # a value out of range
    ({"ready_order": "sjf"}, "kvtier.scheduler.ready_order"),
])
def test_a_wrong_scheduler_key_is_an_error_naming_it(tmp_path, edit, named):
    bad = _copy_with(tmp_path, **edit)
    with pytest.raises(ConfigError, match=named):
        load_transfer_config(str(bad))
    with pytest.raises(SystemExit, match=named):
        cli_main(["simulate", str(SLICE), "--kv-transfer-config", str(bad), "--limit", "5", "--no-progress"])


def test_wrong_tier_keys_and_policies_are_errors_naming_them(tmp_path, lmcache_yaml):
    spec = json.loads(HRRN.read_text())
    spec["kv_connector_extra_config"]["kvtier.evicton_policy"] = "lru"
    (tmp_path / "inline.json").write_text(json.dumps(spec))
    with pytest.raises(ConfigError, match="kvtier.evicton_policy"):
        load_transfer_config(str(tmp_path / "inline.json"))
    with pytest.raises(ConfigError, match="kvtier.eviction_policy"):
        load_transfer_config(lmcache_yaml(eviction_policy="no-such-policy"))
    with pytest.raises(ConfigError, match="'MRU' has no kvtier equal"):
        load_transfer_config(lmcache_yaml(lmcache_lines="cache_policy: MRU\n"))
    with pytest.raises(ConfigError, match="KVTIER_NOPE"):
        load_transfer_config(lmcache_yaml(lmcache_lines="cache_policy: KVTIER_NOPE\n"))
    spec["kv_connector_extra_config"].pop("kvtier.evicton_policy")
    for key, value in (("kv_connector", "LMCacheConnectorV1"), ("kv_connector_module_path", "lmcache.integration")):
        other = {**spec, key: value}
        (tmp_path / "other.json").write_text(json.dumps(other))
        with pytest.raises(ConfigError, match=f'"{key}" must be'):
            load_transfer_config(str(tmp_path / "other.json"))


def test_lmcache_policies_map_to_kvtiers_equal_ones(lmcache_yaml):
    for written, ours in (("LRU", "lru"), ("fifo", "fifo"), ("LFU", "lfu"), ("KVTIER_S3FIFO", "s3fifo"),
                          ("KVTIER_ANSWER_LENGTH", "answer-length")):
        tc = load_transfer_config(lmcache_yaml(lmcache_lines=f"cache_policy: {written}\n"))
        assert (tc.host_policy, tc.cache_policy) == (ours, written)
        assert tc.scheduler == DualQueueConfig()  # a YAML alone: production's scheduler defaults


# --- kvtier simulate --------------------------------------------------------------------------------------------------


@pytest.fixture
def spy(monkeypatch):
    """Records the scheduling policies and host-tier policies the simulator builds."""
    import kvtier.sim.engine as engine

    built: dict[str, list] = {"policies": [], "evictions": []}
    real_policy, real_eviction = engine.make_scheduling_policy, engine._make_eviction

    def policy(name, config=None):
        p = real_policy(name, config)
        built["policies"].append(p)
        return p

    def eviction(name, clock, capacity):
        built["evictions"].append((name, capacity))
        return real_eviction(name, clock, capacity)

    monkeypatch.setattr(engine, "make_scheduling_policy", policy)
    monkeypatch.setattr(engine, "_make_eviction", eviction)
    return built


def _simulate(path: Path, out: Path, *extra: str) -> dict:
    assert cli_main(["simulate", str(SLICE), "--kv-transfer-config", str(path), "--limit", "80", "--no-progress",
                     "--json", str(out), *extra]) == 0
    return json.loads(out.read_text())


def test_simulate_runs_the_shipped_hrrn_config(tmp_path, spy, capsys, caplog):
    with caplog.at_level(logging.WARNING, logger="kvtier.sim.simulate"):
        res = _simulate(HRRN, tmp_path / "r.json")
    printed = capsys.readouterr().out
    assert f"--kv-transfer-config {HRRN}" in printed and "hrrn_service_exponent: 1.5" in printed
    ours = [p for p in spy["policies"] if p.name == "dual-queue+hrrn+delay-hit"]
    assert len(ours) == 1 and res["scheduler"] == "dual-queue+hrrn+delay-hit"
    cfg = ours[0].config
    assert cfg.hrrn_service_exponent == 1.5
    # everything but what the simulator supplies itself (GPU size and cost model: --profile's) is the file's
    expected = DualQueueConfig.from_keys(_scheduler_keys(HRRN))
    assert replace(cfg, gpu_capacity=None, load_plan=replace(cfg.load_plan, cost=expected.load_plan.cost)) == expected
    assert set(spy["evictions"]) == {("lru", 5 * GIB)}  # LMCache's default policy, max_local_cpu_size 5 (GiB)
    ignored = " ".join(r.getMessage() for r in caplog.records)
    for key in ("kv_load_failure_policy", "chunk_size", "kvtier.ssd_capacity_gb"):
        assert key in ignored
    assert "hrrn_service_exponent" not in ignored and "max_local_cpu_size" not in ignored
    # the exponent changes the run: the same file with exponent 0 (FCFS by arrival) queues differently
    zero = _simulate(_copy_with(tmp_path, hrrn_service_exponent=0), tmp_path / "z.json")
    assert zero["mean_queue_s"] != res["mean_queue_s"]


def test_simulate_reports_cost_keys_it_cannot_model(tmp_path, caplog):
    path = _copy_with(tmp_path, ssd_read_gbps=3.0, calibrate=False)
    with caplog.at_level(logging.WARNING, logger="kvtier.sim.simulate"):
        _simulate(path, tmp_path / "r.json")
    ignored = " ".join(r.getMessage() for r in caplog.records if "ignored" in r.getMessage())
    assert "kvtier.scheduler.ssd_read_gbps" in ignored and "kvtier.scheduler.calibrate" in ignored
    assert "kvtier.scheduler.mean_window" not in ignored


@pytest.mark.parametrize("flag", [["--scheduler", "fcfs"], ["--eviction", "lru"], ["--host-gb", "3"],
                                  ["--delay-hit-threshold", "50"], ["--starvation-multiple", "2"],
                                  ["--starvation-floor", "1"], ["--mean-window", "8"], ["--starvation-lookahead"],
                                  ["--recompute-gpu-weight", "1"]])
def test_simulate_refuses_flags_that_contradict_the_file(flag):
    with pytest.raises(SystemExit, match=re.escape(f"{flag[0]} contradict --kv-transfer-config {HRRN}")):
        cli_main(["simulate", str(SLICE), "--kv-transfer-config", str(HRRN), "--limit", "5", "--no-progress", *flag])


def test_simulate_without_the_file_keeps_its_defaults(tmp_path, spy):
    out = tmp_path / "r.json"
    assert cli_main(["simulate", str(SLICE), "--limit", "40", "--no-progress", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert (res["scheduler"], res["eviction"]) == ("dual-queue", "lru")
    cfg = next(p for p in spy["policies"] if p.name == "dual-queue").config
    assert (cfg.delay_hit_threshold_tokens, cfg.starvation_multiple, cfg.starvation_floor_s, cfg.mean_window,
            cfg.starvation_lookahead, cfg.load_plan.recompute_gpu_weight) == (100, 4.0, 2.0, 256, False, 1000.0)


# --- kvtier replay ----------------------------------------------------------------------------------------------------


def _replay(tmp_path: Path, name: str, *args: str) -> list[dict]:
    out = tmp_path / f"{name}.json"
    assert cli_main(["replay", str(SESSIONS), "--host-capacity", "0.03", "--no-progress", "--json", str(out),
                     *args]) == 0
    return json.loads(out.read_text())["results"]


def test_replay_runs_the_yamls_kvtier_host_policy(tmp_path, lmcache_yaml, capsys):
    yaml = lmcache_yaml(lmcache_lines="cache_policy: KVTIER_S3FIFO\n")
    [got] = _replay(tmp_path, "file", "--kv-transfer-config", yaml)
    assert "host tier s3fifo (cache_policy KVTIER_S3FIFO)" in capsys.readouterr().out
    [s3fifo] = _replay(tmp_path, "s3fifo", "--policies", "s3fifo")
    [lru] = _replay(tmp_path, "lru", "--policies", "lru")
    assert got["policy"] == "s3fifo"
    assert (got["hit_rate"], got["host_hits"], got["ssd_hits"]) == (s3fifo["hit_rate"], s3fifo["host_hits"],
                                                                    s3fifo["ssd_hits"])
    assert lru["hit_rate"] != s3fifo["hit_rate"]  # so the equality above says which policy ran


def test_replay_runs_the_files_ssd_policy_on_a_bounded_ssd(tmp_path, lmcache_yaml):
    yaml = lmcache_yaml(lmcache_lines="cache_policy: KVTIER_S3FIFO\n", eviction_policy="fifo")
    [got] = _replay(tmp_path, "file", "--kv-transfer-config", yaml, "--ssd-capacity", "0.2")
    [fifo] = _replay(tmp_path, "fifo", "--policies", "s3fifo", "--ssd-policy", "fifo", "--ssd-capacity", "0.2")
    [lru] = _replay(tmp_path, "lru", "--policies", "s3fifo", "--ssd-policy", "lru", "--ssd-capacity", "0.2")
    assert (got["ssd_hits"], got["host_hits"]) == (fifo["ssd_hits"], fifo["host_hits"])
    assert lru["ssd_hits"] != fifo["ssd_hits"]


def test_replay_says_when_the_host_policy_is_lmcaches_default(tmp_path, capsys):
    [got] = _replay(tmp_path, "file", "--kv-transfer-config", str(PLAIN))
    assert "host tier lru (no cache_policy: LMCache's default LRU, which is kvtier's lru)" in capsys.readouterr().out
    [lru] = _replay(tmp_path, "lru", "--policies", "lru")
    assert (got["policy"], got["hit_rate"]) == ("lru", lru["hit_rate"])


@pytest.mark.parametrize("flag", [["--policies", "lru"], ["--ssd-policy", "lru"]])
def test_replay_refuses_flags_that_contradict_the_file(flag):
    with pytest.raises(SystemExit, match=re.escape(f"{flag[0]} contradict --kv-transfer-config {PLAIN}")):
        cli_main(["replay", str(SESSIONS), "--kv-transfer-config", str(PLAIN), "--no-progress", *flag])
