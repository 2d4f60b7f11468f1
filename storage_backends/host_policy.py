"""kvtier's eviction policies as LMCache host-tier cache policies (`cache_policy: KVTIER_<NAME>` in the YAML).

`register_host_policies()` adds one entry per production policy to LMCache's `POLICY_MAPPING` (e.g.
`KVTIER_ANSWER_LENGTH`, `KVTIER_S3FIFO`). It must run before LMCache builds its host tier: vLLM runs it in every
process through kvtier's `vllm.general_plugins` entry point; LMCache-only programs call it once at start
(`kvtier.storage_backends.engine_factory` does). The adapter keeps LMCache's own dict as the store and lets the
kvtier policy choose victims; session signals reach it through `session_signals`.
"""

from __future__ import annotations

import logging
from typing import Any

from kvtier.storage_backends import session_signals
from kvtier.storage_backends.eviction import make_policy, production_policy_names

logger = logging.getLogger("kvtier.host_policy")


def lmcache_name(policy_name: str) -> str:
    return "KVTIER_" + policy_name.upper().replace("-", "_")


def _adapter_class(policy_name: str):
    from lmcache.v1.storage_backend.cache_policy.base_policy import BaseCachePolicy

    class KVTierHostPolicy(BaseCachePolicy):
        """LMCache BaseCachePolicy backed by kvtier's `{policy_name}` policy."""

        def __init__(self) -> None:
            self.policy = make_policy(policy_name)
            session_signals.register(self.policy)
            logger.info("LMCache host tier evicts with kvtier's %s policy", policy_name)

        def init_mutable_mapping(self) -> dict:
            return {}

        def update_on_hit(self, key: Any, cache_dict: dict) -> None:
            if key in self.policy:
                self.policy.on_access(key)

        def update_on_put(self, key: Any) -> None:
            if key in self.policy:
                self.policy.on_access(key)
            else:
                self.policy.on_insert(key, 1)

        def update_on_force_evict(self, key: Any) -> None:
            self.policy.on_remove(key)

        def get_evict_candidates(self, cache_dict: dict, num_candidates: int = 1) -> list:
            stale = []  # keys LMCache dropped without telling the policy (non-forced removals)

            def evictable(k: Any) -> bool:
                obj = cache_dict.get(k)
                if obj is None:
                    stale.append(k)
                    return False
                return obj.can_evict

            out = []
            for key in self.policy.victims(num_candidates, evictable):
                out.append(key)
                self.policy.on_remove(key)  # LMCache removes candidates without telling the policy
            for k in stale:
                self.policy.on_remove(k)
            return out

    KVTierHostPolicy.__name__ = f"KVTierHostPolicy_{policy_name.replace('-', '_')}"
    return KVTierHostPolicy


def register_host_policies() -> list[str]:
    """Add kvtier's production policies to LMCache's POLICY_MAPPING; returns the names added."""
    from lmcache.v1.storage_backend import cache_policy

    names = []
    for name in production_policy_names():
        key = lmcache_name(name)
        if key not in cache_policy.POLICY_MAPPING:
            cache_policy.POLICY_MAPPING[key] = _adapter_class(name)
        names.append(key)
    return names
