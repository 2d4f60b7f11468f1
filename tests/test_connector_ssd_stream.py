"""The connector's SSD stream (`kvtier.connector.ssd_stream`): a load's SSD-resident chunks reach vLLM's blocks
through a bounded staging area, bit for bit, without filling the host tier; a chunk that fails verification, is
in no local tier, or has another model's format ends the stream at its first token."""

from __future__ import annotations

import time
import uuid

import pytest

pytest.importorskip("vllm")  # the connector's modules build on vLLM's connector base

import torch  # noqa: E402

pytest.importorskip("lmcache", reason="needs lmcache: LMCache is not installed (kvtier[lmcache])")

from lmcache.v1.cache_engine import LMCacheEngineBuilder  # noqa: E402
from lmcache.v1.metadata import LMCacheMetadata  # noqa: E402

from kvtier.connector.ssd_stream import SSDStream  # noqa: E402
from kvtier.connector.worker_storage import SSDTierHandle  # noqa: E402
from kvtier.kernels import KVLayoutKind, vllm_cache_shape  # noqa: E402
from kvtier.storage_backends.lmcache.backend import load_lmcache_config  # noqa: E402
from kvtier.storage_backends.lmcache.engine_access import kvtier_plugin
from kvtier.storage_backends.lmcache.gpu_connector import PageFirstGPUConnector  # noqa: E402

L, H, D, BLOCK, PAGE, CHUNK, NBLOCKS = 2, 2, 32, 16, 16, 32, 20
DTYPE = torch.float32
NCHUNKS = 7  # 224 tokens: blocks 0..13


def paged(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = vllm_cache_shape(KVLayoutKind.KV_FIRST, NBLOCKS, BLOCK, H, D)
    return [torch.randn(shape, generator=g, dtype=DTYPE) for _ in range(L)]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)


@pytest.fixture
def stored(lmcache_yaml):
    """A page-first engine whose SSD tier holds the 7 chunks of `tokens` (KV of `src`), host tier emptied."""
    cfg = load_lmcache_config(lmcache_yaml(chunk_size=CHUNK, chunk_format="page_first", page_tokens=PAGE))
    md = LMCacheMetadata(model_name="kvtier-test/stream", world_size=1, local_world_size=1, worker_id=0,
                         local_worker_id=0, kv_dtype=DTYPE, kv_shape=(L, 2, CHUNK, H, D), chunk_size=CHUNK,
                         role="worker")
    conn = PageFirstGPUConnector.from_metadata(md, KVLayoutKind.KV_FIRST, PAGE)
    iid = f"kvtier-stream-{uuid.uuid4().hex[:6]}"
    eng = LMCacheEngineBuilder.get_or_create(iid, cfg, md, conn, lambda *a: None, lambda o, r: o)
    eng.post_init()
    try:
        tokens = torch.arange(11, 11 + NCHUNKS * CHUNK)
        slots = torch.arange(NCHUNKS * CHUNK)
        src = paged(1)
        eng.store(tokens, kvcaches=src, slot_mapping=slots)
        plugin = kvtier_plugin(eng)
        assert plugin.flush(30) and plugin.tier.stats.committed == NCHUNKS
        host = eng.storage_manager.storage_backends["LocalCPUBackend"]
        host.clear()
        chunks = list(eng.token_database.process_tokens(tokens=tokens))
        yield {"eng": eng, "conn": conn, "plugin": plugin, "host": host, "src": src, "slots": slots,
               "chunks": chunks, "ssd": SSDTierHandle(plugin), "md": md}
    finally:
        LMCacheEngineBuilder.destroy(iid)


