"""kvtier as an LMCache storage plugin, driven through a real LMCacheEngine built from the shipped YAML."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading

import pytest

pytestmark = pytest.mark.compat
import torch

pytest.importorskip("lmcache", reason="needs lmcache: LMCache is not installed (kvtier[lmcache])")

from kvtier.launch.lmcache_engine import ModelShape, build_engine, destroy_engine
from kvtier.storage_backends.lmcache.backend import load_lmcache_config
from kvtier.storage_backends.lmcache.engine_access import kvtier_plugin
from kvtier.testing.engine_factory import TINY as SHAPE
from kvtier.testing.engine_factory import random_kv

CHUNK = 16
#: a wider model, 128 KiB chunks: the host-pool tests count in chunks of it
WIDE = ModelShape("kvtier-test/wide", num_layers=2, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)


def kv_for(tokens: int, seed: int = 0) -> torch.Tensor:
    return random_kv(SHAPE, tokens, seed)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


def clear_host(engine) -> None:
    engine.storage_manager.storage_backends["LocalCPUBackend"].clear()


@pytest.fixture
def engine_from(lmcache_yaml, lmcache_engines):
    """Factory: an engine of the tiny model from the shipped YAML (`lmcache_yaml`'s keywords; `post_init`)."""

    def make(**kw):
        post = kw.pop("post_init", {})
        return lmcache_engines(lmcache_yaml(**kw), **post)

    return make


def test_plugin_is_loaded_from_the_yaml(engine_from):
    b = kvtier_plugin(engine_from())
    assert b is not None and b.tier is not None, "LMCache did not load kvtier (its error is only logged)"


def test_round_trip_served_by_plugin_after_host_tier_cleared(engine_from):
    e = engine_from()
    b = kvtier_plugin(e)
    tokens = torch.arange(100)
    kv = kv_for(100)
    e.store(tokens, kvcaches=kv)
    assert b.flush(30)
    assert b.tier.stats.committed == 6  # 100 tokens: six 16-token chunks + a partial one (not saved by LMCache)
    clear_host(e)
    out = torch.zeros_like(kv)
    got = int(e.retrieve(tokens, kvcaches=out).sum())
    assert got == 96
    assert same_bits(out[:, :, :96], kv[:, :, :96])
    assert b.tier.stats.hits == 6 and b.tier.stats.misses == 0


def test_inclusive_with_host_tier(engine_from):
    """The SSD keeps a copy of what is in host memory: every stored chunk is in both tiers."""
    e = engine_from()
    b = kvtier_plugin(e)
    tokens = torch.arange(64)
    e.store(tokens, kvcaches=kv_for(64))
    assert b.flush(30)
    keys = [k for _, _, k in e.token_database.process_tokens(tokens=tokens)]
    host = e.storage_manager.storage_backends["LocalCPUBackend"]
    assert all(host.contains(k) for k in keys) and all(b.contains(k) for k in keys)


def test_corrupt_chunk_is_recomputed_not_returned(engine_from):
    e = engine_from()
    b = kvtier_plugin(e)
    tokens = torch.arange(64)
    kv = kv_for(64, seed=3)
    e.store(tokens, kvcaches=kv)
    assert b.flush(30)
    keys = [k.to_string() for _, _, k in e.token_database.process_tokens(tokens=tokens)]
    entry = b.tier.entry(keys[2])
    path, base = b.tier.io.files.locate_path(entry.slot)
    with open(path, "r+b") as f:  # flip one bit of chunk 2's data
        f.seek(base + 4096 + 10)
        byte = f.read(1)[0]
        f.seek(base + 4096 + 10)
        f.write(bytes([byte ^ 0x80]))
    clear_host(e)
    out = torch.zeros_like(kv)
    got = int(e.retrieve(tokens, kvcaches=out).sum())
    assert got <= 32  # only the prefix before the corrupt chunk may be served
    assert same_bits(out[:, :, :got], kv[:, :, :got])
    assert b.tier.stats.corrupt == 1 and not b.tier.contains(keys[2])


STORE_SCRIPT = textwrap.dedent("""
    import sys, torch
    sys.argv = sys.argv
    from kvtier.launch.lmcache_engine import build_engine, destroy_engine
    from kvtier.storage_backends.lmcache.backend import load_lmcache_config
    from kvtier.storage_backends.lmcache.engine_access import kvtier_plugin
    from kvtier.testing.engine_factory import TINY, random_kv
    e = build_engine(load_lmcache_config(sys.argv[1]), TINY)
    kv = random_kv(TINY, 160, seed=11)
    e.store(torch.arange(1000, 1160), kvcaches=kv)
    assert kvtier_plugin(e).flush(30)
    destroy_engine(e)
    print("stored", flush=True)
""")


def test_new_process_finds_previous_process_chunks(engine_from, lmcache_yaml):
    cfg_path = lmcache_yaml()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    res = subprocess.run([sys.executable, "-c", STORE_SCRIPT, cfg_path], capture_output=True, text=True, env=env,
                         timeout=300)
    assert "stored" in res.stdout, res.stderr[-3000:]
    e = engine_from()  # this (other) process, same YAML: sha256_cbor keys are restart-stable
    b = kvtier_plugin(e)
    assert len(b.tier) == 10
    tokens = torch.arange(1000, 1160)
    assert e.lookup(tokens) == 160
    out = torch.zeros(2, 2, 160, 32, dtype=torch.bfloat16)
    assert int(e.retrieve(tokens, kvcaches=out).sum()) == 160
    assert same_bits(out, kv_for(160, seed=11))
    assert b.tier.stats.hits == 10


class _LookupServer:
    """Stands in for LMCache's ZMQ lookup server: records the scheduler-bound answer of a prefetch."""

    def __init__(self):
        self.answers: dict[str, int] = {}
        self.event = threading.Event()

    def send_response_to_scheduler(self, lookup_id, retrieved_length):
        self.answers[lookup_id] = retrieved_length
        self.event.set()


def test_async_loading_path(lmcache_yaml):
    server = _LookupServer()
    cfg = load_lmcache_config(lmcache_yaml(lmcache_lines="enable_async_loading: true\n"))
    e = build_engine(cfg, SHAPE, async_lookup_server=server)
    try:
        b = kvtier_plugin(e)
        tokens = torch.arange(500, 580)
        kv = kv_for(80, seed=5)
        e.store(tokens, kvcaches=kv)
        assert b.flush(30)
        clear_host(e)
        e.async_lookup_and_prefetch("req-1", tokens, pin=True)
        assert server.event.wait(30)
        assert server.answers["req-1"] == 80
        out = torch.zeros_like(kv)
        got = int(e.retrieve(tokens, kvcaches=out, req_id="req-1").sum())
        assert got == 80 and same_bits(out, kv)
        assert b.tier.stats.hits == 5
        assert not any(b.tier.is_pinned(k) for k in b.tier.keys())  # lookup pins released by the plugin
    finally:
        destroy_engine(e)


def test_slow_ssd_applies_backpressure_instead_of_dropping(lmcache_yaml, monkeypatch):
    """64 chunks through a host pool of 24 while SSD writes lag: none is lost on the way to the SSD tier."""
    import time

    per_chunk = WIDE.chunk_bytes(CHUNK)  # 128 KiB
    # A generous drain timeout: on a loaded CI machine 10 s can pass without a drop being wrong; what this test
    # checks is that a lagging SSD makes stores wait, not drop. The host pool has room for the 8 queued chunks
    # (1 MiB) plus a whole 8-chunk store with slack. (At exactly 16 chunks a store sometimes lost its last chunk:
    # the writers gave queue room back before releasing the written chunks' buffers; see
    # test_queue_room_comes_back_only_after_written_chunks_are_released.)
    cfg = load_lmcache_config(lmcache_yaml(host_gb=24 * per_chunk / (1 << 30), max_inflight_write_mb=1,
                                           ssd_capacity_gb=0.05, backpressure_timeout_s=300))
    e = build_engine(cfg, WIDE)
    try:
        b = kvtier_plugin(e)
        real = b.tier._write_batch
        monkeypatch.setattr(b.tier, "_write_batch", lambda batch: (time.sleep(0.02), real(batch))[1])
        g = torch.Generator().manual_seed(9)
        for s in range(8):  # eight requests of 8 chunks each
            tokens = torch.arange(s * 10_000, s * 10_000 + 8 * CHUNK)
            kv = torch.randn(2, 2, 8 * CHUNK, WIDE.hidden, generator=g).to(WIDE.dtype)
            e.store(tokens, kvcaches=kv)
        assert b.flush(60)
        st = b.tier.stats
        assert st.committed + st.dropped_backpressure == 64
        assert st.committed == 64, st.as_dict()
    finally:
        destroy_engine(e)


def _six_stores_while_the_ssd_lags(lmcache_yaml, monkeypatch, pause_after_done_s: float = 0.0):
    """Six stores of 8 WIDE chunks through a host pool of 16 (the default queue cap: half of it) while every SSD
    write batch takes 50 ms more; `pause_after_done_s` also stalls a writer right after the queue took its batch
    back (as a loaded machine may). Returns the tier's stats once everything is flushed."""
    import time

    per_chunk = WIDE.chunk_bytes(CHUNK)
    e = build_engine(load_lmcache_config(lmcache_yaml(host_gb=16 * per_chunk / (1 << 30), ssd_capacity_gb=0.05)),
                     WIDE)
    try:
        b = kvtier_plugin(e)
        assert b.tier.max_inflight_bytes == 8 * per_chunk
        real = b.tier._write_batch
        monkeypatch.setattr(b.tier, "_write_batch", lambda batch: (time.sleep(0.05), real(batch))[1])
        if pause_after_done_s:
            done = b.tier.queue.done
            monkeypatch.setattr(b.tier.queue, "done", lambda batch: (done(batch), time.sleep(pause_after_done_s)))
        g = torch.Generator().manual_seed(5)
        for s in range(6):  # six requests of 8 chunks: three pools' worth while the SSD lags
            tokens = torch.arange(s * 10_000, s * 10_000 + 8 * CHUNK)
            kv = torch.randn(2, 2, 8 * CHUNK, WIDE.hidden, generator=g).to(WIDE.dtype)
            e.store(tokens, kvcaches=kv)
        assert b.flush(60)
        return b.tier.stats
    finally:
        destroy_engine(e)


def test_default_queue_cap_leaves_lmcache_room_for_the_next_store(lmcache_yaml, monkeypatch):
    """With the default max_inflight_write_mb (2 GiB, far above this 16-chunk host pool) the queued writes would
    hold the whole pool and LMCache would skip later stores before the plugin sees them. The plugin caps the
    queue at half the pool, so every chunk of every store reaches the SSD tier."""
    stats = _six_stores_while_the_ssd_lags(lmcache_yaml, monkeypatch)
    assert stats.committed == 48, stats.as_dict()


def test_queue_room_comes_back_only_after_written_chunks_are_released(lmcache_yaml, monkeypatch):
    """The queue's bound holds only if a written chunk's host buffer is released (its completion callback)
    before its bytes leave the queue: otherwise a waiting store gets in, and LMCache allocates the next one,
    while the written batch still holds its buffers. A writer stalled at that point (here 0.2 s; a loaded
    machine's scheduler did it now and then) must not cost a chunk."""
    stats = _six_stores_while_the_ssd_lags(lmcache_yaml, monkeypatch, pause_after_done_s=0.2)
    assert stats.committed == 48, stats.as_dict()


def test_unknown_key_fails_plugin_construction_loudly_in_check_config(lmcache_yaml):
    from kvtier.cli.check_config import check
    from kvtier.storage_backends.config import ConfigError

    with pytest.raises(ConfigError, match="did you mean kvtier.io_threads"):
        check(lmcache_yaml(io_thread=4))
    with pytest.raises(ConfigError, match="io_threads must be an integer"):
        check(lmcache_yaml(io_threads="many"))
    with pytest.raises(ConfigError, match="kvtier.chunk_format: 'KV_2LDT' is neither.*did you mean KV_2LTD"):
        check(lmcache_yaml(chunk_format="KV_2LDT"))
    assert check(lmcache_yaml(chunk_format="page_first")).startswith("OK")
    assert check(lmcache_yaml()).startswith("OK")


def test_check_config_command_fails_loudly(lmcache_yaml, tmp_path):
    """The console script users are told to run: exit 1 and a message naming the key, for each kind of mistake."""
    exe = os.path.join(os.path.dirname(sys.executable), "kvtier")
    ok = subprocess.run([exe, "check-config", lmcache_yaml()], capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0 and ok.stdout.startswith("OK"), ok.stderr[-2000:]
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    cases = {
        lmcache_yaml(eviction_policy="random"): "kvtier.eviction_policy",
        lmcache_yaml(ssd_capacity_gb=-1): "kvtier.ssd_capacity_gb must be > 0",
        str(tmp_path / "missing.yaml"): "no such file",
    }
    text = open(lmcache_yaml()).read().replace(str(tmp_path / "ssd"), str(blocker / "ssd"))
    (tmp_path / "unwritable.yaml").write_text(text)
    cases[str(tmp_path / "unwritable.yaml")] = "kvtier.ssd_path: cannot create"
    for path, message in cases.items():
        res = subprocess.run([exe, "check-config", path], capture_output=True, text=True, timeout=120)
        assert res.returncode == 1 and message in res.stderr, (path, res.stderr[-2000:])


def test_check_config_checks_and_names_the_host_tiers_cache_policy(lmcache_yaml, tmp_path):
    """`cache_policy` is checked as LMCache will look it up when the engine starts (kvtier's KVTIER_<NAME> policies
    registered), and named in the OK line; a name LMCache does not know fails here, not at the engine's start."""
    from kvtier.cli.check_config import check
    from kvtier.storage_backends.config import ConfigError

    shipped = open(lmcache_yaml()).read()
    assert "(cache_policy LRU)" in check(lmcache_yaml())  # the shipped line is a comment: LMCache's default
    for line, said in (("cache_policy: KVTIER_ADAPTIVE", "(cache_policy KVTIER_ADAPTIVE)"),
                       ("cache_policy: kvtier_answer_length", "(cache_policy KVTIER_ANSWER_LENGTH)")):
        good = tmp_path / "good.yaml"
        good.write_text(shipped.replace("# cache_policy: KVTIER_ADAPTIVE", line))
        assert said in check(str(good))
    bad = tmp_path / "bad.yaml"
    bad.write_text(shipped.replace("# cache_policy: KVTIER_ADAPTIVE", "cache_policy: KVTIER_ADAPTIV"))
    with pytest.raises(ConfigError, match=r"cache_policy 'KVTIER_ADAPTIV' is not a policy LMCache knows .*"
                                          r"KVTIER_ADAPTIVE, .*LRU"):
        check(str(bad))


def test_lmcache_frees_its_host_pool_only_after_the_ssd_writes_end(lmcache_yaml, monkeypatch):
    """LMCache closes LocalCPUBackend (unmapping the host pool) before the plugin: queued SSD writes must be over by
    then (flushed for CLOSE_FLUSH_S, the rest dropped and counted), or a writer reads freed memory (a crash in the
    CRC, seen in 2 of 4 runs before the fix). The spy frees the pool only when no writer is left."""
    import time

    from kvtier.storage_backends.lmcache import backend as backend_module

    monkeypatch.setattr(backend_module, "CLOSE_FLUSH_S", 0.2)
    e = build_engine(load_lmcache_config(lmcache_yaml(ssd_capacity_gb=0.05)), WIDE)
    b = kvtier_plugin(e)
    tier = b.tier
    real = tier._write_batch
    monkeypatch.setattr(tier, "_write_batch", lambda batch: (time.sleep(1.0), real(batch))[1])
    allocator = e.storage_manager.storage_backends["LocalCPUBackend"].memory_allocator
    free_pool = allocator.close
    seen: dict[str, object] = {}

    def spy() -> None:
        seen["writers_alive"] = [w.is_alive() for w in tier._writers]
        seen["queued_bytes"] = tier.queue.inflight_bytes
        if not any(seen["writers_alive"]):  # never free memory a writer may still read (reverted fix: a leak)
            free_pool()

    monkeypatch.setattr(allocator, "close", spy)
    g = torch.Generator().manual_seed(3)
    for s in range(4):
        tokens = torch.arange(s * 10_000, s * 10_000 + 8 * CHUNK)
        e.store(tokens, kvcaches=torch.randn(2, 2, 8 * CHUNK, WIDE.hidden, generator=g).to(WIDE.dtype))
    destroy_engine(e)
    assert seen == {"writers_alive": [False, False], "queued_bytes": 0}
    st = tier.stats
    assert st.dropped_shutdown > 0 and st.committed + st.dropped_shutdown == 32, st.as_dict()
