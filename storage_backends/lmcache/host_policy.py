"""kvtier's eviction policies as LMCache host-tier cache policies (`cache_policy: KVTIER_<NAME>` in the YAML).

`register_host_policies()` adds one entry per production policy to LMCache's `POLICY_MAPPING` (e.g.
`KVTIER_ANSWER_LENGTH`, `KVTIER_S3FIFO`). It must run before LMCache builds its host tier. kvtier's
`vllm.general_plugins` entry point (`install`) arranges that in every vLLM process without importing LMCache
itself (vLLM's CPU worker rebinds Triton kernels across all loaded modules at start and trips over LMCache's): it
registers the policies right after LMCache's cache-policy module is first imported. LMCache-only programs call
`register_host_policies()` once at start (`kvtier.launch.lmcache_engine` does). The adapter keeps LMCache's own
dict as the store and lets the kvtier policy choose victims; session signals reach it through `session_signals`.
LMCache calls the adapter under its own lock, but session signals come from the connector's threads without it:
the adapter's lock orders both around every policy call, so a signal never reorders victims mid-scan.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import logging
import sys
import threading
from typing import Any

from kvtier.storage_backends.eviction import make_policy, production_policy_names, session_signals

logger = logging.getLogger(__name__)


def lmcache_name(policy_name: str) -> str:
    return "KVTIER_" + policy_name.upper().replace("-", "_")


def _adapter_class(policy_name: str):
    from lmcache.v1.storage_backend.cache_policy.base_policy import BaseCachePolicy

    class KVTierHostPolicy(BaseCachePolicy):
        """LMCache BaseCachePolicy backed by kvtier's `{policy_name}` policy."""

        def __init__(self) -> None:
            self.policy = make_policy(policy_name)
            self.lock = threading.RLock()  # held around every policy call; session signals take it too
            session_signals.register(self.policy, lock=self.lock)
            logger.info("LMCache host tier evicts with kvtier's %s policy", policy_name)

        def init_mutable_mapping(self) -> dict:
            return {}

        def update_on_hit(self, key: Any, cache_dict: dict) -> None:
            with self.lock:
                if key in self.policy:
                    self.policy.on_access(key)

        def update_on_put(self, key: Any) -> None:
            with self.lock:
                if key in self.policy:
                    self.policy.on_access(key)
                else:
                    self.policy.on_insert(key, 1)

        def update_on_force_evict(self, key: Any) -> None:
            with self.lock:
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
            with self.lock:
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


_LMCACHE_POLICIES = "lmcache.v1.storage_backend.cache_policy"


class _RegisterAfterImport(importlib.abc.MetaPathFinder):
    """Runs `register_host_policies` as soon as LMCache's cache-policy module has been executed."""

    def find_spec(self, fullname, path, target=None):
        if fullname != _LMCACHE_POLICIES:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                loader = spec.loader
                original = loader.exec_module

                def exec_module(module, _original=original):
                    _original(module)
                    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _RegisterAfterImport)]
                    register_host_policies()

                loader.exec_module = exec_module  # type: ignore[method-assign,unused-ignore]
                return spec
        return None


def install() -> None:
    """The `vllm.general_plugins` entry point: make `cache_policy: KVTIER_<NAME>` available to LMCache in this
    process, without importing LMCache now."""
    if _LMCACHE_POLICIES in sys.modules:
        register_host_policies()
    elif not any(isinstance(f, _RegisterAfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _RegisterAfterImport())
