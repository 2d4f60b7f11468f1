"""The interface every eviction policy implements, and the registry that names them.

A policy tracks the entries (chunks) of one tier and picks victims when the tier needs room. The tier owns the
data and the capacity arithmetic; the policy only orders entries. Keys are any hashable value (an LMCache
`CacheEngineKey`, a trace block id, ...). Sizes are bytes, or 1 per block in replays.

Call contract (all calls from the tier, under the tier's lock):
- `on_insert(key, size)`      a new entry became resident.
- `on_access(key)`            a resident entry was read (a hit).
- `on_remove(key)`            the entry left the tier for any reason (evicted, corrupt, removed by the user).
- `victims(need, evictable)`  yield keys to evict, best victim first, until the caller has freed `need` bytes;
                              keys for which `evictable(key)` is False (pinned, being read) are skipped.
                              The caller calls `on_remove` for each key it actually evicts.
Session signals (optional; policies that do not use them ignore them):
- `on_request(chain, now)`            a request arrives that reads/extends the prefix chain `chain` (keys, in order).
- `on_request_finished(chain, answer_tokens, now)`   the request finished and generated `answer_tokens` tokens.
Optional sizing hint (policies that size internal queues use it, others ignore it):
- `set_capacity(capacity)`   the tier's capacity in the same units as `size`; without it such policies use the
                             high-water mark of resident sizes.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Any

Key = Hashable


class EvictionPolicy(abc.ABC):
    """Orders a tier's entries for eviction. Not thread-safe: the owning tier serialises calls."""

    #: Registered name (`kvtier.eviction_policy` config value, `kvtier replay --policies`).
    name: str = ""
    #: False for policies that need the future (Belady): refused outside offline replays.
    production: bool = True

    def __init__(self, clock: Callable[[], float] | None = None) -> None:
        import time

        self._clock = clock or time.monotonic

    def now(self) -> float:
        return self._clock()

    @abc.abstractmethod
    def on_insert(self, key: Key, size: int = 1) -> None: ...

    @abc.abstractmethod
    def on_access(self, key: Key) -> None: ...

    @abc.abstractmethod
    def on_remove(self, key: Key) -> None: ...

    @abc.abstractmethod
    def victims(self, need: int, evictable: Callable[[Key], bool]) -> Iterator[Key]: ...

    @abc.abstractmethod
    def __len__(self) -> int: ...

    @abc.abstractmethod
    def __contains__(self, key: Key) -> bool: ...

    #: The tier's capacity (same units as `size`) when the tier announced it through `set_capacity`.
    capacity: int | None = None

    def set_capacity(self, capacity: int) -> None:
        """Optional: the tier tells its capacity (bytes, or blocks in replays)."""
        self.capacity = int(capacity)

    def stats(self) -> dict[str, int]:
        """The policy's own counters (shown in the connector's stats); none by default."""
        return {}

    # Session signals: default no-ops.
    def on_request(self, chain: Sequence[Key], now: float | None = None) -> None:  # noqa: B027
        pass

    def on_request_finished(  # noqa: B027
        self, chain: Sequence[Key], answer_tokens: int, now: float | None = None
    ) -> None:
        pass


POLICY_REGISTRY: dict[str, type[EvictionPolicy]] = {}


def register_policy(cls: type[EvictionPolicy]) -> type[EvictionPolicy]:
    """Class decorator: make a policy selectable by its `name`."""
    if not cls.name:
        raise ValueError(f"{cls.__name__} has no name")
    POLICY_REGISTRY[cls.name] = cls
    return cls


#: the policies kvtier ships: name -> the module that registers it, imported on first use of that name only
_PKG = "kvtier.storage_backends.eviction"
POLICY_MODULES: dict[str, str] = {
    "lru": f"{_PKG}.lru", "fifo": f"{_PKG}.fifo", "lfu": f"{_PKG}.lfu", "arc": f"{_PKG}.arc",
    "s3fifo": f"{_PKG}.s3fifo", "adaptive": f"{_PKG}.adaptive", "answer-length": f"{_PKG}.answer_length.policy",
    "belady": f"{_PKG}.belady",
}
#: shipped policies that need the future: offline replays only (their classes say `production = False`)
OFFLINE_POLICIES = frozenset({"belady"})


def policy_class(name: str) -> type[EvictionPolicy] | None:
    """The class registered as `name` (importing its module if it is a shipped policy not loaded yet), or None."""
    cls = POLICY_REGISTRY.get(name)
    if cls is None and name in POLICY_MODULES:
        import importlib

        importlib.import_module(POLICY_MODULES[name])
        cls = POLICY_REGISTRY.get(name)
    return cls


def policy_names() -> list[str]:
    """Every policy name: the shipped ones and any registered from outside."""
    return sorted(set(POLICY_MODULES) | set(POLICY_REGISTRY))


def production_policy_names() -> list[str]:
    """The names a production tier accepts (without importing the shipped policies' modules)."""
    return sorted(n for n in policy_names()
                  if (n not in OFFLINE_POLICIES if n in POLICY_MODULES else POLICY_REGISTRY[n].production))


def make_policy(name: str, *, production: bool = True, **kwargs: Any) -> EvictionPolicy:
    """Build the policy registered as `name`; `production=True` refuses offline-only policies."""
    cls = policy_class(name)
    if cls is None:
        raise ValueError(f"unknown eviction policy {name!r}; choose one of {policy_names()}")
    if production and not cls.production:
        raise ValueError(f"eviction policy {name!r} needs the future and only runs in offline replays")
    return cls(**kwargs)
