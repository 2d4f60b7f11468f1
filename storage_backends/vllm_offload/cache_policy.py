"""kvtier's eviction policies as CPU cache policies of vLLM's own offloading (`CPUOffloadingManager`, also the
primary tier of `TieringOffloadingSpec`), loaded by vLLM from `kv_connector_extra_config`:

    "eviction_policy": "KVTierAdaptive",
    "cache_policy_module_path": "kvtier.storage_backends.vllm_offload.cache_policy"

One class per kvtier policy (`KVTierAdaptive`, `KVTierAnswerLength`, `KVTierARC`, `KVTierS3FIFO`, `KVTierLRU`, ...),
each the same `EvictionPolicy` object `kvtier replay` and kvtier's own tiers run, behind vLLM's `CachePolicy`:
vLLM's manager keeps ref counts and chunk slots; this class keeps the chunk table and the evictable set, and asks the
kvtier policy for victims. Session signals: vLLM hands a policy each request's chunk chain, in prefix order, when
the request finishes (`on_request_finished`), and no token counts; the kvtier policy gets that chain as the
request (`on_request`) with its reused chunks as accesses, and an answer length of 0 (unknown). So answer-length's
answer-length feature has nothing to learn from here; `adaptive` follows whichever of its experts leads."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import ClassVar

from vllm.v1.kv_offload.base import OffloadKey, ReqContext
from vllm.v1.kv_offload.cpu.policies.base import CachePolicy, ChunkStatus, order_request_keys

from kvtier.storage_backends.eviction import EvictionPolicy, make_policy


class KVTierCachePolicy(CachePolicy):
    """vLLM's `CachePolicy` over kvtier's policy named `policy_name` (subclasses set it)."""

    policy_name: ClassVar[str] = ""

    def __init__(self, cache_capacity: int) -> None:
        super().__init__(cache_capacity)
        self.policy: EvictionPolicy = self._new_policy()
        self.chunks: dict[OffloadKey, ChunkStatus] = {}
        self._evictable: set[OffloadKey] = set()

    def _new_policy(self) -> EvictionPolicy:
        policy = make_policy(self.policy_name)
        policy.set_capacity(self.cache_capacity)
        return policy

    def get(self, key: OffloadKey) -> ChunkStatus | None:
        return self.chunks.get(key)

    def insert(self, key: OffloadKey, chunk: ChunkStatus, req_context: ReqContext | None = None) -> None:
        """`req_context` is passed by vLLM >= 0.34."""
        self.chunks[key] = chunk
        self.policy.on_insert(key, 1)
        if chunk.ref_cnt == 0:
            self._evictable.add(key)

    def remove(self, key: OffloadKey) -> None:
        del self.chunks[key]
        self._evictable.discard(key)
        self.policy.on_remove(key)

    def touch(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        """vLLM <= 0.33's explicit reuse (its managers only call it through `on_request_finished`'s default)."""
        for key in keys:
            if key in self.chunks:
                self.policy.on_access(key)

    def on_request_finished(self, key_groups: Sequence[Sequence[OffloadKey]], insertion_only_keys: set[OffloadKey],
                            reused_keys: set[OffloadKey], req_context: ReqContext) -> None:
        chain = order_request_keys(key_groups, req_context)
        if not chain:
            return
        self.policy.on_request(chain)
        for key in chain:
            if key in reused_keys and key in self.chunks:
                self.policy.on_access(key)
        self.policy.on_request_finished(chain, 0)

    def evict(self, n: int, protected: set[OffloadKey]) -> list[tuple[OffloadKey, ChunkStatus]] | None:
        """Exactly `n` evictable, unprotected chunks in the kvtier policy's order, or None (and no change)."""
        if n <= 0:
            return []
        if len(self._evictable) - len(protected & self._evictable) < n:
            return None
        out: list[tuple[OffloadKey, ChunkStatus]] = []
        for key in self.policy.victims(n, lambda k: k in self._evictable and k not in protected):
            out.append((key, self.chunks[key]))
            self.remove(key)  # the policy's contract: a victim is removed before the next is asked for
            if len(out) == n:
                break
        if len(out) < n:  # the policy lost track of a resident chunk: put the victims back rather than half-evict
            for key, chunk in out:
                self.insert(key, chunk)
            return None
        return out

    def clear(self) -> None:
        self.chunks.clear()
        self._evictable.clear()
        self.policy = self._new_policy()

    def mark_evictable(self, key: OffloadKey) -> None:
        self._evictable.add(key)

    def mark_non_evictable(self, key: OffloadKey) -> None:
        self._evictable.discard(key)


class KVTierAdaptive(KVTierCachePolicy):
    policy_name = "adaptive"


class KVTierAnswerLength(KVTierCachePolicy):
    policy_name = "answer-length"


class KVTierARC(KVTierCachePolicy):
    policy_name = "arc"


class KVTierS3FIFO(KVTierCachePolicy):
    policy_name = "s3fifo"


class KVTierLRU(KVTierCachePolicy):
    policy_name = "lru"


class KVTierLFU(KVTierCachePolicy):
    policy_name = "lfu"


class KVTierFIFO(KVTierCachePolicy):
    policy_name = "fifo"


#: vLLM's `eviction_policy` names (classes of this module) -> kvtier's policy names
CLASSES: dict[str, str] = {c.__name__: c.policy_name for c in KVTierCachePolicy.__subclasses__()}
