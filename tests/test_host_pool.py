"""Host-pool exhaustion in a real LMCache engine with the kvtier plugin (`HostPoolWatch`).

A 16-chunk host pool, chunks pinned (as lookups and prefetches pin them) and SSD writes slowed down (queued
writes hold their chunks in the pool): LMCache's store then finds nothing to evict and skips chunks.

- The watch counts exactly the allocations that failed after eviction (not the ones eviction rescued), logs one
  line per episode naming `max_local_cpu_size`, and LMCache's per-attempt allocator warnings are filtered.
- The connector's store (`WorkerSide._store`, the real method over the real engine) waits for the queued SSD
  writes and retries while that frees room: every chunk ends up stored, nothing is counted lost, also for a save
  larger than the pool's free room; with the pool held by pins only,
  what still does not fit is counted in `kvtier_host_pool_lost_chunks_total`, and what the store reports as
  stored is in the host tier or on SSD.
"""

from __future__ import annotations

import logging
import threading
import time
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("lmcache", reason="needs lmcache: LMCache is not installed (kvtier[lmcache])")

from kvtier.launch.lmcache_engine import ModelShape, build_engine, destroy_engine
from kvtier.storage_backends.lmcache.backend import load_lmcache_config
from kvtier.storage_backends.lmcache.engine_access import kvtier_plugin

CHUNK = 16
SHAPE = ModelShape("kvtier-test/pool", num_layers=2, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)


def _sample(name: str, **labels: str) -> float:
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value(name, labels) or 0.0


@pytest.fixture
def engine(lmcache_yaml, monkeypatch):
    per_chunk = SHAPE.chunk_bytes(CHUNK)
    e = build_engine(load_lmcache_config(lmcache_yaml(host_gb=16 * per_chunk / (1 << 30), ssd_capacity_gb=0.05)),
                     SHAPE)
    b = kvtier_plugin(e)
    real = b.tier._write_batch
    monkeypatch.setattr(b.tier, "_write_batch", lambda batch: (time.sleep(0.02), real(batch))[1])
    monkeypatch.setattr(logging.getLogger("kvtier"), "propagate", True)  # vLLM's handler may own it: caplog
    try:
        yield e, b
    finally:
        destroy_engine(e)


def _kv(n_chunks: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 2, n_chunks * CHUNK, SHAPE.hidden, generator=g).to(SHAPE.dtype)


def _keys(e, tokens: torch.Tensor) -> list:
    return [key for _, _, key in e.token_database.process_tokens(tokens=tokens)]


def _pin_chunks(e, b, n: int, base: int) -> list:
    """Store n chunks and pin them in the host tier (what a lookup or a prefetch does)."""
    tokens = torch.arange(base, base + n * CHUNK)
    e.store(tokens, kvcaches=_kv(n, base))
    assert b.flush(30)
    keys = _keys(e, tokens)
    host = e.storage_manager.storage_backends["LocalCPUBackend"]
    assert all(host.pin(k) for k in keys)
    return keys


def test_exhaustion_counted_logged_once_and_lmcache_noise_filtered(engine, caplog):
    e, b = engine
    host = e.storage_manager.storage_backends["LocalCPUBackend"]
    _pin_chunks(e, b, 12, 0)  # 12 of 16 chunks pinned
    before = _sample("kvtier_host_pool_exhausted_total", op="store")
    caplog.set_level(logging.WARNING, logger="kvtier.storage_backends.lmcache.host_pool")
    stored = []
    for s in (1, 2):  # two stores of 8 chunks: 4 free slots, then nothing evictable
        tokens = torch.arange(s * 10_000, s * 10_000 + 8 * CHUNK)
        with b.pool_watch.scope("store") as sc:
            e.store(tokens, kvcaches=_kv(8, s))
        stored.append(sum(host.contains(k) for k in _keys(e, tokens)))
        assert sc.ok == stored[-1] and sc.failed == 1  # LMCache stops at the first chunk without room
    assert stored[0] < 8 and stored[1] < 8
    assert _sample("kvtier_host_pool_exhausted_total", op="store") - before == 2 == b.pool_watch.failures
    lines = [r for r in caplog.records if "host pool is exhausted" in r.getMessage()]
    assert len(lines) == 1 and "max_local_cpu_size" in lines[0].getMessage()  # one line for the episode
    noisy = logging.LogRecord("lmcache.v1.memory_management", logging.WARNING, "", 0,
                              "Failed to allocate memory block of size %d because no memory is available", (1,),
                              None)
    assert not logging.getLogger("lmcache.v1.memory_management").filters[0].filter(noisy)


