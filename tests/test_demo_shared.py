"""`kvtier demo-shared` end to end with its smallest settings: conversations routed round-robin over two real vLLM
CPU replicas, without a connector and with kvtier + one real Redis (`writes: all`, then `writes: continuing`).

Checks what reached Redis with Redis's own counters (`INFO commandstats` SET calls, measured around each request):
- `all`: every request that computed new full chunks wrote them, exactly: the first request of the replay (nothing
  cached anywhere) wrote every full chunk of the KV it computed, and Redis counted two SETs per chunk kvtier says
  it wrote (LMCache's Redis connector stores a chunk as data + metadata);
- `continuing`: a request that did not continue an earlier turn (fewer than `min_history_chunks` cached at
  arrival) sent Redis no SET at all; those that did wrote theirs; so fewer bytes reached Redis than with `all`;
- the turn that reaches a replica after its history was written by the other one is served from Redis (remote
  hits); every configuration generates the same tokens as the run without a connector.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.testing.serve_process import lane_port

pytest.importorskip("vllm")
pytest.importorskip("redis")

pytestmark = pytest.mark.slow

CHUNK = 64


def _run(tmp_path: Path, configs: str, port: int) -> tuple[str, dict]:
    from kvtier.launch.redis_server import redis_server_binary

    try:
        redis_server_binary()
    except RuntimeError as e:
        pytest.skip(str(e))
    kvtier = Path(sys.executable).with_name("kvtier")
    out = tmp_path / "demo.json"
    p = subprocess.run([str(kvtier), "demo-shared", "--conversations", "2", "--turns", "3", "--configs", configs,
                        "--chunk-tokens", str(CHUNK), "--routing", "alternate", "--redis-port", str(port),
                        "--mp-port", str(port + 10),
                        "--json", str(out), "--timeout", "600"], cwd=tmp_path,
                       env=dict(os.environ, LMCACHE_TRACK_USAGE="false"), capture_output=True, text=True, timeout=1800)
    assert p.returncode == 0, f"rc {p.returncode}\n{p.stdout[-6000:]}\n{p.stderr[-4000:]}"
    return p.stdout, json.loads(out.read_text())


def _cached_chunks(r: dict) -> int:
    return (r["gpu_hit"] + r["host_hit"] + r["ssd_hit"] + r["remote_hit"]) // CHUNK


def test_demo_shared_round_robin_writes_all_vs_continuing(tmp_path):
    stdout, res = _run(tmp_path, "none,shared-all,shared-continuing", lane_port(19340))
    check_writes(stdout, res)


def check_writes(stdout: str, res: dict) -> None:
    runs = {name: run["requests"] for name, run in res["runs"].items()}
    for name in ("shared-all", "shared-continuing"):
        assert f"{name}: generated tokens identical to none (6 requests" in stdout, stdout
        for r in runs[name]:
            assert r["redis_sets"] == 2 * r["shared_writes"], (name, r)  # Redis saw exactly what kvtier wrote
            assert r["shared_dropped"] == 0, (name, r)

    every = runs["shared-all"]
    first = every[0]
    assert first["turn"] == 1 and _cached_chunks(first) == 0
    # all computed KV (prompt + answer but its last token) in full chunks went to Redis
    assert first["shared_writes"] == (first["prompt_len"] + len(first["tokens"]) - 1) // CHUNK, first
    assert all(r["shared_writes"] > 0 for r in every if r["turn"] == 1), every
    # a follow-up turn routed to the other replica found its history in Redis
    assert sum(r["remote_hit"] for r in every) > 0, every

    cont = runs["shared-continuing"]
    not_cont = [r for r in cont if _cached_chunks(r) < res["min_history_chunks"]]
    assert not_cont and all(r["redis_sets"] == 0 and r["shared_writes"] == 0 for r in not_cont), cont
    assert any(r["shared_writes"] > 0 for r in cont if _cached_chunks(r) >= res["min_history_chunks"]), cont
    assert sum(r["shared_write_bytes"] for r in cont) < sum(r["shared_write_bytes"] for r in every)
    assert "writes: continuing sent" in stdout
