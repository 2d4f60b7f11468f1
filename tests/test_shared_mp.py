"""The shared tier in LMCache's multiprocess mode: two real `lmcache server` processes (two "machines"), each with
kvtier's L2 adapter first and LMCache's `resp` adapter (the shipped configs/lmcache-mp-l2-redis.json) second, over
one real Redis server; driven by LMCache's own MP client (seeded KV, checked by checksums).

- a sequence stored through server A is fetched bit-exact through server B, whose own SSD tier is empty: B's L2
  lookups reach Redis (its GET counter moves);
- fetched again through A once A's L1 is cleared: A's kvtier adapter (listed first) serves it and Redis sees no GET.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
pytest.importorskip("redis")

from kvtier.launch.lmcache_server import MPServer, kvtier_adapter_spec  # noqa: E402
from kvtier.launch.redis_server import RedisServer, redis_server_binary  # noqa: E402
from kvtier.testing.lmcache_mp import BenchClient  # noqa: E402
from kvtier.testing.serve_process import lane_port  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
REDIS_PORT = lane_port(16331)


def redis_spec(port: int) -> dict:
    spec = json.loads((REPO / "configs" / "lmcache-mp-l2-redis.json").read_text())
    return dict(spec, port=port, num_workers=2)


def test_mp_servers_share_through_redis_local_first(tmp_path):
    try:
        redis_server_binary()
    except RuntimeError as e:
        pytest.skip(str(e))
    with RedisServer(REDIS_PORT, tmp_path / "redis") as redis:
        specs = {n: [kvtier_adapter_spec(tmp_path / f"ssd-{n}", 0.05), redis_spec(REDIS_PORT)] for n in "ab"}
        with MPServer(lane_port(16332), lane_port(18332), specs["a"], str(tmp_path / "a.log"), l1_gb=16 / 1024) as a, \
                MPServer(lane_port(16333), lane_port(18333), specs["b"], str(tmp_path / "b.log"), l1_gb=16 / 1024) as b:
            ca = BenchClient(a)
            try:
                assert ca.store(1) == (0, True)
                a.wait_l2_idle(index=0)
                a.wait_l2_idle(index=1)
                assert redis.dbsize() > 0, a.log_tail()
            finally:
                ca.close()
            cb = BenchClient(b)
            try:
                gets = redis.reads()
                hit, total, exact = cb.fetch(1)
                assert (hit, exact) == (total, True) and total > 0
                assert redis.reads() > gets  # B's chunks came from Redis: its own kvtier adapter had none
                assert b.l2_status(0)["stats"]["hits"] == 0
            finally:
                cb.close()
            a.clear_l1()
            ca = BenchClient(a)
            try:
                gets = redis.reads()
                hit, total, exact = ca.fetch(1)
                assert (hit, exact) == (total, True)
                assert a.l2_status(0)["stats"]["hits"] == total
                assert redis.reads() == gets, redis.commandstats()  # local first: Redis not read
            finally:
                ca.close()