def test_evictable_pool_is_not_exhaustion(engine):
    e, b = engine
    before = b.pool_watch.failures
    for s in range(4):  # 32 chunks through a 16-chunk pool: LRU eviction, never a failure
        e.store(torch.arange(s * 10_000, s * 10_000 + 8 * CHUNK), kvcaches=_kv(8, s))
        assert b.flush(30)
    assert b.pool_watch.failures == before == 0


def _worker(e, b, kv):
    from kvtier.connector.worker_side import WorkerSide

    # the real method over the real engine; the retry may wait as long as the queue needs (a loaded machine's
    # SSD is slow: what is tested is that it waits and retries, not how fast the disk is)
    ns = SimpleNamespace(engine=e, ssd=b, cfg=SimpleNamespace(chunk_size=CHUNK), block_size=CHUNK, kv_list=kv,
                         STORE_RETRY_WAIT_S=60.0)
    return lambda spec, n: WorkerSide._store(ns, spec, n)


def test_short_store_waits_for_queued_writes_and_retries(engine, monkeypatch):
    from kvtier.connector.messages import SaveSpec

    e, b = engine
    host = e.storage_manager.storage_backends["LocalCPUBackend"]
    _pin_chunks(e, b, 8, 0)  # half the pool pinned; queued writes hold the other half
    gate = threading.Event()  # the SSD writes wait until someone waits for them (the retry's flush)
    write, flush = b.tier._write_batch, b.flush
    monkeypatch.setattr(b.tier, "_write_batch", lambda batch: (gate.wait(60), write(batch))[1])
    monkeypatch.setattr(b, "flush", lambda timeout=None: (gate.set(), flush(timeout))[1])
    e.store(torch.arange(10_000, 10_000 + 8 * CHUNK), kvcaches=_kv(8, 1))  # 8 writes queued
    lost = _sample("kvtier_host_pool_lost_chunks_total", op="store")
    failures = b.pool_watch.failures
    tokens = list(range(20_000, 20_000 + 8 * CHUNK))
    kv = _kv(8, 2)
    end = _worker(e, b, kv)(SaveSpec("r", tokens, list(range(8)), 0), len(tokens))
    assert b.pool_watch.failures > failures, "the pool was full when the store began"
    assert end == len(tokens) and all(host.contains(k) for k in _keys(e, torch.tensor(tokens)))
    assert _sample("kvtier_host_pool_lost_chunks_total", op="store") == lost


def test_store_larger_than_the_free_room_goes_through_in_parts(engine):
    """12 of 16 chunks pinned, a 10-chunk save: 4 fit, their SSD writes free them, 4 more, then the last 2;
    every chunk is stored (on SSD), none is lost."""
    from kvtier.connector.messages import SaveSpec

    e, b = engine
    _pin_chunks(e, b, 12, 0)
    lost = _sample("kvtier_host_pool_lost_chunks_total", op="store")
    failures = b.pool_watch.failures
    tokens = list(range(30_000, 30_000 + 10 * CHUNK))
    end = _worker(e, b, _kv(10, 3))(SaveSpec("r", tokens, list(range(10)), 0), len(tokens))
    assert b.pool_watch.failures > failures, "the save did not fit at once"
    assert end == len(tokens)
    assert _sample("kvtier_host_pool_lost_chunks_total", op="store") == lost
    assert b.flush(30)
    assert all(b.tier.contains(k.to_string()) for k in _keys(e, torch.tensor(tokens)))


def test_pins_only_pool_counts_lost_chunks(engine):
    from kvtier.connector.messages import SaveSpec

    e, b = engine
    _pin_chunks(e, b, 16, 0)  # the whole pool pinned: waiting for SSD writes frees nothing
    lost = _sample("kvtier_host_pool_lost_chunks_total", op="store")
    tokens = list(range(20_000, 20_000 + 6 * CHUNK))
    end = _worker(e, b, _kv(6, 2))(SaveSpec("r", tokens, list(range(6)), 0), len(tokens))
    assert end == 0
    assert _sample("kvtier_host_pool_lost_chunks_total", op="store") - lost == (len(tokens) - end) // CHUNK
    # what the store reports as stored is there: in the host tier, or on SSD (written through, then evicted)
    host = e.storage_manager.storage_backends["LocalCPUBackend"]
    assert b.flush(30)
    for k in _keys(e, torch.tensor(tokens[:end])):
        assert host.contains(k) or b.tier.contains(k.to_string())
