"""LMCache's storage-backend order, the one place kvtier rearranges it: kvtier's storage plugin ahead of LMCache's
remote backends, so LMCache's own lookups and retrieves read the local SSD tier before the shared store.

LMCache (0.5.5, 0.5.6, the versions the matrix tests) keeps a `StorageManager.storage_backends` OrderedDict, builds
storage plugins after remote backends, and gives a plugin no handle on its manager; this module finds the manager
(`owning_storage_manager`, through `LMCacheEngineBuilder`'s registry), swaps in the local-first order under the
manager's lock (`arrange_local_first`), and keeps doing so for a plugin on its own (`LocalFirstOrder`). What it
reaches into LMCache for (the manager, its lock, the swap) is in `engine_access`; this module holds the rule.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Any

from kvtier.storage_backends.lmcache.engine_access import (
    Backends,
    engine_storage_manager,
    is_remote_backend,
    owning_storage_manager,
    swap_backend_order,
    unwrapped,
)

logger = logging.getLogger(__name__)


def arrange_local_first(engine: Any) -> bool:
    """Move kvtier's storage plugin ahead of LMCache's remote backends in an engine's backend order, so LMCache's
    own lookups and retrieves ask the local SSD tier before the network. The plugin does this itself
    (`LocalFirstOrder`); this is for code that holds the engine and wants it done at once. Returns whether anything
    moved."""
    return bool(_arrange_local_first_in(engine_storage_manager(engine), blocking=True))


def _local_first_order(backends: Backends) -> Backends | None:
    """`backends` with kvtier's plugin(s) moved just ahead of the first remote backend (every other backend keeps
    its place and order), or None when they already stand before every remote backend (or either is absent)."""
    from kvtier.storage_backends.lmcache.backend import KVTierBackend

    names = list(backends)
    remote = [i for i, n in enumerate(names) if is_remote_backend(backends[n])]
    mine = [i for i, n in enumerate(names) if isinstance(unwrapped(backends[n]), KVTierBackend)]
    if not remote or not mine or max(mine) < remote[0]:
        return None
    order = names[:remote[0]] + [names[i] for i in mine if i > remote[0]]
    order += [n for i, n in enumerate(names[remote[0]:], remote[0]) if i not in mine]
    return Backends((n, backends[n]) for n in order)


def _arrange_local_first_in(manager: Any, blocking: bool) -> bool | None:
    """`arrange_local_first` on a StorageManager; None when `blocking` is False and its lock is busy (the swap:
    `engine_access.swap_backend_order`)."""
    swapped = swap_backend_order(manager, _local_first_order, blocking)
    if swapped is None:
        return None
    moved, order = swapped
    if moved:
        logger.info("kvtier: LMCache backend order is now %s (local tiers before the shared store)", order)
    return moved


class LocalFirstOrder:
    """Keeps one kvtier storage plugin ahead of its LMCache engine's remote backends, with no caller's help.

    LMCache (0.5.5, 0.5.6) builds storage plugins after the remote backends (`remote_url`,
    `remote_storage_plugins`), walks its backends in that order for lookups and gets, and gives a plugin no handle
    on its StorageManager. So the plugin finds its manager (`owning_storage_manager`) once the engine has one and
    swaps in the local-first order (`arrange_local_first`'s rule), once:
    - `start(loop)`: from the plugin's constructor, on LMCache's event loop, every `POLL_S` until the engine's
      `post_init` has finished (for at most `POLL_FOR_S`): the first lookup may stop at a remote backend that holds
      every chunk without ever reaching the plugin, so waiting for the plugin's first call is not enough;
    - `ensure()`: at the plugin's lookups, gets and puts until done. LMCache calls those through the manager, so
      a manager not found then is never found (an engine LMCache's builder did not make): a WARNING says so and
      names the one-line fix.
    Never blocking (LMCache's event loop calls the plugin too): a busy lock means "next time". Never raising into
    LMCache: an error is logged as a WARNING and the order stays LMCache's."""

    POLL_S = 0.005
    POLL_FOR_S = 120.0

    def __init__(self, backend: Any) -> None:
        self._backend = backend
        self._lock = threading.Lock()
        self.done = False  #: nothing left to do (arranged, already in order, or given up with a WARNING)
        self.arranged = False  #: whether the plugin was moved ahead of a remote backend

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        deadline = time.monotonic() + self.POLL_FOR_S

        def poll() -> None:
            if not self._settle(final=False) and time.monotonic() < deadline:
                loop.call_later(self.POLL_S, poll)

        loop.call_soon_threadsafe(poll)

    def ensure(self) -> None:
        if not self.done:
            self._settle(final=True)

    def _settle(self, final: bool) -> bool:
        """One attempt; True once done."""
        if not self._lock.acquire(blocking=False):
            return self.done
        try:
            if self.done:
                return True
            manager = owning_storage_manager(self._backend)
            if manager is None:
                if final:
                    self.done = True
                    logger.warning(
                        "kvtier: no LMCache engine built by LMCacheEngineBuilder holds this storage plugin, so kvtier "
                        "cannot put its SSD tier ahead of LMCache's remote backend: chunks held on both are read "
                        "over the network. Call "
                        "kvtier.storage_backends.lmcache.backend_order.arrange_local_first(engine) after "
                        "engine.post_init()")
                return self.done
            moved = _arrange_local_first_in(manager, blocking=False)
            if moved is None:
                return False
            self.arranged, self.done = moved, True
        except Exception:  # noqa: BLE001 - never into LMCache's lookups or its event loop
            self.done = True
            logger.warning("kvtier: could not put the SSD tier ahead of LMCache's remote backend; chunks held on "
                           "both are read over the network", exc_info=True)
        finally:
            self._lock.release()
        return True
