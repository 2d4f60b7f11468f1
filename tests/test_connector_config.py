"""The connector's start-up checks without an engine: versions, `kv_connector_extra_config`, the LMCache YAML,
and the pieces that cross process boundaries (RPC, metadata, stats)."""

from __future__ import annotations

import os
import pickle
import uuid
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytestmark = [pytest.mark.compat, pytest.mark.needs("lmcache")]  # KVTierConnector is kvtier[lmcache]

from kvtier.connector import config as C  # noqa: E402
from kvtier.storage_backends.config import ConfigError  # noqa: E402


def test_shipped_vllm_json_names_the_connector_and_recompute_policy():
    import json

    path = os.path.join(os.path.dirname(C.__file__), "..", "configs", "vllm-kv-transfer.json")
    with open(path) as f:
        cfg = json.load(f)
    assert cfg["kv_connector"] == "KVTierConnector" and cfg["kv_connector_module_path"] == "kvtier.connector"
    assert cfg["kv_load_failure_policy"] == "recompute"
    assert cfg["kv_connector_extra_config"]["config_file"] == "configs/lmcache-kvtier.yaml"


def test_valid_config_is_page_first_with_inline_overrides(lmcache_yaml, tmp_path):
    path = lmcache_yaml(chunk_size=64)
    cfg = C.load_connector_config({"config_file": path, "kvtier.io_threads": 2,
                                   "kvtier.connector": {"prefetch_concurrency": 3}}, block_size=32)
    assert cfg.kvtier.chunk_format == "page_first" and cfg.kvtier.page_tokens == 32
    assert cfg.kvtier.io_threads == 2 and cfg.options.prefetch_concurrency == 3 and cfg.chunk_size == 64
    assert cfg.lmcache.extra_config["kvtier.chunk_format"] == "page_first"  # what LMCache hands the plugin
    assert os.path.isdir(cfg.kvtier.ssd_path)


@pytest.mark.parametrize("extra, needle", [
    ({}, "config_file is missing"),
    ({"config_file": "/nonexistent/lmcache.yaml"}, "does not exist"),
    ({"kvtier.ssd_pth": "/tmp/x"}, "did you mean kvtier.ssd_path"),
    ({"kvtier.chunk_format": "KV_2LTD"}, "page-first"),
    ({"kvtier.page_tokens": 24}, "not a multiple of kvtier.page_tokens"),
    ({"kvtier.connector": {"prefetch_concurency": 2}}, "kvtier.connector.prefetch_concurency"),
    # the former test-only knobs are no settings (tests inject them: kvtier.testing.transfer_timing)
    ({"kvtier.connector": {"debug_load_hold_steps": 6}}, "unknown key(s) kvtier.connector.debug_load_hold_steps"),
    ({"kvtier.connector": {"debug_prefetch_delay_s": 1.5}}, "unknown key(s) kvtier.connector.debug_prefetch_delay_s"),
    ({"kvtier.connector": {"kv_layout": "weird"}}, "kv_layout"),
    ({"kvtier.connector": {"idle_wait_ms": -1}}, "kvtier.connector.idle_wait_ms must be a number >= 0"),
    ({"kvtier.connector": {"idle_wait_ms": "20"}}, "kvtier.connector.idle_wait_ms must be a number >= 0"),
    ({"kvtier.connector": {"sync_load_budget_mb": -1}}, "kvtier.connector.sync_load_budget_mb must be a number >= 0"),
    ({"kvtier.connector": {"sync_load_budget_mb": "128"}}, "kvtier.connector.sync_load_budget_mb must be a number"),
    ({"kvtier.connector": {"sync_load_budget_tokens": 1.5}}, "sync_load_budget_tokens must be an integer >= 0"),
    ({"lmcache_config": "x"}, "unknown key(s) lmcache_config"),
    # kvtier.scheduler is checked by the connector too (an engine without the scheduler hook would ignore it)
    ({"kvtier.scheduler": {"ready_ordr": "hrrn"}}, "kvtier.scheduler: unknown key(s) ready_ordr"),
    ({"kvtier.scheduler": {"ready_order": "sjf"}}, "kvtier.scheduler.ready_order must be one of"),
    ({"kvtier.scheduler": ["hrrn"]}, "kvtier.scheduler must be an object"),
])
def test_bad_settings_name_the_key(lmcache_yaml, extra, needle):
    base = {"config_file": lmcache_yaml(chunk_size=64)} if "config_file" not in extra and extra != {} else {}
    with pytest.raises(ConfigError) as e:
        C.load_connector_config({**base, **extra}, block_size=32)
    assert needle in str(e.value)


