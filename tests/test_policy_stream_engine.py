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


@pytest.mark.parametrize("policy", ["lru", "answer-length", "adaptive"])
def test_engine_stream_replays_to_equal_hits(tmp_path, policy):
    kvtier = Path(sys.executable).with_name("kvtier")
    assert kvtier.exists(), f"the kvtier command is not installed next to {sys.executable}"
    rec_dir = tmp_path / "rec"
    env = dict(os.environ, LMCACHE_TRACK_USAGE="false")
    p = subprocess.run([str(kvtier), "demo-vllm", "--conversations", "4", "--turns", "3", "--no-lmcache-mp",
                        "--no-ideal", "--host-mb", "6", "--eviction-policy", policy, "--record-host-policy",
                        str(rec_dir), "--plot", str(tmp_path / "demo.png"), "--timeout", "400"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, f"rc {p.returncode}\n{p.stdout[-6000:]}\n{p.stderr[-3000:]}"
    streams = sorted(rec_dir.glob("host-policy-*.jsonl"))
    assert len(streams) == 1, streams  # one engine with a host tier (vLLM alone has none)
    records = read_stream(streams[0])
    assert records[0]["policy"] == policy
    res = replay_stream(records)
    print(f"{policy}: engine {res.engine_hits} hits / {res.engine_misses} misses, offline {res.offline_hits} / "
          f"{res.offline_misses}, {res.evictions} evictions, {res.signals} signals")
    assert res.victims > 0, res.report()  # the host tier was small enough to evict
    assert res.engine_hits > 0 and res.signals > 0, res.report()
    assert res.first_divergence is None, res.report()
    assert (res.offline_hits, res.offline_misses) == (res.engine_hits, res.engine_misses), res.report()
    # the command says the same
    out = subprocess.run([str(kvtier), "replay-stream", str(streams[0])], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "no divergence" in out.stdout, out.stdout + out.stderr
