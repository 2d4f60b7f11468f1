"""The shared storage contracts: what the adapters and the connector depend on, rather than a concrete tier.

- `ChunkMeta`: what a tier records about a chunk besides its bytes (size, shape, dtype, memory format, extras).
- `TierStats`: a chunk tier's exact counters (tests read them; Prometheus gets the same increments).
- `ChunkTier`: the chunk tier the LMCache plugin, the MP-mode L2 adapter, vLLM's secondary tier and the connector's
  worker side use; `kvtier.storage_backends.ssd.tier.SSDTier` is the one that ships. Only the construction of a
  tier names the concrete class.
- `HostTier`: what kvtier uses of LMCache's host tier (`LocalCPUBackend`, LMCache 0.5.5 and 0.5.6).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, MutableMapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from kvtier.storage_backends.eviction import EvictionPolicy

__all__ = ["ChunkMeta", "ChunkTier", "HostTier", "Put", "TierStats"]


@dataclass(frozen=True)
class ChunkMeta:
    """What the tier records about a chunk besides its bytes."""

    nbytes: int
    shape: tuple[int, ...]
    dtype: str
    fmt: str
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class TierStats:
    """Exact per-tier counters (tests read these; Prometheus gets the same increments)."""

    committed: int = 0
    duplicate_puts: int = 0
    cancelled_puts: int = 0  #: queued writes cancelled by `remove()` before they committed
    dropped_backpressure: int = 0
    dropped_no_space: int = 0
    dropped_io_error: int = 0
    dropped_too_large: int = 0
    dropped_invalid: int = 0  #: keys or metadata that cannot be encoded (a lone surrogate in a key...)
    dropped_shutdown: int = 0  #: queued writes dropped by `SSDTier.close(drain=False)`
    hits: int = 0
    misses: int = 0
    corrupt: int = 0
    layout_mismatch: int = 0
    evictions: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    pins_expired: int = 0
    journal_damaged_records: int = 0
    journal_records_dropped: int = 0
    journal_write_errors: int = 0
    foreign_evicted: int = 0  #: chunks of another namespace reclaimed for new chunks

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


#: a chunk to store: (key, metadata, its bytes, `on_done(ok)` called once the write committed or failed)
Put = tuple[str, ChunkMeta, memoryview, Callable[[bool], None]]


@runtime_checkable
class ChunkTier(Protocol):
    """A persistent, capacity-bounded store of KV chunks under string keys (the members its users call).

    Keys are the caller's own: the tier qualifies them with its namespace. Nothing raises into the caller once the
    tier has started: a failed write is `on_done(False)` (or a False verdict), a failed read a miss."""

    @property
    def directory(self) -> str:
        """Where the tier keeps its files."""
        ...

    @property
    def chunk_bytes(self) -> int:
        """Bytes of one chunk's KV."""
        ...

    @property
    def slot_size(self) -> int:
        """Bytes of one slot (its header and the chunk, aligned)."""
        ...

    @property
    def max_slots(self) -> int:
        """The slot budget in force (the configured capacity, lower while the disk is full)."""
        ...

    @property
    def io_engine(self) -> str:
        """The I/O engine reads and writes go through (`posix` or `kvikio`)."""
        ...

    @property
    def stats(self) -> TierStats:
        ...

    @property
    def policy(self) -> EvictionPolicy:
        """The eviction policy the tier runs."""
        ...

    @property
    def reads_into_device(self) -> bool:
        """Whether `read_batch_into_device` can read straight into device memory."""
        ...

    def __len__(self) -> int:
        ...

    # lookups and pins
    def contains(self, key: str, pin: bool = False) -> bool:
        ...

    def prefix_contains(self, keys: Sequence[str], pin: bool = False, *, request: bool = False) -> int:
        """How many leading keys are stored (`request`: a request's lookup of its whole prefix chain)."""
        ...

    def pin(self, key: str) -> bool:
        ...

    def unpin(self, key: str) -> bool:
        ...

    def exists_in_put_tasks(self, key: str) -> bool:
        """A write of the key is queued or in progress."""
        ...

    def remove(self, key: str) -> bool:
        """Remove the stored chunk and cancel a queued write of it; True if there was either."""
        ...

    def keys(self) -> list[str]:
        ...

    def used_bytes(self) -> int:
        ...

    def demote(self, keys: Sequence[str]) -> int:
        """Never serve these chunks again, reclaim them first; returns how many were stored."""
        ...

    def add_drop_listener(self, fn: Callable[[str, int, str], None]) -> None:
        """`fn(key, nbytes, reason)` whenever a committed chunk leaves the tier (runs under the tier's lock)."""
        ...

    # writes
    def submit_puts(self, puts: Sequence[Put]) -> list[bool]:
        """Queue chunks for writing; False where one is not queued (and its `on_done` is never called)."""
        ...

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued write has committed or failed."""
        ...

    # reads
    def read_batch(self, keys: Sequence[str], alloc: Callable[[str, ChunkMeta], tuple[memoryview, Any] | None],
                   release: Callable[[Any], None]) -> list[Any]:
        """Read chunks into destinations from `alloc(key, meta) -> (buffer, handle)`; the handles (None: a miss)."""
        ...

    def read_batch_into_device(self, keys: Sequence[str], dest: Callable[[str, ChunkMeta], Any]) -> list[bool]:
        """Read chunks straight into the device tensors `dest(key, meta)` names; True where one arrived whole."""
        ...

    # lifecycle
    def close(self, *, drain: bool = True) -> None:
        ...


class HostCachePolicy(Protocol):
    """The one call of LMCache's host-tier cache policy (`BaseCachePolicy`) that kvtier makes: a chunk was read."""

    def update_on_hit(self, key: Any, cache_dict: Any) -> None: ...


class HostTier(Protocol):
    """LMCache's `LocalCPUBackend` as kvtier uses it: keys are LMCache `CacheEngineKey`s, chunks `MemoryObj`s (typed
    `Any` here, so that this module imports without LMCache). `get_blocking` and `allocate` hand the caller one
    reference of the object; `pin`/`unpin` protect a chunk from eviction."""

    #: the chunks held, by key (kvtier reads its size and the objects' `can_evict`)
    hot_cache: MutableMapping[Any, Any]
    #: LMCache's lock around `hot_cache` and every call into `cache_policy`
    cpu_lock: AbstractContextManager[Any]
    #: the eviction policy LMCache runs over `hot_cache` (its own, or kvtier's through `KVTIER_<NAME>`)
    cache_policy: HostCachePolicy

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
