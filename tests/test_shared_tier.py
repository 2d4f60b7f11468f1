"""kvtier's shared tier over a real Redis server (`launch/redis_server.py`) and real in-process LMCache engines
(LMCache's own remote backend, kvtier's SSD plugin): keys, layout checks, local-first order, store faults."""

from __future__ import annotations

import logging
import threading

import pytest
import torch

pytest.importorskip("redis")

from kvtier.storage_backends.config import ConfigError  # noqa: E402
from kvtier.storage_backends.lmcache import backend_order as order_module  # noqa: E402
from kvtier.storage_backends.lmcache.backend_order import LocalFirstOrder, arrange_local_first  # noqa: E402
from kvtier.storage_backends.shared.config import SharedTierOptions  # noqa: E402
from kvtier.storage_backends.shared.tier import attach_shared_tier, detach_remote_backends  # noqa: E402

pytest.importorskip("lmcache", reason="needs lmcache: LMCache is not installed (kvtier[lmcache])")

from kvtier.launch.lmcache_engine import ModelShape, build_engine, destroy_engine
from kvtier.launch.redis_server import READ_COMMANDS, RedisServer, redis_server_binary  # noqa: E402
from kvtier.storage_backends.lmcache.backend import load_lmcache_config
from kvtier.storage_backends.lmcache.engine_access import kvtier_plugin
from kvtier.testing.engine_factory import TINY as SHAPE  # noqa: E402
from kvtier.testing.engine_factory import random_kv
from kvtier.testing.serve_process import lane_port  # noqa: E402
from kvtier.testing.waiting import wait_until  # noqa: E402

CHUNK = 16
PORT = lane_port(16321)


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


def test_sealed_chunks_travel_as_envelopes_and_open_only_with_the_secret(redis_server, engines, tmp_path):
    """`kvtier.encryption_key_file`: the store holds envelopes (no chunk byte in the clear), another engine with
    the same secret reads the chunks bit-exact, an engine with another secret or none finds none of them, and an
    envelope copied under another chunk's key fails to open (a counted miss)."""
    import os

    from kvtier.identity.request import tenant_of_key
    from kvtier.storage_backends.ssd.sealing import ChunkSealer

    def sealer(name: str) -> ChunkSealer:
        p = tmp_path / name
        if not p.exists():
            p.write_bytes(os.urandom(32))
        return ChunkSealer(p.read_bytes(), tenant_of_key)

    a, b, c, d = engines(), engines(), engines(), engines()
    tag = "pf16.c16"
    sa, sb = (attach_shared_tier(e, lambda m: True, tag, SharedTierOptions(timeout_s=1.0), sealer("one"))
              for e in (a, b))
    sc = attach_shared_tier(c, lambda m: True, tag, SharedTierOptions(timeout_s=1.0), sealer("two"))
    sd = shared(d, tag=tag)
    try:
        tokens = torch.arange(64)
        kv = kv_for(64, seed=4)
        a.store(tokens, kvcaches=kv)
        keys = keys_of(a, tokens)
        assert sa.submit_writes(keys) == 4 and sa.flush(10) and sa.stats.writes == 4
        host = a.storage_manager.storage_backends["LocalCPUBackend"]
        plain = []
        for k in keys:
            o = host.get_blocking(k)
            plain.append(bytes(memoryview(o.byte_array).cast("B")))
            o.ref_count_down()
        stored = [redis_server.client().get(k) for k in redis_server.client().keys("*kv_bytes")]
        assert len(stored) == 4 and all(v.startswith(b"KVTSEAL1") for v in stored)
        assert not any(p[1000:1064] in v for p in plain for v in stored)
        objs = sb.read(keys)
        assert all(o is not None for o in objs)
        for p, o in zip(plain, objs):
            assert bytes(memoryview(o.byte_array).cast("B"))[:len(p)] == p
            o.ref_count_down()
        assert sc.prefix_contains(keys_of(c, tokens)) == 0 and sd.prefix_contains(keys_of(d, tokens)) == 0
        # chunk 1's envelope put under chunk 0's key: authenticated with its own key, it does not open
        r = redis_server.client()
        k0, k1 = (sb.remote_key(k).to_string() for k in keys[:2])
        r.set(k0 + "kv_bytes", r.get(k1 + "kv_bytes"))
        assert sb.read(keys[:1]) == [None] and sb.stats.bad_chunks == 1
    finally:
        for s in (sa, sb, sc, sd):
            s.close()


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


