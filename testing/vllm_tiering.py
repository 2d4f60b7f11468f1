"""vLLM's own tiering manager (`TieringOffloadingSpec.get_manager()`: a CPU primary tier on vLLM's shared region and
the configured secondary tiers) driven without an engine, with the calls vLLM's `OffloadingConnectorScheduler` makes
and the byte copies its worker makes (GPU -> primary chunk on a store, primary chunk -> GPU on a load).

    with TieringHarness(tiers=[kvtier_tier(ssd_path, 0.01)], cpu_chunks=8) as h:
        h.store(keys, chunks)          # prepare_store, fill the primary chunks, complete_store (cascades)
        h.settle()                     # steps until every secondary-tier job has finished
        got = h.load(keys)             # lookup (promotions), steps, prepare_load; bytes of each chunk or None

Tests and benchmarks only (imports vLLM)."""

from __future__ import annotations

import hashlib
import time
import uuid
from collections.abc import Sequence
from typing import Any

import numpy as np
from vllm.v1.kv_offload.base import LookupResult, OffloadKey, ReqContext, ScheduleEndContext, make_offload_key
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

MODULE = "kvtier.storage_backends.vllm_offload.secondary_tier"
#: bytes one worker keeps per block in the harness (a chunk is one block of one worker: 16 KiB)
BLOCK_BYTES = 16384


def offload_keys(prefix: str, n: int) -> list[OffloadKey]:
    """`n` distinct keys of KV-cache group 0, the same for the same `prefix` in every process (a restart finds them)."""
    return [make_offload_key(hashlib.sha256(f"{prefix}-{i}".encode()).digest(), 0) for i in range(n)]


def kvtier_tier(ssd_path: str, capacity_gb: float, **params: Any) -> dict[str, Any]:
    """A `secondary_tiers` entry for kvtier's tier (what configs/vllm-offloading-kvtier.json ships)."""
    return {"type": "KVTierSecondaryTier", "module_path": MODULE, "ssd_path": str(ssd_path),
            "ssd_capacity_gb": capacity_gb, **params}


def fs_tier(root_dir: str, **params: Any) -> dict[str, Any]:
    """A `secondary_tiers` entry for vLLM's own `fs` tier."""
    return {"type": "fs", "root_dir": str(root_dir), **params}


def offloading_config(tiers: list[dict[str, Any]], cpu_chunks: int, *, model: str = "kvtier/tiny",
                      block_bytes: int = BLOCK_BYTES, extra: dict[str, Any] | None = None) -> OffloadingConfig:
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=("model.layers.0.self_attn",), group_id=0),),
        worker_kv_bytes_per_block=block_bytes, enable_kv_cache_events=False,
        extra_config={"cpu_bytes_to_use": cpu_chunks * block_bytes, "secondary_tiers": tiers, **(extra or {})},
        engine_id=f"kvtier-test-{uuid.uuid4().hex[:12]}", model=OffloadingModelConfig(name=model, dtype="float16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
                                          data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None,
                                          is_parallelism_agnostic=True))


class TieringHarness:
    def __init__(self, tiers: list[dict[str, Any]], cpu_chunks: int = 8, **kw: Any) -> None:
        self.spec = TieringOffloadingSpec(offloading_config(tiers, cpu_chunks, **kw))
        self.manager = self.spec.get_manager()
        self._n = 0

    @property
    def tiers(self) -> list:
        return self.manager.secondary_tiers

    def _primary(self) -> np.ndarray:
        return np.asarray(self.manager.primary_tier.get_kv_memoryview())

    def _ctx(self) -> ReqContext:
        self._n += 1
        ctx = ReqContext(req_id=f"req-{self._n}")
        self.manager.on_new_request(ctx)
        return ctx

    def step(self) -> None:
        self.manager.on_schedule_end(ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))

    def settle(self, timeout: float = 30.0) -> None:
        """Step until no tier has work in flight (the engine keeps stepping while `has_pending_work`)."""
        end = time.monotonic() + timeout
        while True:
            self.step()
            if not self.manager.has_pending_work():
                return
            if time.monotonic() > end:
                raise TimeoutError("secondary-tier jobs still in flight")
            time.sleep(0.005)

    def store(self, keys: Sequence[OffloadKey], chunks: Sequence[np.ndarray]) -> list[OffloadKey]:
        """One request storing `keys` (the GPU -> primary copy, then vLLM's cascade to the secondary tiers); returns
        the keys the primary tier took."""
        ctx = self._ctx()
        out = self.manager.prepare_store(list(keys), ctx)
        stored: list[OffloadKey] = []
        if out is not None and out.keys_to_store:
            primary = self._primary()
            by_key = dict(zip(keys, chunks))
            for key, cid in zip(out.keys_to_store, out.store_spec.chunk_ids):
                primary[cid][:] = by_key[key].view(primary.dtype)
            stored = list(out.keys_to_store)
            del primary
            self.manager.complete_store(stored, ctx)
        self.manager.on_request_finished(ctx)
        self.step()
        return stored

    def load(self, keys: Sequence[OffloadKey], timeout: float = 30.0) -> list[np.ndarray | None]:
        """One request looking its keys up until each is a HIT or a MISS (promotions from the secondary tiers run
        meanwhile), then reading the hits out of the primary tier (the primary -> GPU copy)."""
        ctx = self._ctx()
        end = time.monotonic() + timeout
        verdicts: dict[OffloadKey, LookupResult] = {}
        while True:
            for k in keys:
                if verdicts.get(k) not in (LookupResult.HIT, LookupResult.MISS):
                    verdicts[k] = self.manager.lookup(k, ctx)
            if all(v in (LookupResult.HIT, LookupResult.MISS) for v in verdicts.values()):
                break
            if time.monotonic() > end:
                raise TimeoutError(f"lookups still pending: {verdicts}")
            self.step()
            time.sleep(0.005)
        hits = [k for k in keys if verdicts[k] is LookupResult.HIT]
        out: dict[OffloadKey, np.ndarray] = {}
        if hits:
            spec = self.manager.prepare_load(hits, ctx)
            primary = self._primary()
            for k, cid in zip(hits, spec.chunk_ids):
                out[k] = primary[cid].view(np.uint8).copy()
            del primary
            self.manager.complete_load(hits, ctx)
        self.manager.on_request_finished(ctx)
        self.step()
        return [out.get(k) for k in keys]

    def close(self) -> None:
        self.manager.shutdown()

    def __enter__(self) -> TieringHarness:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
