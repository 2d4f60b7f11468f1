"""kvtier's eviction policies as CPU cache policies of vLLM's own offloading
(`storage_backends/vllm_offload/cache_policy.py`), run by vLLM's own managers: loaded the way vLLM loads them
(`eviction_policy` + `cache_policy_module_path`), hand-computed evictions, vLLM's contract (atomic `evict`,
protected and in-use chunks never evicted), and the same hit counts in production (`TieringOffloadingSpec`'s primary
tier) as `kvtier replay` reports for the same trace."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.compat, pytest.mark.needs("vllm_tiering")]

MODULE = "kvtier.storage_backends.vllm_offload.cache_policy"


def key(i: int) -> bytes:
    from vllm.v1.kv_offload.base import make_offload_key

    return make_offload_key(i.to_bytes(8, "big"), 0)


def manager(cls: str, chunks: int):
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

    return CPUOffloadingManager(num_chunks=chunks, cache_policy=cls, cache_policy_module_path=MODULE)


def request(mgr, n: int, keys: list[int]) -> list[str]:
    """One request over `keys` with the calls vLLM's scheduler-side connector makes; hit, store or skip per key."""
    from vllm.v1.kv_offload.base import LookupResult, ReqContext

    ctx = ReqContext(req_id=f"r{n}")
    for pos, k in enumerate(keys):
        ctx.set_offload_key_position(key(k), (pos + 1) * 16)
    mgr.on_new_request(ctx)
    out = []
    for k in keys:
        if mgr.lookup(key(k), ctx) is LookupResult.HIT:
            mgr.prepare_load([key(k)], ctx)
            mgr.complete_load([key(k)], ctx)
            out.append("hit")
            continue
        st = mgr.prepare_store([key(k)], ctx)
        if st is None or not st.keys_to_store:
            out.append("skip")
            continue
        mgr.complete_store(st.keys_to_store, ctx)
        out.append("store")
    mgr.on_request_finished(ctx)
    return out


def test_every_class_loads_through_vllms_factory():
    from vllm.v1.kv_offload.cpu.policies.factory import CachePolicyFactory

    from kvtier.storage_backends.eviction import production_policy_names
    from kvtier.storage_backends.vllm_offload import cache_policy

    assert set(cache_policy.CLASSES.values()) == set(production_policy_names())
    for cls_name, name in cache_policy.CLASSES.items():
        cls = CachePolicyFactory.get_cache_policy_cls(cls_name, MODULE)
        assert cls(cache_capacity=4).policy.name == name


def test_lru_inside_vllms_manager_evicts_the_least_recently_reused():
    """Capacity 2: A, B stored; A reused; C stored -> B (not A) is evicted."""
    mgr = manager("KVTierLRU", 2)
    assert request(mgr, 1, [1]) == ["store"]
    assert request(mgr, 2, [2]) == ["store"]
    assert request(mgr, 3, [1]) == ["hit"]
    assert request(mgr, 4, [3]) == ["store"]
    assert request(mgr, 5, [1]) == ["hit"]
    assert request(mgr, 6, [2]) == ["store"]  # B was gone; storing it evicts C (A was reused by request 5)
    assert request(mgr, 7, [1, 3]) == ["hit", "store"]


def test_evict_is_atomic_and_spares_protected_and_in_use_chunks():
    from vllm.v1.kv_offload.cpu.policies.base import ChunkStatus

    from kvtier.storage_backends.vllm_offload.cache_policy import KVTierLRU

    p = KVTierLRU(cache_capacity=3)
    chunks = {}
    for i in range(3):
        chunks[i] = ChunkStatus(i)
        p.insert(key(i), chunks[i])
        chunks[i].ref_cnt = 0
        p.mark_evictable(key(i))
    p.mark_non_evictable(key(0))  # a load in flight
    chunks[0].ref_cnt = 1
    assert p.evict(2, protected={key(1)}) is None  # only key 2 qualifies
    assert set(p.chunks) == {key(0), key(1), key(2)}  # no change
    got = p.evict(1, protected={key(1)})
    assert [k for k, _ in got] == [key(2)] and got[0][1] is chunks[2]
    assert set(p.chunks) == {key(0), key(1)} and key(2) not in p.policy
    assert p.evict(0, set()) == []
    p.clear()
    assert not p.chunks and len(p.policy) == 0


def trace():
    from kvtier.replay.synthetic import BurstySpec, bursty_trace

    return bursty_trace(BurstySpec(sessions=True, seed=5, duration_s=240.0))


@pytest.mark.parametrize("cls, name", [("KVTierAdaptive", "vllm+adaptive"), ("KVTierLRU", "vllm+lru")])
def test_production_primary_tier_gives_the_hit_counts_kvtier_replay_reports(tmp_path, cls, name):
    """The same trace through (a) `kvtier replay`'s vLLM-manager path and (b) the primary tier vLLM builds from
    `kv_connector_extra_config` (TieringOffloadingSpec, `eviction_policy` + `cache_policy_module_path`): equal hits."""
    from kvtier.replay import vllm_offload
    from kvtier.replay.traces import unique_blocks
    from kvtier.testing.vllm_tiering import TieringHarness

    reqs = trace()
    blocks = max(8, unique_blocks(reqs) // 20)
    want = vllm_offload.simulate(reqs, name, blocks)
    h = TieringHarness([], cpu_chunks=blocks, extra={"eviction_policy": cls, "cache_policy_module_path": MODULE})
    try:
        mgr = h.manager.primary_tier
        assert type(mgr._policy).__name__ == cls
        hits = seen = 0
        for n, r in enumerate(reqs):
            out = _replay_request(mgr, n, r.hash_ids)
            hits += out.count("hit")
            seen += len(out)
        assert seen == want["accesses"]
        assert hits == want["host_hits"], (hits, want)
        assert hits > 0
    finally:
        h.close()


def _replay_request(mgr, n, hash_ids) -> list[str]:
    """`request` with the replay's keys (8-byte signed block hashes, 512-token positions)."""
    from vllm.v1.kv_offload.base import LookupResult, ReqContext, make_offload_key

    ctx = ReqContext(req_id=f"req-{n}")
    keys = [make_offload_key(h.to_bytes(8, "big", signed=True), 0) for h in hash_ids]
    for i, k in enumerate(keys):
        ctx.set_offload_key_position(k, (i + 1) * 512)
    mgr.on_new_request(ctx)
    out = []
    for k in keys:
        if mgr.lookup(k, ctx) is LookupResult.HIT:
            mgr.prepare_load([k], ctx)
            mgr.complete_load([k], ctx)
            out.append("hit")
            continue
        out.append("miss")
        st = mgr.prepare_store([k], ctx)
        if st is not None and st.keys_to_store:
            mgr.complete_store(st.keys_to_store, ctx)
    mgr.on_request_finished(ctx)
    return out
