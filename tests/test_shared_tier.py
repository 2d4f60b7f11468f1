"""kvtier's shared tier over a real Redis server (`testing/redis_server.py`) and real in-process LMCache engines
(LMCache's own remote backend, kvtier's SSD plugin): keys, layout checks, local-first order, store faults."""

from __future__ import annotations

import logging
import threading

import pytest
import torch

pytest.importorskip("redis")

from kvtier.storage_backends.config import ConfigError  # noqa: E402
from kvtier.storage_backends.shared.config import SharedTierOptions  # noqa: E402
from kvtier.storage_backends.shared.tier import (  # noqa: E402
    arrange_local_first,
    attach_shared_tier,
)
from kvtier.testing.engine_factory import TINY as SHAPE  # noqa: E402
from kvtier.testing.engine_factory import ModelShape, kvtier_backend, random_kv  # noqa: E402
from kvtier.testing.redis_server import RedisServer, redis_server_binary  # noqa: E402
from kvtier.testing.waiting import wait_until  # noqa: E402

CHUNK = 16
PORT = 16321


def kv_for(tokens: int, seed: int = 0) -> torch.Tensor:
    return random_kv(SHAPE, tokens, seed)


@pytest.fixture
def redis_server(tmp_path):
    try:
        redis_server_binary()
    except RuntimeError as e:
        pytest.skip(str(e))
    server = RedisServer(PORT, tmp_path / "redis")
    try:
        server.start()
        yield server
    finally:
        server.stop()


@pytest.fixture
def engines(tmp_path, lmcache_yaml, lmcache_engines):
    """Factory: an engine from the shipped configs/lmcache-kvtier-redis.yaml (its own SSD directory)."""
    made = []

    def make(shape: ModelShape = SHAPE):
        made.append(None)
        return lmcache_engines(lmcache_yaml(CHUNK, 0.05, base="lmcache-kvtier-redis.yaml", redis_port=PORT,
                                            ssd=tmp_path / f"ssd{len(made) - 1}"), shape)

    return make


def keys_of(engine, tokens):
    return [k for _, _, k in engine.token_database.process_tokens(tokens=tokens)]


def shared(engine, layout_ok=lambda meta: True, tag="t1", **opts):
    return attach_shared_tier(engine, layout_ok, tag, SharedTierOptions(**{"timeout_s": 1.0, "retry_s": 0.2,
                                                                          **opts}))


def skip_retry_wait(monkeypatch, tier) -> None:
    """Move the tier's store-health clock (`StoreHealth.clock`, injectable for tests) on by its `retry_s`: the
    retry window since the last failure is over, so the next operation probes the store (no sleep through it)."""
    health = tier.health
    real = health.clock
    monkeypatch.setattr(health, "clock", lambda: real() + health.retry_s)


def test_chunks_written_by_one_engine_are_read_bit_exact_by_another(redis_server, engines):
    a, b = engines(), engines()
    sa, sb = shared(a), shared(b)
    try:
        tokens = torch.arange(64)
        kv = kv_for(64, seed=1)
        a.store(tokens, kvcaches=kv)
        keys = keys_of(a, tokens)
        assert sa.submit_writes(keys) == 4 and sa.flush(10)
        assert sa.stats.writes == 4 and redis_server.dbsize() == 8  # LMCache's Redis keys: metadata + data
        assert sb.prefix_contains(keys) == 4
        objs = sb.read(keys)
        assert all(o is not None for o in objs)
        want = a.storage_manager.storage_backends["LocalCPUBackend"]
        for k, o in zip(keys, objs):
            mine = want.get_blocking(k)
            assert torch.equal(o.tensor.view(torch.int16), mine.tensor.view(torch.int16))
            mine.ref_count_down()
            o.ref_count_down()
        assert sb.stats.hits == 4
        # a second write of the same chunks is not sent again
        assert sa.submit_writes(keys) == 0
    finally:
        sa.close()
        sb.close()


def test_other_model_or_layout_never_reads_the_chunks(redis_server, engines):
    a = engines()
    sa = shared(a, tag="pf16.c16")
    other_model = engines(ModelShape("kvtier-test/other", 2, 2, 16, torch.bfloat16))
    so = shared(other_model, tag="pf16.c16")
    other_layout = engines()
    sl = shared(other_layout, tag="pf32.c16")
    strict = engines()
    ss = shared(strict, layout_ok=lambda meta: False, tag="pf16.c16")
    try:
        tokens = torch.arange(48)
        a.store(tokens, kvcaches=kv_for(48))
        assert sa.submit_writes(keys_of(a, tokens)) == 3 and sa.flush(10)
        assert so.prefix_contains(keys_of(other_model, tokens)) == 0  # LMCache's key names the model
        assert sl.prefix_contains(keys_of(other_layout, tokens)) == 0  # kvtier's tag names the layout
        assert sl.read(keys_of(other_layout, tokens)) == [None] * 3
        # same key, but the chunk does not fit this engine's layout: a counted miss, never handed out
        assert ss.prefix_contains(keys_of(strict, tokens)) == 3
        assert ss.read(keys_of(strict, tokens)) == [None] * 3
        assert ss.stats.layout_mismatch == 1 and ss.stats.hits == 0
    finally:
        for s in (sa, so, sl, ss):
            s.close()