def backend_order(engine) -> list[str]:
    return [type(b).__name__ for b in engine.storage_manager.storage_backends.values()]


def store_everywhere(engine, redis_server, tokens: torch.Tensor, kv: torch.Tensor) -> None:
    """Store through LMCache (write-through: host tier, kvtier's SSD tier and Redis), wait until the SSD tier and
    Redis (metadata + data key per chunk; LMCache's remote puts are asynchronous) hold every chunk."""
    chunks = len(tokens) // CHUNK
    engine.store(tokens, kvcaches=kv)
    assert kvtier_plugin(engine).flush(60)
    wait_until(lambda: redis_server.dbsize() >= 2 * chunks, 30,
               lambda: f"{2 * chunks} keys in Redis ({redis_server.dbsize()})")


def retrieve_without_host_copies(engine, redis_server, tokens: torch.Tensor, kv: torch.Tensor) -> tuple[int, int]:
    """Drop the host tier's copies (only the SSD tier and Redis hold the chunks), retrieve through LMCache's own
    walk and check the KV bit for bit; returns (value reads, bytes) Redis sent during the retrieve (its own INFO
    counters, read over one connection, so the count holds little more than the retrieve's traffic)."""
    host = engine.storage_manager.storage_backends["LocalCPUBackend"]
    keys = keys_of(engine, tokens)
    # a chunk still referenced by an unfinished remote put is not dropped yet: clear until none is left
    wait_until(lambda: host.clear() >= 0 and not any(host.contains(k) for k in keys), 30,
               "the host tier's copies dropped")
    client = redis_server.client()
    client.config_resetstat()
    out = torch.zeros_like(kv)
    assert int(engine.retrieve(tokens, kvcaches=out).sum()) == len(tokens)
    assert torch.equal(out.view(torch.int16), kv.view(torch.int16))
    sent = int(client.info("stats")["total_net_output_bytes"])
    calls = {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in client.info("commandstats").items()}
    return sum(n for cmd, n in calls.items() if cmd in READ_COMMANDS), sent


@pytest.mark.compat  # LMCache's backend order and plugin loading: checked in every combination
@pytest.mark.parametrize("when", ["at_start", "at_first_call"])
def test_lmcache_own_engine_reads_the_local_ssd_tier_before_the_store(redis_server, engines, monkeypatch, when):
    """Issue #28 bug 7. An engine built the way vLLM's LMCacheConnectorV1 builds it (LMCacheEngineBuilder from the
    shipped lmcache-kvtier-redis.yaml; no kvtier connector, no SharedTier, no call to `arrange_local_first`): LMCache
    builds the remote backend before the kvtier plugin and walks its backends in that order. The plugin moves
    itself ahead of it, right after the engine is built (`at_start`) or, that disabled, at its first call
    (`at_first_call`), so with the host copies dropped the SSD tier serves every chunk, bit-exact, and Redis sends
    lookup-sized bytes at most, never a chunk."""
    if when == "at_first_call":
        monkeypatch.setattr(LocalFirstOrder, "start", lambda self, loop: None)
    e = engines()
    ssd = kvtier_plugin(e)
    if when == "at_start":
        wait_until(lambda: ssd.local_first.done, 10, lambda: f"the plugin's order settled ({backend_order(e)})")
        assert backend_order(e) == ["LocalCPUBackend", "KVTierBackend", "RemoteBackend"]
    else:
        assert backend_order(e) == ["LocalCPUBackend", "RemoteBackend", "KVTierBackend"]  # LMCache's own order
        walk = iter(e.storage_manager.storage_backends.items())  # a walk of LMCache's under way ...
        next(walk)
    tokens = torch.arange(256 * CHUNK)
    kv = kv_for(len(tokens), seed=2)
    store_everywhere(e, redis_server, tokens, kv)
    if when == "at_first_call":
        assert [type(b).__name__ for _, b in walk] == ["RemoteBackend", "KVTierBackend"]  # ... ends unharmed
    assert backend_order(e) == ["LocalCPUBackend", "KVTierBackend", "RemoteBackend"] and ssd.local_first.arranged
    hits = ssd.tier.stats.hits
    reads, sent = retrieve_without_host_copies(e, redis_server, tokens, kv)
    assert reads == 0, redis_server.commandstats()
    assert sent < SHAPE.chunk_bytes(CHUNK), f"Redis sent {sent} bytes: more than lookups"
    assert ssd.tier.stats.hits - hits == 256