def test_unwritable_ssd_path_and_missing_plugin_are_start_errors(lmcache_yaml, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ConfigError, match="kvtier.ssd_path: cannot create"):
        C.load_connector_config({"config_file": lmcache_yaml(), "kvtier.ssd_path": str(blocker / "ssd")}, 16)
    plain = tmp_path / "plain.yaml"
    plain.write_text("chunk_size: 256\nlocal_cpu: true\nmax_local_cpu_size: 1\n")
    with pytest.raises(ConfigError, match="no storage plugin uses kvtier"):
        C.load_connector_config({"config_file": str(plain)}, 16)


def test_connector_start_runs_the_version_guard(monkeypatch):
    """check_versions (called in the connector's constructor, both roles) is the guard: a known-broken
    combination stops the engine with the reason, an untested one in strict mode too."""
    from kvtier.compat import guard, matrix

    v = guard.installed_versions()
    assert C.check_versions() == (v.vllm, v.lmcache)
    rows = matrix.load() + (matrix.Combination(v.build, "0.1.0", v.lmcache, status="broken", reason="too old"),)
    monkeypatch.setattr(matrix, "load", lambda path=None: rows)
    monkeypatch.setattr(guard, "installed_versions", lambda: guard.InstalledVersions(v.build, "0.1.0", v.lmcache))
    with pytest.raises(C.UnsupportedVersion, match="too old"):
        C.check_versions()
    monkeypatch.setattr(guard, "installed_versions", lambda: guard.InstalledVersions(v.build, "9.9.9", v.lmcache))
    monkeypatch.setenv("KVTIER_STRICT_VERSIONS", "1")
    with pytest.raises(C.UnsupportedVersion, match="nearest tested combination"):
        C.check_versions()


def test_rpc_round_trip_and_timeout():
    """Typed on both ends: the handler gets the request struct, the caller the reply struct; a handler that raises,
    or answers the wrong type (or no reply at all), is an RPCError, as is a rank that does not answer."""
    from kvtier.connector.messages import LookupResult
    from kvtier.connector.rpc import (
        Ack,
        Lookup,
        LookupReply,
        Ping,
        Release,
        RPCClient,
        RPCError,
        RPCServer,
        Stats,
        endpoint,
    )

    def handler(req):
        if isinstance(req, Lookup):
            return LookupReply(LookupResult(host_end=len(req.tokens), hit_end=req.tokens[-1], chunk_size=16))
        if isinstance(req, Ping):
            return Ack()  # not a PingReply
        if isinstance(req, Stats):
            return {"ssd": {}}  # not a reply at all
        raise ValueError("nope")

    addr = endpoint(f"unit-{uuid.uuid4().hex[:6]}", 0)
    srv = RPCServer(addr, handler)
    try:
        cli = RPCClient([addr], timeout_s=2)
        assert cli.call(Lookup(rid="r", tokens=[1, 2, 9])) == [LookupReply(LookupResult(3, 9, chunk_size=16))]
        with pytest.raises(RPCError, match="rank 0 failed: ValueError: nope"):
            cli.call(Release(rid="r"))
        with pytest.raises(RPCError, match="Ack is no answer to Ping"):
            cli.call(Ping())
        with pytest.raises(RPCError, match="TypeError"):
            cli.call(Stats())
        assert cli.call(Lookup(rid="r", tokens=[5])) == [LookupReply(LookupResult(1, 5, chunk_size=16))]
        cli.close()
    finally:
        srv.close()
    dead = RPCClient([endpoint(f"dead-{uuid.uuid4().hex[:6]}", 0)], timeout_s=0.2)
    with pytest.raises(RPCError, match="no answer"):
        dead.call(Ping())
    dead.close()


