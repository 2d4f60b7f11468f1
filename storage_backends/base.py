"""`HostTier`: what kvtier uses of LMCache's host tier (`LocalCPUBackend`, LMCache 0.5.5 and 0.5.6)."""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any, Protocol


class HostTier(Protocol):
    """LMCache's `LocalCPUBackend` as kvtier uses it: keys are LMCache `CacheEngineKey`s, chunks `MemoryObj`s (typed
    `Any` here, so that this module imports without LMCache). `get_blocking` and `allocate` hand the caller one
    reference of the object; `pin`/`unpin` protect a chunk from eviction."""

    #: the chunks held, by key (kvtier reads its size and the objects' `can_evict`)
    hot_cache: MutableMapping[Any, Any]

    def allocate(self, shapes: Any, dtypes: Any, fmt: Any = None, eviction: bool = True,
                 busy_loop: bool = True) -> Any: ...

    def batched_allocate(self, shapes: Any, dtypes: Any, batch_size: int, fmt: Any = None, eviction: bool = True,
                         busy_loop: bool = True) -> list[Any] | None: ...

    def contains(self, key: Any, pin: bool = False) -> bool: ...

    def pin(self, key: Any) -> bool: ...

    def unpin(self, key: Any) -> bool: ...

    def get_blocking(self, key: Any) -> Any: ...

    def submit_put_task(self, key: Any, memory_obj: Any) -> Any: ...

    def close(self) -> None: ...