@pytest.mark.compat
def test_a_restarted_engine_reads_its_ssd_tier_before_the_store_from_its_first_lookup(redis_server, tmp_path,
                                                                                         lmcache_yaml):
    """A restarted engine whose SSD tier still holds every chunk (and so does Redis): its very first operation is a
    retrieve, whose lookup LMCache would end at Redis (it holds every chunk) without ever calling the plugin. The
    plugin arranged the order right after the engine was built, so the SSD tier serves it and Redis sends no chunk."""
    path = lmcache_yaml(CHUNK, 0.05, base="lmcache-kvtier-redis.yaml", redis_port=PORT, ssd=tmp_path / "ssd")
    tokens = torch.arange(64 * CHUNK)
    kv = kv_for(len(tokens), seed=3)
    first = build_engine(load_lmcache_config(path), SHAPE)
    try:
        store_everywhere(first, redis_server, tokens, kv)
    finally:
        detach_remote_backends(first)
        destroy_engine(first)
    again = build_engine(load_lmcache_config(path), SHAPE)
    try:
        ssd = kvtier_plugin(again)
        wait_until(lambda: ssd.local_first.done, 10, lambda: f"the plugin's order settled ({backend_order(again)})")
        assert ssd.local_first.arranged
        reads, sent = retrieve_without_host_copies(again, redis_server, tokens, kv)
        assert reads == 0, redis_server.commandstats()
        assert sent < SHAPE.chunk_bytes(CHUNK), f"Redis sent {sent} bytes: more than lookups"
        assert ssd.tier.stats.hits == 64
    finally:
        detach_remote_backends(again)
        destroy_engine(again)


def test_a_plugin_that_cannot_find_its_engine_says_so_once_and_arrange_local_first_fixes_it(redis_server, engines,
                                                                                             monkeypatch, caplog):
    """An engine LMCache's builder did not make: the plugin cannot reach its StorageManager. It says so once, as a
    WARNING naming the fix (never a silent fallback), and `arrange_local_first(engine)` is that fix."""
    monkeypatch.setattr(LocalFirstOrder, "start", lambda self, loop: None)
    monkeypatch.setattr(order_module, "owning_storage_manager", lambda backend: None)
    e = engines()
    tokens = torch.arange(16 * CHUNK)
    kv = kv_for(len(tokens), seed=4)
    with caplog.at_level(logging.WARNING, logger="kvtier.storage_backends.shared.tier"):
        store_everywhere(e, redis_server, tokens, kv)
        reads, _ = retrieve_without_host_copies(e, redis_server, tokens, kv)
    said = [r for r in caplog.records if "arrange_local_first(engine)" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.WARNING
    assert reads > 0  # LMCache's own order: the network first
    assert arrange_local_first(e) and not arrange_local_first(e)
    assert backend_order(e) == ["LocalCPUBackend", "KVTierBackend", "RemoteBackend"]
    reads, _ = retrieve_without_host_copies(e, redis_server, tokens, kv)
    assert reads == 0, redis_server.commandstats()


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
