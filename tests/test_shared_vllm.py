"""The tier shared by several engines, end to end: two real vLLM CPU engine processes with the kvtier connector and
one real Redis server (`launch/redis_server.py`), configured from the shipped `configs/lmcache-kvtier-redis.yaml`.

The engines (and a third one without a connector, the reference) stay up for the whole module and take prompts
one step at a time over a pipe, so the test decides what runs where and when the store dies:

- turn 1 of conversations 0-2 on engine A; turn 2 of conversation 0 on engine B loads A's history from Redis
  (hits counted by tier, vLLM's own `cached_by_source` too), with tokens identical to the reference engine's;
- turn 3 of conversation 0 on B is served from B's own host/SSD tiers: Redis's own `INFO commandstats` shows not
  one GET (local first);
- Redis killed: conversation 1's turn 2 on B completes with identical tokens (recomputed), the outage is counted;
- Redis restarted (empty): A's new conversation 3 is written again and B's turn 2 of it hits the store again;
- tenants: a prompt engine A ran for tenant A is found in the store by engine B for tenant A only: B's requests
  of the same tokens for tenant B or without a salt get no external token;
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytest.importorskip("redis")

from kvtier.launch.lmcache_yaml import write_lmcache_yaml  # noqa: E402
from kvtier.launch.redis_server import RedisServer, redis_server_binary  # noqa: E402
from kvtier.testing.serve_process import lane_port  # noqa: E402
from kvtier.testing.vllm_engine import EngineProcess, tiny_llama  # noqa: E402

pytestmark = pytest.mark.slow

REDIS_PORT = lane_port(16311)
CHUNK = 32
CHUNK_BYTES = 2 * 2 * CHUNK * 2 * 32 * 4  # K/V x layers x tokens x kv heads x head dim x fp32
#: kvtier.shared.retry_s of the engines: a store marked down is probed again this long after its last failure
RETRY_S = 0.5

#: three engines at once on a small machine: no thread pinning, one OpenMP thread each
ENGINE_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}


class Engine(EngineProcess):
    """One vLLM engine process (`kvtier.testing.vllm_engine`) taking prompts one batch at a time."""

    def __init__(self, work: Path, name: str, model: Path, kv_transfer_config: dict | None = None) -> None:
        super().__init__(work, name, model, env=ENGINE_ENV, watchdog_s=1200, llm={
            "max_model_len": 1024, "max_num_seqs": 4, "disable_log_stats": False,
            "kv_transfer_config": kv_transfer_config})

    def run(self, prompts: list[list[int]], max_tokens: int = 16, salts: list[str | None] | None = None) -> dict:
        """The outputs' token ids, with the connector's snapshot and metrics after the batch. The batch's saves
        and its writes to the store (or their drops) are over when it returns (`generate(flush=True)`)."""
        res = self.generate(prompts, max_tokens, logprobs=True, flush=True, salts=salts)
        return {"outputs": [o["tokens"] for o in res["outputs"]], **self.stats()}


def shared_yaml(work: Path, name: str) -> Path:
    return Path(write_lmcache_yaml(
        work / f"lmcache-{name}.yaml", base="lmcache-kvtier-redis.yaml", ssd_path=work / f"ssd-{name}",
        chunk_size=CHUNK, host_gb=f"{64 * CHUNK_BYTES / (1 << 30):.9f}", ssd_capacity_gb=0.05, redis_port=REDIS_PORT,
        replace={"    # retry_s: 5.0": f"    retry_s: {RETRY_S}", "    # timeout_s: 2.0": "    timeout_s: 1.0"}))


def kv_config(yaml_path: Path, name: str) -> dict:
    return {"kv_connector": "KVTierConnector", "kv_connector_module_path": "kvtier.connector",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute", "engine_id": f"kvtier-shared-{name}",
            "kv_connector_extra_config": {"config_file": str(yaml_path)}}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    try:
        redis_server_binary()
    except RuntimeError as e:
        pytest.skip(str(e))
    work = tmp_path_factory.mktemp("shared")
    model = Path(tiny_llama(work / "model"))
    redis = RedisServer(REDIS_PORT, work / "redis")
    engines: dict[str, Engine] = {}
    try:
        redis.start()
        engines["ref"] = Engine(work, "ref", model)
        for name in ("a", "b"):
            engines[name] = Engine(work, name, model, kv_config(shared_yaml(work, name), name))
        for e in engines.values():
            e.ready()
        yield {"redis": redis, "work": work, **engines}
    finally:
        for e in engines.values():
            e.close()
        redis.stop()


def _metric(res: dict, name: str) -> float:
    return res.get("metrics", {}).get(name, 0)


def _remote_hits(res: dict) -> float:
    return _metric(res, "kvtier_connector_hit_tokens_total/tier=remote")


def test_turns_across_engines_share_kv_through_redis(cluster):
    a, b, ref, redis = cluster["a"], cluster["b"], cluster["ref"], cluster["redis"]
    rng = random.Random(7)
    convs = [[[rng.randrange(1, 1000) for _ in range(n)] for n in (70, 40, 30)] for _ in range(4)]
    t1 = [c[0] for c in convs[:3]]

    # turn 1 on A (and on the reference engine): A writes its chunks through to Redis
    got_a, want = a.run(t1), ref.run(t1)
    assert got_a["outputs"] == want["outputs"]
    assert got_a["storage"]["shared"]["writes"] > 0 and redis.dbsize() == 2 * got_a["storage"]["shared"]["writes"]
    hist = [p + o for p, o in zip(t1, got_a["outputs"])]  # 86 tokens each: two full 32-token chunks

    # turn 2 of conversation 0 on B: its history comes from Redis (A computed it)
    p2 = hist[0] + convs[0][1]
    got_b, want = b.run([p2]), ref.run([p2])
    assert got_b["outputs"] == want["outputs"]
    assert got_b["admitted"][-1][1:] == [64, 0, 64], got_b["admitted"]  # 64 tokens loaded, all of them remote
    assert _remote_hits(got_b) == 64 and got_b["storage"]["shared"]["hits"] == 2
    assert got_b["cached_by_source"].get("external_unspecified", 0) == 64, got_b["cached_by_source"]

    # turn 3 of conversation 0 on B again: served by B's own tiers, Redis is not read at all
    gets = redis.reads()
    p3 = p2 + got_b["outputs"][0] + convs[0][2]
    got_b3, want = b.run([p3]), ref.run([p3])
    assert got_b3["outputs"] == want["outputs"]
    assert got_b3["admitted"][-1][1] >= 128 and got_b3["admitted"][-1][3] == 0, got_b3["admitted"]
    assert redis.reads() == gets, redis.commandstats()
    assert _remote_hits(got_b3) == 64

    # Redis lost: B's turn 2 of conversation 1 (history only in Redis) completes by recomputation
    redis.kill()
    p_lost = hist[1] + convs[1][1]
    got_lost = b.run([p_lost])
    b_failed_by = time.monotonic()  # B's last failed store operation was inside that run
    assert got_lost["outputs"] == ref.run([p_lost])["outputs"]
    assert got_lost["admitted"][-1][1] == 0
    sh = got_lost["storage"]["shared"]
    assert not sh["up"] and sh["health"]["outages"] == 1 and sh["health"]["errors"] >= 1, sh
    assert _remote_hits(got_lost) == 64
    assert _metric(got_lost, "kvtier_connector_load_error_blocks_total") == 0

    # Redis back (empty): A's new conversation is written again and B reads it from the store
    redis.start()
    got_a4 = a.run([convs[3][0]])
    sh = got_a4["storage"]["shared"]
    # A never saw the outage: its pooled connection, broken by the restart, was replaced on a retry
    assert sh["up"] and sh["health"]["outages"] == 0 and sh["writes"] > got_a["storage"]["shared"]["writes"], sh
    p4 = convs[3][0] + got_a4["outputs"][0] + convs[3][1]
    # B's store health lets its next operation probe once RETRY_S has passed since that failure: a timer in B's
    # process, on the same CLOCK_MONOTONIC as time.monotonic() here, so what is left of it is known exactly
    time.sleep(max(0.0, b_failed_by + RETRY_S - time.monotonic()))
    got_b4 = b.run([p4])
    assert got_b4["outputs"] == ref.run([p4])["outputs"]
    assert got_b4["admitted"][-1][1:] == [64, 0, 64], got_b4["admitted"]
    assert got_b4["storage"]["shared"]["up"] and got_b4["storage"]["shared"]["health"]["recoveries"] == 1
    assert _remote_hits(got_b4) == 128


def test_tenants_never_share_through_the_store(cluster):
    """After the store came back (the test above): tenant A's prompt on engine A goes to Redis; on engine B the same
    tokens for tenant B and without a salt load nothing (vLLM keys its cache on the salt, and so do kvtier's host,
    SSD and shared tiers), and B for tenant A loads A's chunks from the store."""
    a, b, ref = cluster["a"], cluster["b"], cluster["ref"]
    prompt = [random.Random(23).randrange(1, 1000) for _ in range(100)]  # three full chunks (96 tokens)
    got_a = a.run([prompt], salts=["tenant-A"])
    assert got_a["outputs"] == ref.run([prompt], salts=["tenant-A"])["outputs"]
    for salt in ("tenant-B", None):
        got = b.run([prompt], salts=[salt])
        assert got["outputs"] == got_a["outputs"]
        assert got["admitted"][-1][1] == 0, (salt, got["admitted"])
    remote = _remote_hits(b.stats())
    got = b.run([prompt], salts=["tenant-A"])
    assert got["outputs"] == got_a["outputs"]
    assert got["admitted"][-1][1:] == [96, 0, 96], got["admitted"]
    assert _remote_hits(got) == remote + 96