def test_rpc_with_two_ranks_survives_one_rank_failing_or_hanging():
    """Tensor parallelism: every rank answers every call. One rank's error or silence is an RPCError naming that
    rank (the caller treats it as a miss), and the next call to both ranks works (no socket left out of step)."""
    import threading

    from kvtier.connector.rpc import Ack, Ping, PingReply, Release, RPCClient, RPCError, RPCServer, endpoint

    eid = f"tp2-{uuid.uuid4().hex[:6]}"
    release = threading.Event()

    def rank0(req):
        return Ack() if isinstance(req, Release) else PingReply(rank=0, chunk_size=16)

    def rank1(req):
        if isinstance(req, Release):
            if req.rid == "fail":
                raise RuntimeError("rank 1 storage broke")
            if req.rid == "hang":
                release.wait(5)
            return Ack()
        return PingReply(rank=1, chunk_size=16)

    servers = [RPCServer(endpoint(eid, 0), rank0), RPCServer(endpoint(eid, 1), rank1)]
    cli = RPCClient([endpoint(eid, 0), endpoint(eid, 1)], timeout_s=1)
    both = [PingReply(rank=0, chunk_size=16), PingReply(rank=1, chunk_size=16)]
    try:
        assert cli.call(Ping()) == both
        for _ in range(3):
            with pytest.raises(RPCError, match="rank 1 failed: RuntimeError: rank 1 storage broke"):
                cli.call(Release(rid="fail"))
            assert cli.call(Ping()) == both
        with pytest.raises(RPCError, match="no answer from rank 1"):
            cli.call(Release(rid="hang"), timeout_ms=300)
        release.set()
        assert cli.call(Ping()) == both
    finally:
        release.set()
        cli.close()
        for srv in servers:
            srv.close()


def test_metadata_and_stats_cross_processes():
    from kvtier.connector.messages import FinishedSpec, KVTierConnectorMetadata, LoadSpec, LookupResult, SaveSpec
    from kvtier.connector.metrics import KVTierConnectorStats

    md = KVTierConnectorMetadata([LoadSpec("r", [1, 2], [0], 0, 2)], [SaveSpec("r", [1, 2], [0], 0)],
                                 [FinishedSpec("r", [1, 2, 3], 2, 1, 0.0)])
    assert pickle.loads(pickle.dumps(md)) == md
    a = KVTierConnectorStats()
    a.add(loads=2, loaded_tokens=64, load_seconds=0.01)
    b = KVTierConnectorStats(data=dict(a.snapshot()))
    r = a.aggregate(b).reduce()
    assert r["kvtier_loads"] == 4 and r["kvtier_loaded_tokens"] == 128 and r["kvtier_avg_load_ms"] == 5.0
    comb = LookupResult.combine([LookupResult(64, 96, 32, 100, 32), LookupResult(32, 64, 0, 0, 32)])
    assert (comb.host_end, comb.hit_end) == (32, 64)


def test_plugin_registers_the_connector_name():
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from kvtier.connector import plugin

    plugin.register()
    plugin.register()  # idempotent: vLLM loads general plugins in every process
    cls = KVConnectorFactory.get_connector_class(KVTransferConfig(kv_connector="KVTierConnector", kv_role="kv_both"))
    assert cls.__name__ == "KVTierConnector"


def _worker_with_fake_engine(retrieve):
    from types import SimpleNamespace as NS

    import torch

    from kvtier.connector.config import ConnectorOptions
    from kvtier.connector.worker_side import WorkerSide

    vcfg = NS(cache_config=NS(block_size=16), parallel_config=NS(world_size=1, rank=0),
              kv_transfer_config=NS(engine_id="unit"),
              model_config=NS(get_num_kv_heads=lambda pc: 2, get_head_size=lambda: 32))
    ws = WorkerSide(vcfg, NS(options=ConnectorOptions(), chunk_size=32, page_tokens=16))
    ws.kv_list = [torch.zeros(1)]
    ws.engine = NS(retrieve=retrieve)
    ws.host = NS(unpin=lambda k: True)
    return ws


def test_partial_or_failed_load_reports_exactly_the_blocks_to_recompute():
    import torch

    from kvtier.connector.messages import KVTierConnectorMetadata, LoadSpec

    def half(tokens, mask, **kw):  # chunks 0-1 arrive, chunks 2-3 do not (evicted or corrupt)
        ret = torch.zeros(len(tokens), dtype=torch.bool)
        ret[:64] = True
        return ret

    spec = LoadSpec("r", list(range(128)), list(range(10, 18)), 0, 128)
    ws = _worker_with_fake_engine(half)
    ws.bind(KVTierConnectorMetadata(loads=[spec]))
    ws.start_load()
    assert ws.take_load_errors() == {14, 15, 16, 17} and ws.take_load_errors() == set()
    ws.close()

    def boom(tokens, mask, **kw):
        raise RuntimeError("injected")

    ws = _worker_with_fake_engine(boom)
    ws.bind(KVTierConnectorMetadata(loads=[LoadSpec("r", list(range(128)), list(range(10, 18)), 32, 128)]))
    ws.start_load()
    assert ws.take_load_errors() == {12, 13, 14, 15, 16, 17}  # everything after vLLM's own 32 cached tokens
    ws.close()