def blocks_of(caches: list[torch.Tensor], first_token: int, end_token: int) -> list[torch.Tensor]:
    return [bits(c[:, first_token // BLOCK:end_token // BLOCK]) for c in caches]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_every_chunk_arrives_bit_exact_through_two_staging_chunks(stored):
    s = stored
    stream = SSDStream(s["ssd"], s["host"], s["conn"], stage_chunks=2)
    dst = paged(2)
    res = stream.load(s["chunks"], kvcaches=dst, slot_mapping=s["slots"])
    assert res.bad_from is None and res.ssd_chunks == NCHUNKS and res.host_chunks == 0 and res.windows == 4
    n = NCHUNKS * CHUNK
    assert same(blocks_of(dst, 0, n), blocks_of(s["src"], 0, n))
    assert same(blocks_of(dst, n, NBLOCKS * BLOCK), blocks_of(paged(2), n, NBLOCKS * BLOCK))  # nothing else written
    # the host tier is neither filled nor used: the stream held at most its two staging chunks
    assert len(s["host"].hot_cache) == 0
    assert stream.staging_bytes == 2 * s["ssd"].chunk_bytes
    assert s["plugin"].tier.stats.hits == NCHUNKS


def test_tokens_vllm_already_holds_are_left_untouched(stored):
    s = stored
    dst = paged(3)
    before = [c.clone() for c in dst]
    res = SSDStream(s["ssd"], s["host"], s["conn"], stage_chunks=3).load(
        s["chunks"][1:], kvcaches=dst, slot_mapping=s["slots"], vllm_cached_tokens=48)
    assert res.bad_from is None
    n = NCHUNKS * CHUNK
    assert same(blocks_of(dst, 0, 48), blocks_of(before, 0, 48))
    assert same(blocks_of(dst, 48, n), blocks_of(s["src"], 48, n))


def test_a_flipped_byte_ends_the_stream_at_that_chunk(stored):
    s = stored
    tier = s["plugin"].tier
    key = s["chunks"][4][2].to_string()
    path, base = tier.io.files.locate_path(tier.entry(key).slot)
    with open(path, "r+b") as f:
        f.seek(base + 4096 + 100)
        b = f.read(1)[0]
        f.seek(base + 4096 + 100)
        f.write(bytes([b ^ 0x10]))
    dst = paged(4)
    res = SSDStream(s["ssd"], s["host"], s["conn"], stage_chunks=3).load(
        s["chunks"], kvcaches=dst, slot_mapping=s["slots"])
    assert res.bad_from == 4 * CHUNK and res.ssd_chunks == 4
    assert same(blocks_of(dst, 0, 4 * CHUNK), blocks_of(s["src"], 0, 4 * CHUNK))
    # the corrupt chunk and everything after it are left for vLLM to recompute, never written
    assert same(blocks_of(dst, 4 * CHUNK, NBLOCKS * BLOCK), blocks_of(paged(4), 4 * CHUNK, NBLOCKS * BLOCK))
    assert tier.stats.corrupt == 1 and not tier.contains(key)


def test_a_chunk_only_in_the_host_tier_is_taken_from_there_and_released(stored):
    s = stored
    eng, tier = s["eng"], s["plugin"].tier
    tokens = torch.arange(11, 11 + NCHUNKS * CHUNK)
    eng.store(tokens, kvcaches=s["src"], slot_mapping=s["slots"])  # back into the host tier
    assert s["plugin"].flush(30)
    key = s["chunks"][2][2]
    assert tier.remove(key.to_string()) and s["host"].contains(key)
    obj = s["host"].hot_cache[key]
    refs = obj.get_ref_count()
    dst = paged(5)
    res = SSDStream(s["ssd"], s["host"], s["conn"], stage_chunks=2).load(
        s["chunks"], kvcaches=dst, slot_mapping=s["slots"])
    assert res.bad_from is None and res.host_chunks == 1 and res.ssd_chunks == NCHUNKS - 1
    n = NCHUNKS * CHUNK
    assert same(blocks_of(dst, 0, n), blocks_of(s["src"], 0, n))
    assert obj.get_ref_count() == refs


def test_a_chunk_in_no_local_tier_ends_the_stream(stored):
    s = stored
    assert s["plugin"].tier.remove(s["chunks"][5][2].to_string())
    dst = paged(6)
    res = SSDStream(s["ssd"], s["host"], s["conn"], stage_chunks=4).load(
        s["chunks"], kvcaches=dst, slot_mapping=s["slots"])
    assert res.bad_from == 5 * CHUNK and res.ssd_chunks == 5
    assert same(blocks_of(dst, 5 * CHUNK, NBLOCKS * BLOCK), blocks_of(paged(6), 5 * CHUNK, NBLOCKS * BLOCK))


def test_another_models_chunks_are_misses_never_written(stored):
    """A reader whose page-first chunk differs (here: half the page size, same bytes per chunk) must refuse the
    slots by their recorded shape before any byte reaches its blocks."""
    s = stored
    other = PageFirstGPUConnector.from_metadata(s["md"], KVLayoutKind.KV_FIRST, PAGE // 2)
    dst = paged(7)
    res = SSDStream(s["ssd"], s["host"], other, stage_chunks=2).load(
        s["chunks"], kvcaches=dst, slot_mapping=s["slots"])
    assert res.bad_from == 0 and res.ssd_chunks == 0
    assert same(blocks_of(dst, 0, NBLOCKS * BLOCK), blocks_of(paged(7), 0, NBLOCKS * BLOCK))


def test_staging_area_needs_a_chunk(stored):
    with pytest.raises(ValueError):
        SSDStream(stored["ssd"], stored["host"], stored["conn"], stage_chunks=0)


@pytest.fixture
def device_reads(stored):
    """The same tier reading "device" destinations through the host stand-in of kvikio (CPU tensors)."""
    from kvtier.testing.host_device_reader import HostDeviceReader

    reader = HostDeviceReader()
    stored["plugin"].tier.io.set_device_reader(reader)
    stored["reader"] = reader
    return stored


def test_device_reads_go_from_the_ssd_straight_into_the_staging_area(device_reads, monkeypatch):
    s = device_reads
    assert s["ssd"].reads_into_device
    monkeypatch.setattr(s["ssd"], "read_into", lambda *a: pytest.fail("a device stream read into host buffers"))
    stream = SSDStream(s["ssd"], s["host"], s["conn"], stage_chunks=3, device="cpu")
    assert stream.direct
    dst = paged(8)
    res = stream.load(s["chunks"], kvcaches=dst, slot_mapping=s["slots"])
    assert res.bad_from is None and res.ssd_chunks == NCHUNKS and res.windows == 3
    n = NCHUNKS * CHUNK
    assert same(blocks_of(dst, 0, n), blocks_of(s["src"], 0, n))
    assert s["reader"].reads == NCHUNKS and s["reader"].bytes == NCHUNKS * s["ssd"].chunk_bytes
    assert len(s["host"].hot_cache) == 0


def test_device_reads_verify_every_chunk(device_reads):
    s = device_reads
    tier = s["plugin"].tier
    key = s["chunks"][2][2].to_string()
    path, base = tier.io.files.locate_path(tier.entry(key).slot)
    with open(path, "r+b") as f:  # the last byte of the chunk: a check that skips the tail misses it
        f.seek(base + 4096 + s["ssd"].chunk_bytes - 1)
        b = f.read(1)[0]
        f.seek(base + 4096 + s["ssd"].chunk_bytes - 1)
        f.write(bytes([b ^ 0x01]))
    dst = paged(9)
    res = SSDStream(s["ssd"], s["host"], s["conn"], stage_chunks=4, device="cpu").load(
        s["chunks"], kvcaches=dst, slot_mapping=s["slots"])
    assert res.bad_from == 2 * CHUNK
    assert same(blocks_of(dst, 2 * CHUNK, NBLOCKS * BLOCK), blocks_of(paged(9), 2 * CHUNK, NBLOCKS * BLOCK))
    assert tier.stats.corrupt == 1 and not tier.contains(key)


def test_device_reads_refuse_another_models_chunks(device_reads):
    s = device_reads
    other = PageFirstGPUConnector.from_metadata(s["md"], KVLayoutKind.KV_FIRST, PAGE // 2)
    dst = paged(10)
    res = SSDStream(s["ssd"], s["host"], other, stage_chunks=2, device="cpu").load(
        s["chunks"], kvcaches=dst, slot_mapping=s["slots"])
    assert res.bad_from == 0 and s["reader"].reads == 0
    assert same(blocks_of(dst, 0, NBLOCKS * BLOCK), blocks_of(paged(10), 0, NBLOCKS * BLOCK))


def worker_storage(s: dict, on_progress=lambda: None, **kw):
    """A WorkerStorage over the `stored` fixture's host and SSD tiers, keyed as its engine keys tokens."""
    from kvtier.connector.config import ConnectorOptions
    from kvtier.connector.worker_storage import WorkerStorage

    return WorkerStorage(s["host"], s["ssd"], None, lambda toks, tag="": list(s["eng"].token_database.process_tokens(
        tokens=torch.tensor(toks))), CHUNK, ConnectorOptions(), lambda **kw: None, on_progress, **kw)


def prefetched(storage, rid: str, tokens: list[int]):
    """Submit `rid`'s prefetch of `tokens` and wait (30 s at most) for its result."""
    storage.submit_prefetch(rid, tokens)
    for _ in range(600):
        got = storage.take_results([rid])
        if got:
            return got[rid]
        time.sleep(0.05)
    raise AssertionError(f"the prefetch of {rid} did not end within 30 s")


@pytest.mark.parametrize("direct", [False, True])
def test_prefetch_leaves_ssd_chunks_to_a_device_stream(stored, direct):
    """With device reads the prefetch stages no SSD chunk in the host pool (the load's stream reads them into
    device memory); without, it brings them into the host tier, pinned for the request."""
    s = stored
    done = []
    storage = worker_storage(s, lambda: done.append(1), direct_ssd=direct)
    try:
        tokens = list(range(11, 11 + NCHUNKS * CHUNK))
        res = prefetched(storage, "r", tokens)
        assert res.ok, res
        if direct:
            assert res.tokens == 0 and res.nbytes == 0 and len(s["host"].hot_cache) == 0
            look = storage.lookup("r2", tokens)
            assert (look.host_end, look.hit_end, look.ssd_tokens) == (0, NCHUNKS * CHUNK, NCHUNKS * CHUNK)
        else:
            assert res.tokens == NCHUNKS * CHUNK and len(s["host"].hot_cache) == NCHUNKS
        storage.release("r")
    finally:
        storage.close()


def test_chunks_a_load_read_are_hits_for_the_host_tiers_policy(stored):
    """What a load read from the host tier reaches the tier's eviction policy as hits (LMCache's LRU here, the
    YAML's default), as LMCache's own pinned lookups do: afterwards its victims are the chunks no load read, oldest
    first, then the read ones, their prefix's head last. Without the report (kvtier pins and reads through calls
    that never reach the policy) the host tier evicts in insertion order: chunk 0 first."""
    s = stored
    storage = worker_storage(s)
    try:
        tokens = list(range(11, 11 + NCHUNKS * CHUNK))
        res = prefetched(storage, "r", tokens)  # the 7 chunks into the host tier, in order
        assert res.ok and len(s["host"].hot_cache) == NCHUNKS, res
        storage.release("r")
        keys = [k for _, _, k in s["chunks"]]
        # a load of the first 4 chunks' tokens that asked for chunks 1..3 (chunk 0 was in the GPU) and got 1..2
        ret = torch.zeros(4 * CHUNK, dtype=torch.bool)
        ret[CHUNK:3 * CHUNK] = True
        storage.after_retrieve("r2", tokens[:4 * CHUNK], ret, skip=CHUNK)
        host = s["host"]
        with host.cpu_lock:
            order = host.cache_policy.get_evict_candidates(host.hot_cache, NCHUNKS)
        assert order == [keys[0], keys[3], keys[4], keys[5], keys[6], keys[2], keys[1]], \
            [keys.index(k) for k in order]
    finally:
        storage.close()


def test_chunks_a_prefetch_staged_are_no_host_hits_for_its_own_load(stored):
    """The chunks a request's own prefetch brought from the SSD tier reach the host tier's policy as puts only:
    that request's load reading them is the SSD tier's hit, not a reuse of host memory, so the policy hears no hit
    (LRU order stays the insertion order). Another request's load of the same chunks is a host hit (the previous
    test); after `release` the request's staged set is gone."""
    s = stored
    storage = worker_storage(s)
    host = s["host"]
    try:
        tokens = list(range(11, 11 + NCHUNKS * CHUNK))
        res = prefetched(storage, "r", tokens)
        assert res.ok and len(host.hot_cache) == NCHUNKS, res
        keys = [k for _, _, k in s["chunks"]]
        ret = torch.zeros(4 * CHUNK, dtype=torch.bool)
        ret[CHUNK:3 * CHUNK] = True
        storage.after_retrieve("r", tokens[:4 * CHUNK], ret, skip=CHUNK)  # r's own load of what r staged
        storage.release("r")  # (unpinned: every chunk may be a victim)
        with host.cpu_lock:
            order = host.cache_policy.get_evict_candidates(host.hot_cache, NCHUNKS)
        assert order == keys, [keys.index(k) for k in order]
        storage.after_retrieve("r", tokens[:4 * CHUNK], ret, skip=CHUNK)  # a later load, nothing staged for it
        with host.cpu_lock:
            order = host.cache_policy.get_evict_candidates(host.hot_cache, NCHUNKS)
        assert order == [keys[0], keys[3], keys[4], keys[5], keys[6], keys[2], keys[1]], \
            [keys.index(k) for k in order]
    finally:
        storage.close()


def test_a_byte_gone_bad_in_device_memory_is_a_miss(stored):
    """The check runs on what landed in (device) memory, not on what the disk holds: a byte flipped after the
    read (the last one of the chunk, in its last piece) is a miss, and nothing is written into the blocks."""
    from kvtier.testing.host_device_reader import HostDeviceReader

    s = stored
    s["plugin"].tier.io.set_device_reader(HostDeviceReader(flip_byte=s["ssd"].chunk_bytes - 1))
    dst = paged(11)
    res = SSDStream(s["ssd"], s["host"], s["conn"], stage_chunks=2, device="cpu").load(
        s["chunks"], kvcaches=dst, slot_mapping=s["slots"])
    assert res.bad_from == 0 and res.ssd_chunks == 0
    assert same(blocks_of(dst, 0, NBLOCKS * BLOCK), blocks_of(paged(11), 0, NBLOCKS * BLOCK))
    assert s["plugin"].tier.stats.corrupt >= 1
