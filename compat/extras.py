"""kvtier's optional extras at import time: an LMCache-only entry point (the storage plugin, the MP-mode L2 adapter,
the page-first GPU connectors) stops in one line naming `kvtier[lmcache]` where LMCache is not installed, instead
of a `ModuleNotFoundError` from deep inside. Everything else in kvtier imports without LMCache."""

from __future__ import annotations

import importlib.util

from kvtier.compat.guard import missing_lmcache_message


class MissingExtra(ImportError):
    """An optional dependency of kvtier is not installed; the message names the extra that brings it."""


def require_lmcache(component: str) -> None:
    """Raise `MissingExtra` (an `ImportError`) naming `kvtier[lmcache]` unless LMCache is importable."""
    try:
        found = importlib.util.find_spec("lmcache") is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise MissingExtra(missing_lmcache_message(component))