def test_async_partial_load_reports_its_blocks_no_later_than_the_step_that_finishes_it():
    """An asynchronous load (transfer thread) that fails in part: the step whose `get_finished` reports the
    request in finished_recving also hands vLLM exactly the blocks that did not arrive; a load job that raises
    reports every block after vLLM's own cached tokens. Never before the load ended, never lost."""
    import threading

    import torch

    from kvtier.connector.messages import KVTierConnectorMetadata, LoadSpec
    from kvtier.connector.transfers import TransferQueue

    gate = threading.Event()

    def half(tokens, mask, **kw):
        gate.wait(30)
        ret = torch.zeros(len(tokens), dtype=torch.bool)
        ret[:64] = True
        return ret

    def boom(tokens, mask, **kw):
        raise RuntimeError("injected")

    for retrieve, gpu_cached, bad in ((half, 0, {14, 15, 16, 17}), (boom, 32, {12, 13, 14, 15, 16, 17})):
        ws = _worker_with_fake_engine(retrieve)
        ws.transfers = TransferQueue(ws._engine_lock)
        try:
            ws.bind(KVTierConnectorMetadata(loads=[LoadSpec("r", list(range(128)), list(range(10, 18)), gpu_cached,
                                                            128, is_async=True)]))
            ws.start_load()
            if retrieve is half:  # still running: nothing reported yet
                assert ws.get_finished(set()) == (None, None) and ws.take_load_errors() == set()
                gate.set()
            assert ws.transfers.wait_for(["r"], timeout=30)
            assert ws.get_finished(set()) == (None, {"r"})
            assert ws.take_load_errors() == bad
        finally:
            ws.close()


def test_check_config_validates_a_vllm_kv_transfer_json(lmcache_yaml, tmp_path):
    """`kvtier check-config` on a vLLM --kv-transfer-config JSON: the shipped one (its SSD path moved here) passes;
    a wrong scheduler key, connector name or extra key is an error naming it."""
    import json

    from kvtier.cli.check_config import check

    shipped = json.loads((Path(C.__file__).resolve().parent.parent / "configs" / "vllm-kv-transfer.json").read_text())
    shipped["kv_connector_extra_config"]["kvtier.ssd_path"] = str(tmp_path / "ssd")

    def write(spec: dict) -> str:
        path = tmp_path / "ktc.json"
        path.write_text(json.dumps(spec))
        return str(path)

    out = check(write(shipped))
    assert out.startswith("OK:") and "KVTierConnector" in out and str(tmp_path / "ssd") in out, out
    assert "note" not in out  # the shipped file recomputes failed loads
    assert os.path.isdir(tmp_path / "ssd")
    bad = [
        ({**shipped, "kv_connector": "LMCacheConnectorV1"}, "kv_connector"),
        ({**shipped, "kv_role": "kv_consumer"}, "kv_role"),
        ({**shipped, "kv_connector_extra_config": {**shipped["kv_connector_extra_config"],
                                                   "kvtier.scheduler": {"delay_hitt": True}}}, "delay_hitt"),
        ({**shipped, "kv_connector_extra_config": {**shipped["kv_connector_extra_config"],
                                                   "kvtier.io_thread": 2}}, "kvtier.io_thread"),
        ({**shipped, "kv_connector_extra_config": {**shipped["kv_connector_extra_config"], "kvtier.connector": {
            "debug_hold_request_prefix": "x"}}}, "unknown key(s) kvtier.connector.debug_hold_request_prefix"),
    ]
    for spec, needle in bad:
        with pytest.raises(ConfigError) as e:
            check(write(spec))
        assert needle in str(e.value), (needle, str(e.value))
    no_policy = {k: v for k, v in shipped.items() if k != "kv_load_failure_policy"}
    assert "vLLM default: fail" in check(write(no_policy))
    # the shipped HRRN variant is the same file plus the simulator's best scheduler keys, and passes too
    hrrn = json.loads((Path(C.__file__).resolve().parent.parent / "configs" / "vllm-kv-transfer-hrrn.json").read_text())
    scheduler_keys = hrrn["kv_connector_extra_config"].pop("kvtier.scheduler")
    hrrn["kv_connector_extra_config"]["kvtier.ssd_path"] = str(tmp_path / "ssd")
    assert hrrn == shipped and scheduler_keys["ready_order"] == "hrrn"
    hrrn["kv_connector_extra_config"]["kvtier.scheduler"] = scheduler_keys
    out = check(write(hrrn))
    assert out.startswith("OK:") and "note" not in out, out
