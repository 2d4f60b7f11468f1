"""kvtier's eviction policies as LMCache host-tier cache policies (`cache_policy: KVTIER_<NAME>` in the YAML).

`register_host_policies()` adds one entry per production policy to LMCache's `POLICY_MAPPING` (e.g.
`KVTIER_ANSWER_LENGTH`, `KVTIER_S3FIFO`). It must run before LMCache builds its host tier. kvtier's
`vllm.general_plugins` entry point (`install`) arranges that in every vLLM process without importing LMCache
itself (vLLM's CPU worker rebinds Triton kernels across all loaded modules at start and trips over LMCache's): it
registers the policies right after LMCache's cache-policy module is first imported. LMCache-only programs call
`register_host_policies()` once at start (`kvtier.launch.lmcache_engine` does). The adapter keeps LMCache's own
dict as the store and lets the kvtier policy choose victims; session signals reach it through `session_signals`.
The calls themselves are plain Python (`eviction/host_calls.py`, which the offline replay of a recorded stream
drives too). LMCache calls the adapter under its own lock, but session signals come from the connector's threads
without it: the adapter's lock orders both around every policy call, so a signal never reorders victims mid-scan.
With `kvtier.record_host_policy` the adapter records its stream (`eviction/recording.py`).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import logging
import sys
from typing import Any

from kvtier.storage_backends.eviction import make_policy, production_policy_names, recording
from kvtier.storage_backends.eviction.host_calls import BUSY, EVICTABLE, GONE, ChunkState, HostPolicyCalls

logger = logging.getLogger(__name__)


def lmcache_name(policy_name: str) -> str:
    return "KVTIER_" + policy_name.upper().replace("-", "_")


def _adapter_class(policy_name: str) -> type:
    from lmcache.v1.storage_backend.cache_policy.base_policy import BaseCachePolicy

    class KVTierHostPolicy(BaseCachePolicy):
        """LMCache BaseCachePolicy backed by kvtier's `{policy_name}` policy (through `HostPolicyCalls`)."""

        def __init__(self) -> None:
            where = recording.directory()
            self.recorder: recording.StreamRecorder | None = None
            if where is None:
                self.policy = make_policy(policy_name)
                self.calls = HostPolicyCalls(self.policy)
            else:
                self.recorder = recording.StreamRecorder.in_directory(where, policy_name)
                self.policy = make_policy(policy_name, clock=self.recorder.clock)
                self.calls = recording.RecordingHostPolicyCalls(self.policy, self.recorder)
            self.lock = self.calls.lock
            self.calls.register_signals()
            logger.info("LMCache host tier evicts with kvtier's %s policy", policy_name)

        def init_mutable_mapping(self) -> dict:
            return {} if self.recorder is None else recording.LookupRecordingDict(self.recorder)

        def update_on_hit(self, key: Any, cache_dict: dict) -> None:
            self.calls.hit(key)

        def update_on_put(self, key: Any) -> None:
            self.calls.put(key)

        def update_on_force_evict(self, key: Any) -> None:
            self.calls.force_evict(key)

        def get_evict_candidates(self, cache_dict: dict, num_candidates: int = 1) -> list:
            def state(k: Any) -> ChunkState:
                obj = cache_dict.get(k)  # None: LMCache dropped it without telling the policy (non-forced removal)
                if obj is None:
                    return GONE
                return EVICTABLE if obj.can_evict else BUSY

            return self.calls.evict_candidates(num_candidates, state)

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
