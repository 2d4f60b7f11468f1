"""The one module that reaches into LMCache's internals, beyond the interfaces LMCache offers a plugin
(`StoragePluginInterface`, `L2AdapterInterface`, the GPU connector and cache-policy interfaces).

Written against LMCache 0.5.5 and 0.5.6 (the versions `compat/matrix.toml` tests), which agree on every name used
here: each is read directly. What it reaches into:
- `LMCacheEngine.storage_manager` (`StorageManager`): `storage_backends` (an OrderedDict, name -> backend; the host
  tier is "LocalCPUBackend"), `manager_lock`, `set_backend_bypass`, `get_non_allocator_backends` and
  `non_allocator_backends`; `LMCacheEngine.config.remote_serde`;
- `LMCacheEngineBuilder._instances` (the engines by instance id: the one place that holds a storage plugin's
  manager);
- backends: `AuditBackend.real_backend`; `RemoteBackend.connection`, `.loop`, `.remote_url`, `.close()`;
- a remote backend's connector: `InstrumentedRemoteConnector.getWrappedConnector()`, and what some connector
  classes have and others lack (a difference of classes, not of versions, so probed): `local_cpu_backend` (the host
  tier it stages reads in), `pq_executor` (an `AsyncPQExecutor`) and the Redis clients `connection` / `cluster`;
- `LocalCPUBackend` (`HostTier`, `storage_backends/base.py`): its `allocate`, `batched_allocate` and `close` are
  replaced on the instance (LMCache's manager and connectors call the pool through these attributes); so are
  `contains` and `pin` while the host tier's policy stream is recorded (`hook_host_lookups`); its `cpu_lock` and
  `cache_policy.update_on_hit` tell the policy what a load read (`report_host_hits`).

LMCache is imported inside the functions: the shared tier imports this module, and imports without LMCache.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, cast

from kvtier.storage_backends.base import ChunkTier, HostTier
from kvtier.storage_backends.config import ConfigError

if TYPE_CHECKING:
    from kvtier.storage_backends.lmcache.backend import KVTierBackend

logger = logging.getLogger(__name__)

#: the name LMCache gives its host tier among an engine's storage backends
HOST_TIER = "LocalCPUBackend"

Backends = collections.OrderedDict[str, Any]


# ------------------------------------------------------------------ the engine's tiers
def find_host_tier(engine: Any) -> HostTier | None:
    """LMCache's host tier of an engine (None when it runs without one: `local_cpu: false`)."""
    return cast("HostTier | None", engine.storage_manager.storage_backends.get(HOST_TIER))


def host_tier(engine: Any) -> HostTier:
    """LMCache's host tier of an engine; a ConfigError when LMCache started without it."""
    host = find_host_tier(engine)
    if host is None:
        raise ConfigError("LMCache started without its host tier (LocalCPUBackend); set local_cpu: true")
    return host


def kvtier_plugin(engine: Any) -> KVTierBackend | None:
    """kvtier's storage plugin among an engine's backends (None if LMCache did not load it)."""
    from kvtier.storage_backends.lmcache.backend import KVTierBackend

    for b in engine.storage_manager.storage_backends.values():
        if isinstance(b, KVTierBackend):
            return b
    return None


def plugin_ssd_tier(plugin: KVTierBackend) -> ChunkTier:
    """The SSD tier kvtier's storage plugin owns; a ValueError in the scheduler role (the plugin has none there)."""
    if plugin.tier is None:
        raise ValueError("the kvtier plugin runs without an SSD tier (scheduler role)")
    return plugin.tier


# ------------------------------------------------------------------ the host tier's entry points
def hook_host_allocators(host: HostTier, allocate: Callable[..., Any], batched_allocate: Callable[..., Any]
                         ) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """Route the host pool's `allocate` / `batched_allocate` through the given callables (instance attributes: LMCache's
    storage manager, its connectors and kvtier's plugin call the pool through them); returns LMCache's own two."""
    original = host.allocate, host.batched_allocate
    host.allocate = allocate  # type: ignore[method-assign]
    host.batched_allocate = batched_allocate  # type: ignore[method-assign]
    return original


