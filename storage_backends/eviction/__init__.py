"""Eviction policies shared by kvtier's tiers, the replay tool and the simulator.

Plain Python: nothing here imports vLLM or LMCache, so production tiers and offline replays run the same objects.
`make_policy(name, ...)` builds a policy by its registered name.
"""

from kvtier.storage_backends.eviction.base import (
    POLICY_REGISTRY,
    EvictionPolicy,
    make_policy,
    production_policy_names,
    register_policy,
)
from kvtier.storage_backends.eviction.lru import LRUPolicy

__all__ = [
    "EvictionPolicy",
    "LRUPolicy",
    "POLICY_REGISTRY",
    "make_policy",
    "production_policy_names",
    "register_policy",
]
