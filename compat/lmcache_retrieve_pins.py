"""Who releases a lookup pin after a synchronous `LMCacheEngine.retrieve`: the one LMCache interface difference
between LMCache 0.5.4/0.5.5 and 0.5.6 that kvtier's connector meets.

kvtier's worker pins the host-tier chunks a request will load when the scheduler looks it up, and releases them
after the load (so they cannot be evicted in between).
- LMCache 0.5.6: a blocking retrieve takes references, not the lookup pins; the pin owner releases them.
- LMCache <= 0.5.5: a blocking retrieve also unpins every chunk it retrieved (once). Releasing those again would
  take the pin of another request waiting for the same chunks, which could then be evicted under it.

`for_installed()` picks the adapter; the worker asks it which of a request's pins are still its own to release.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Hashable, Iterable

from kvtier.compat.matrix import version_tuple


class RetrieveKeepsPinsLMCache056:
    """LMCache >= 0.5.6: every pin is still held after a retrieve."""

    consumes_pins = False

    def still_pinned(self, pinned: Iterable[Hashable], retrieved: Iterable[Hashable]) -> list[Hashable]:
        return list(pinned)


class RetrieveConsumesPinsLMCache055:
    """LMCache 0.5.4-0.5.5: the retrieve already released one pin of each chunk it retrieved."""

    consumes_pins = True

    def still_pinned(self, pinned: Iterable[Hashable], retrieved: Iterable[Hashable]) -> list[Hashable]:
        done = set(retrieved)
        return [k for k in pinned if k not in done]


def for_installed() -> RetrieveKeepsPinsLMCache056 | RetrieveConsumesPinsLMCache055:
    try:
        v = version_tuple(importlib.metadata.version("lmcache"))
    except importlib.metadata.PackageNotFoundError:
        v = ()
    return RetrieveConsumesPinsLMCache055() if v and v < (0, 5, 6) else RetrieveKeepsPinsLMCache056()