def hook_host_lookups(host: HostTier, scope: Callable[[str], AbstractContextManager[None]]) -> None:
    """Run the host tier's lookups (`contains`, `pin`: whoever calls them, kvtier or LMCache) inside `scope(name)`
    (the recording of the host tier's policy stream: `eviction/recording.py`)."""
    contains, pin = host.contains, host.pin

    def scoped_contains(key: Any, pin: bool = False) -> bool:
        with scope("contains"):
            return contains(key, pin)

    def scoped_pin(key: Any) -> bool:
        with scope("pin"):
            return pin(key)

    host.contains = scoped_contains  # type: ignore[method-assign]
    host.pin = scoped_pin  # type: ignore[method-assign]


def report_host_hits(host: HostTier, keys: Sequence[Any]) -> int:
    """Tell the host tier's eviction policy that a load read `keys` (a request's prefix, in order), as LMCache's own
    lookup does after it pins a prefix (`LocalCPUBackend.touch_cache`): last chunk first, so that a prefix's head
    is the most recent. kvtier's connector pins and reads through other calls, which never reach the policy:
    without this its LRU would evict in insertion order. Keys the tier no longer holds are skipped; returns how
    many were reported."""
    n = 0
    with host.cpu_lock:
        for key in reversed(keys):
            if key in host.hot_cache:
                host.cache_policy.update_on_hit(key, host.hot_cache)
                n += 1
    return n


def run_before_host_closes(host: HostTier, hook: Callable[[], None]) -> None:
    """Run `hook` when LMCache closes its host tier, before the tier's own close frees the pool (LMCache's
    StorageManager closes LocalCPUBackend first, and that close unmaps the pool's memory)."""
    close_pool = host.close

    def close() -> None:
        try:
            hook()
        finally:
            close_pool()

    host.close = close  # type: ignore[method-assign]


# ------------------------------------------------------------------ the backend order
def unwrapped(backend: Any) -> Any:
    """The backend itself, out of LMCache's `AuditBackend` wrapper (`audit_backend_enabled`) where it is in one."""
    from lmcache.v1.storage_backend.audit_backend import AuditBackend

    return backend.real_backend if isinstance(backend, AuditBackend) else backend


def is_remote_backend(backend: Any) -> bool:
    """Whether a backend (audited or not) is one of LMCache's remote backends (`remote_url`,
    `remote_storage_plugins`)."""
    from lmcache.v1.storage_backend.remote_backend import RemoteBackend

    return isinstance(unwrapped(backend), RemoteBackend)


def remote_backends(engine: Any) -> list[tuple[str, Any]]:
    """(name, backend) of every LMCache RemoteBackend of an engine, in LMCache's order."""
    from lmcache.v1.storage_backend.remote_backend import RemoteBackend

    return [(n, b) for n, b in engine.storage_manager.storage_backends.items() if isinstance(b, RemoteBackend)]


def owning_storage_manager(backend: Any) -> Any:
    """The StorageManager whose backends include `backend` (by identity), among the engines of LMCache's
    `LMCacheEngineBuilder` (how vLLM's LMCacheConnectorV1 and kvtier's connector build them); None if none does yet.
    LMCache hands a storage plugin no handle on its manager; the builder's registry is the one place holding it."""
    from lmcache.v1.cache_engine import LMCacheEngineBuilder

    for engine in list(LMCacheEngineBuilder._instances.values()):
        manager = engine.storage_manager
        if manager is not None and any(unwrapped(b) is backend for b in list(manager.storage_backends.values())):
            return manager
    return None


def engine_storage_manager(engine: Any) -> Any:
    """An engine's StorageManager."""
    return engine.storage_manager


def swap_backend_order(manager: Any, reorder: Callable[[Backends], Backends | None], blocking: bool
                       ) -> tuple[bool, list[str]] | None:
    """Swap in `reorder(backends)` as a StorageManager's backends, under its `manager_lock`: (whether it changed, the
    names in force now); None when `blocking` is False and the lock is busy. `reorder` returns None to leave the
    order as it is.

    The new order is a new dict, never the old one reordered in place: LMCache walks `storage_backends` without that
    lock (on engine threads and on its event loop), and an OrderedDict moved during a walk raises `RuntimeError:
    OrderedDict mutated during iteration` there; a walk under way finishes on the old dict."""
    if not manager.manager_lock.acquire(blocking=blocking):
        return None
    try:
        order = reorder(manager.storage_backends)
        if order is None:
            return False, list(manager.storage_backends)
        manager.storage_backends = order
        manager.non_allocator_backends = manager.get_non_allocator_backends()
        return True, list(order)
    finally:
        manager.manager_lock.release()


