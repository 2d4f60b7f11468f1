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


def production_policy_names() -> list[str]:
    _load_all()
    return sorted(n for n, c in POLICY_REGISTRY.items() if c.production)


def make_policy(name: str, *, production: bool = True, **kwargs) -> EvictionPolicy:
    """Build the policy registered as `name`; `production=True` refuses offline-only policies."""
    _load_all()
    try:
        cls = POLICY_REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"unknown eviction policy {name!r}; choose one of {sorted(POLICY_REGISTRY)}"
        ) from None
    if production and not cls.production:
        raise ValueError(f"eviction policy {name!r} needs the future and only runs in offline replays")
    return cls(**kwargs)


def _load_all() -> None:
    """Import every policy module in this package so that its @register_policy runs."""
    import importlib
    import pkgutil

    import kvtier.storage_backends.eviction as pkg

    for mod in pkgutil.iter_modules(pkg.__path__):
        if mod.name not in ("base",):
            importlib.import_module(f"{pkg.__name__}.{mod.name}")