def test_local_ssd_tier_is_read_before_the_store(redis_server, engines):
    """An engine that kvtier's connector does not build (LMCache's own remote backend, no SharedTier): LMCache
    writes every chunk to both the SSD tier and Redis. In LMCache's fixed order its retrieve reads them from
    Redis; after `arrange_local_first` the SSD tier serves them and Redis counts no GET."""
    e = engines()
    ssd = kvtier_backend(e)
    tokens = torch.arange(96)
    kv = kv_for(96, seed=2)
    e.store(tokens, kvcaches=kv)
    assert ssd.flush(30)
    # LMCache's remote puts are asynchronous: 6 chunks, metadata + data keys each
    wait_until(lambda: redis_server.dbsize() >= 12, 10, lambda: f"12 keys in Redis ({redis_server.dbsize()})")
    assert redis_server.dbsize() == 12
    host = e.storage_manager.storage_backends["LocalCPUBackend"]

    def retrieve() -> int:
        host.clear()
        redis_server.reset_stats()
        out = torch.zeros_like(kv)
        assert int(e.retrieve(tokens, kvcaches=out).sum()) == 96
        assert torch.equal(out.view(torch.int16), kv.view(torch.int16))
        return redis_server.reads()

    assert retrieve() > 0 and ssd.tier.stats.hits == 0  # LMCache's own order: the network first
    assert arrange_local_first(e) and not arrange_local_first(e)
    assert retrieve() == 0, redis_server.commandstats()
    assert ssd.tier.stats.hits == 6


def test_store_down_at_start_fails_clearly_or_degrades(tmp_path, engines, caplog, monkeypatch):
    try:
        redis_server_binary()
    except RuntimeError as e:
        pytest.skip(str(e))
    e = engines()
    with pytest.raises(ConfigError, match=r"does not answer at start.*remote_url.*on_unavailable: degrade"):
        shared(e)
    e2 = engines()
    s = shared(e2, on_unavailable="degrade")
    server = RedisServer(PORT, tmp_path / "redis")
    try:
        assert not s.up and s.health.counters.outages == 1
        assert s.prefix_contains(keys_of(e2, torch.arange(32))) == 0
        server.start()
        skip_retry_wait(monkeypatch, s)
        assert s.prefix_contains(keys_of(e2, torch.arange(32))) == 0 and s.up  # the probe found it back
        assert s.health.counters.recoveries == 1
    finally:
        s.close()
        server.stop()


def test_store_lost_mid_run_is_a_logged_counted_miss_and_used_again_once_back(redis_server, engines, caplog,
                                                                                 monkeypatch):
    a, b = engines(), engines()
    sa, sb = shared(a), shared(b)
    try:
        tokens = torch.arange(64)
        a.store(tokens, kvcaches=kv_for(64))
        keys = keys_of(b, tokens)
        assert sa.submit_writes(keys_of(a, tokens)) == 4 and sa.flush(10)
        redis_server.kill()
        with caplog.at_level(logging.WARNING, logger="kvtier.storage_backends.shared.health"):
            assert sb.read(keys) == [None] * 4
            assert not sb.up
            skipped = sb.health.counters.skipped
            for _ in range(20):  # while down: misses without asking the store (at most one probe), no new log line
                assert sb.prefix_contains(keys) == 0
            assert sb.health.counters.skipped >= skipped + 19
        lost = [r for r in caplog.records if "unreachable" in r.getMessage()]
        assert len(lost) == 1 and "redis://127.0.0.1" in lost[0].getMessage()
        assert sb.health.counters.outages == 1 and sb.health.counters.skipped > 0
        # writes while the store is down are dropped (counted), never queued on host memory
        b.store(tokens, kvcaches=kv_for(64))
        assert sb.submit_writes(keys) == 0 and sb.stats.dropped_writes == 4
        redis_server.start()  # empty: it kept nothing
        skip_retry_wait(monkeypatch, sb)
        assert sb.prefix_contains(keys) == 0 and sb.up and sb.health.counters.recoveries == 1
        assert sb.submit_writes(keys) == 4 and sb.flush(10)
        # A's pooled connection died with the old server: retried once on a new one, it finds B's chunks at once
        assert sa.prefix_contains(keys_of(a, tokens)) == 4 and sa.up and sa.health.counters.outages == 0
    finally:
        sa.close()
        sb.close()


def test_writes_beyond_the_queue_bound_are_dropped_counted_and_logged_once_per_episode(redis_server, engines,
                                                                                          caplog, monkeypatch):
    a = engines()
    sa = shared(a, max_queued_write_mb=1)
    gate = threading.Event()
    write_batch = sa._write_batch
    monkeypatch.setattr(sa, "_write_batch", lambda batch: (gate.wait(30), write_batch(batch)))  # a stalled store
    try:
        tokens = torch.arange(320 * CHUNK)
        a.store(tokens, kvcaches=kv_for(len(tokens)))
        keys = keys_of(a, tokens)
        obj = sa.host.get_blocking(keys[0])
        size = obj.get_size()
        obj.ref_count_down()
        room = (1 << 20) // size
        assert room < 300
        log = "kvtier.storage_backends.shared.tier"
        with caplog.at_level(logging.INFO, logger=log):
            assert sa.submit_writes(keys[:150]) == min(150, room)
            assert sa.submit_writes(keys[150:300]) == room - min(150, room)
            assert sa.stats.dropped_writes == 300 - room  # every dropped chunk counted ...
            behind = [r for r in caplog.records if r.name == log and "fall behind" in r.getMessage()]
            assert len(behind) == 1 and "max_queued_write_mb" in behind[0].getMessage()  # ... logged once
            gate.set()
            assert sa.flush(30) and sa.stats.writes == room
            assert sa.submit_writes(keys[300:]) == 20 and sa.flush(30)  # room again: the episode ends
            again = [r for r in caplog.records if r.name == log and "queued again" in r.getMessage()]
            assert len(again) == 1
    finally:
        gate.set()
        sa.close()
