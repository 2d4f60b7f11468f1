"""Page-first chunks (kvtier's gather/scatter GPU connector) through the SSD tier, and layout isolation."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("lmcache", reason="needs lmcache: LMCache is not installed (kvtier[lmcache])")

from lmcache.v1.cache_engine import LMCacheEngineBuilder
from lmcache.v1.metadata import LMCacheMetadata

from kvtier.kernels import KVLayoutKind, vllm_cache_shape
from kvtier.launch.lmcache_engine import ModelShape, build_engine, destroy_engine
from kvtier.storage_backends.lmcache.backend import load_lmcache_config
from kvtier.storage_backends.lmcache.engine_access import kvtier_plugin
from kvtier.storage_backends.lmcache.gpu_connector import PageFirstGPUConnector

L, H, D, BLOCK, PAGE, CHUNK, NBLOCKS = 2, 2, 32, 16, 16, 32, 16
DTYPE = torch.float32


def paged(seed: int):
    g = torch.Generator().manual_seed(seed)
    shape = vllm_cache_shape(KVLayoutKind.KV_FIRST, NBLOCKS, BLOCK, H, D)
    return [torch.randn(shape, generator=g, dtype=DTYPE) for _ in range(L)]


def page_first_engine(yaml_path: str):
    cfg = load_lmcache_config(yaml_path)
    md = LMCacheMetadata(model_name="kvtier-test/pf", world_size=1, local_world_size=1, worker_id=0,
                         local_worker_id=0, kv_dtype=DTYPE, kv_shape=(L, 2, CHUNK, H, D), chunk_size=CHUNK,
                         role="worker")
    conn = PageFirstGPUConnector.from_metadata(md, KVLayoutKind.KV_FIRST, PAGE)
    eng = LMCacheEngineBuilder.get_or_create("kvtier-pf-test", cfg, md, conn, lambda *a: None, lambda o, r: o)
    eng.post_init()
    return eng


def test_page_first_chunks_round_trip_through_ssd_and_stay_apart_from_kv_2ltd(lmcache_yaml):
    yaml_pf = lmcache_yaml(chunk_size=CHUNK, chunk_format="page_first", page_tokens=PAGE)
    eng = page_first_engine(yaml_pf)
    b = kvtier_plugin(eng)
    tokens = torch.arange(7, 7 + 4 * CHUNK)
    slots = torch.arange(4 * CHUNK)  # blocks 0..7
    src, dst = paged(1), paged(2)
    try:
        eng.store(tokens, kvcaches=src, slot_mapping=slots)
        assert b.flush(30) and b.tier.stats.committed == 4
        eng.storage_manager.storage_backends["LocalCPUBackend"].clear()
        got = int(eng.retrieve(tokens, kvcaches=dst, slot_mapping=slots).sum())
        assert got == 4 * CHUNK and b.tier.stats.hits == 4
        for s, d in zip(src, dst):
            assert torch.equal(s[:, :8].view(torch.int32), d[:, :8].view(torch.int32))
    finally:
        LMCacheEngineBuilder.destroy("kvtier-pf-test")

    # Same model name, dtype and tokens (so the same LMCache keys) but an engine reading KV_2LTD: another KV
    # identity (the layout is part of it), so the page-first slots are foreign chunks, never handed over.
    yaml_2ltd = lmcache_yaml(chunk_size=CHUNK)
    shape = ModelShape("kvtier-test/pf", L, H, D, DTYPE)
    eng2 = build_engine(load_lmcache_config(yaml_2ltd), shape)
    try:
        b2 = kvtier_plugin(eng2)
        assert len(b2.tier) == 4
        out = torch.zeros(2, L, 4 * CHUNK, H * D, dtype=DTYPE)
        assert int(eng2.retrieve(tokens, kvcaches=out).sum()) == 0
        assert b2.tier.foreign_chunks() == 4 and b2.tier.keys() == []
        assert b2.tier.stats.hits == 0
        assert torch.count_nonzero(out) == 0
    finally:
        destroy_engine(eng2)
