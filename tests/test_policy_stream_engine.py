"""The host tier's policy stream recorded in a real engine and replayed offline (issue 50, part 1): `kvtier
demo-vllm --record-host-policy DIR` with a host tier small enough to evict, for LRU, answer-length and adaptive;
the offline replay of the recorded stream through a fresh policy of the same name (`kvtier replay-stream`) must
give the engine's victims at every eviction and the engine's hits and misses at every host-tier lookup.

Broken on purpose once: an answer-length stream recorded this way, replayed without its session signals, diverged
at its first eviction (the policy offered a chunk the engine's policy had not) and its lookups' hits fell from 795
to 407 of 1561: the assertions below fail on it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytest.importorskip("lmcache", reason="the host tier is LMCache's")

from kvtier.replay.policy_stream import read_stream, replay_stream  # noqa: E402

pytestmark = pytest.mark.slow


POLICIES = ("lru", "answer-length", "adaptive")


def test_engine_streams_replay_to_equal_hits(tmp_path):
    """The three policies' demos run side by side (each its own engine processes: one engine start's wait, not
    three), then each recorded stream is replayed."""
    kvtier = Path(sys.executable).with_name("kvtier")
    assert kvtier.exists(), f"the kvtier command is not installed next to {sys.executable}"
    env = dict(os.environ, LMCACHE_TRACK_USAGE="false")
    runs = {}
    for policy in POLICIES:
        work = tmp_path / policy
        work.mkdir()
        log = open(work / "demo.log", "w")  # noqa: SIM115 - closed below, after the process ends
        proc = subprocess.Popen([str(kvtier), "demo-vllm", "--conversations", "4", "--turns", "3",
                                 "--no-lmcache-mp", "--no-ideal", "--host-mb", "6", "--eviction-policy", policy,
                                 "--record-host-policy", str(work / "rec"), "--plot", str(work / "demo.png"),
                                 "--timeout", "600"], cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT)
        runs[policy] = (work, proc, log)
    try:
        for _, proc, log in runs.values():
            proc.wait(timeout=1500)
            log.close()
    finally:
        for _, proc, log in runs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
    for policy, (work, proc, _) in runs.items():
        assert proc.returncode == 0, f"{policy}: rc {proc.returncode}\n{(work / 'demo.log').read_text()[-6000:]}"
        check_stream(kvtier, env, work, policy)


def check_stream(kvtier: Path, env: dict[str, str], work: Path, policy: str) -> None:
    streams = sorted((work / "rec").glob("host-policy-*.jsonl"))
    assert len(streams) == 1, streams  # one engine with a host tier (vLLM alone has none)
    records = read_stream(streams[0])
    assert records[0]["policy"] == policy
    res = replay_stream(records)
    print(f"{policy}: engine {res.engine_hits} hits / {res.engine_misses} misses, offline {res.offline_hits} / "
          f"{res.offline_misses}, {res.evictions} evictions, {res.signals} signals")
    assert res.victims > 0, res.report()  # the host tier was small enough to evict
    assert res.engine_hits > 0 and res.signals > 0, res.report()
    # No `hit` calls are expected here: this host tier (24 chunks) is smaller than vLLM's prefix cache (40 chunks'
    # worth), so every chunk a load read from it was staged by the request's own prefetch, which is the SSD tier's
    # hit and not reported to the policy (the report itself: tests/test_connector_ssd_stream.py, both ways).
    assert res.first_divergence is None, res.report()
    assert (res.offline_hits, res.offline_misses) == (res.engine_hits, res.engine_misses), res.report()
    # the command says the same
    out = subprocess.run([str(kvtier), "replay-stream", str(streams[0])], cwd=work, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "no divergence" in out.stdout, out.stdout + out.stderr