# ------------------------------------------------------------------ the remote backend as kvtier's shared tier
def remote_serde(engine: Any) -> str | None:
    """How LMCache serialises chunks for its remote backends (`remote_serde`: "naive" stores them as they are)."""
    return cast("str | None", engine.config.remote_serde)


def bypass_backend(engine: Any, name: str) -> None:
    """Take a backend out of LMCache's own walk (`StorageManager.set_backend_bypass`); it stays in its list."""
    engine.storage_manager.set_backend_bypass(name, True)


def drop_backend(engine: Any, name: str) -> None:
    """Take a backend out of an engine's list (LMCache then never calls its `close`)."""
    manager = engine.storage_manager
    with manager.manager_lock:
        manager.storage_backends.pop(name, None)


def store_name(remote: Any) -> str:
    """How a remote backend names its store (its `remote_url`, or `plugin://<name>`)."""
    return str(remote.remote_url)


def store_client(remote: Any) -> Any | None:
    """A remote backend's connector itself, out of LMCache's instrumentation wrapper (None: no connection)."""
    from lmcache.v1.storage_backend.connector.instrumented_connector import InstrumentedRemoteConnector

    inner = remote.connection
    while isinstance(inner, InstrumentedRemoteConnector):
        inner = inner.getWrappedConnector()
    return inner


class _NoWaitAllocator:
    """The host tier's allocator as a connector sees it, but never busy-waiting for room: LMCache's remote
    connectors allocate with `busy_loop=True`, which loops forever when every chunk of a full host pool is
    pinned; here a full pool makes the read a miss instead."""

    def __init__(self, host: HostTier) -> None:
        self._host = host

    def allocate(self, shapes: Any, dtypes: Any, fmt: Any = None, eviction: bool = True,
                 busy_loop: bool = True) -> Any:
        return self._host.allocate(shapes, dtypes, fmt, eviction=eviction, busy_loop=False)

    def __getattr__(self, name: str) -> Any:  # every other member: the host tier's own
        return getattr(self._host, name)


def stage_reads_without_waiting(client: Any, host: HostTier) -> None:
    """Make a store connector's reads allocate in the host tier without waiting for room (a full pool: a miss).
    Only the connector classes that stage reads in the host tier have a `local_cpu_backend` (Redis, Valkey, S3, ...
    do; the class decides, not the LMCache version)."""
    if hasattr(client, "local_cpu_backend"):
        client.local_cpu_backend = _NoWaitAllocator(host)


def close_store_client(remote: Any, client: Any = None, loop: asyncio.AbstractEventLoop | None = None) -> None:
    """Close an LMCache RemoteBackend's connection without LMCache's own `close()` (see `SharedTier.close`)."""
    from lmcache.v1.storage_backend.job_executor.pq_executor import AsyncPQExecutor

    client = client if client is not None else store_client(remote)
    if client is None:
        return
    loop = loop or remote.loop

    def run(coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, loop).result(5.0)

    # The connectors that run their calls on an AsyncPQExecutor (the Redis family, S3, ...) are closed here: their
    # own close() blocks LMCache's loop. Which attributes a connector has depends on its class.
    pq = getattr(client, "pq_executor", None)
    if isinstance(pq, AsyncPQExecutor):
        try:
            run(pq.shutdown_async(True))
        except Exception:  # noqa: BLE001
            logger.debug("kvtier: shutting down the store client's executor failed", exc_info=True)
        for attr in ("connection", "cluster"):  # RedisConnector's client, RedisClusterConnector's
            redis_client = getattr(client, attr, None)
            closer = getattr(redis_client, "aclose", None) or getattr(redis_client, "close", None)
            if closer is None:
                continue
            try:
                res = closer()
                if asyncio.iscoroutine(res):
                    run(res)
            except Exception:  # noqa: BLE001
                logger.debug("kvtier: closing the store connection failed", exc_info=True)
        remote.connection = None
        return
    t = threading.Thread(target=remote.close, name="kvtier-shared-close", daemon=True)
    t.start()
    t.join(10.0)
    if t.is_alive():
        logger.warning("kvtier: closing the shared store connection did not finish within 10 s")
    remote.connection = None
