"""Namespaces of tier keys: a fingerprint (`ModelFingerprint.namespace`) names every chunk a tier writes for it.

A tier key is `<namespace>/<key>`; the adapters above a tier only ever see `<key>`. Chunks of another namespace
(other weights, config, KV dtype, layout, parallelism or chunk size; or written before namespaces existed) are
*foreign*: never found by a lookup, reported at start with their count and size, and reclaimed first when the tier
needs a slot (before the eviction policy picks any chunk of its own).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["KeyNamespace", "namespace_of"]

SEPARATOR = "/"
#: the namespace reported for keys written without one (kvtier before namespaces)
UNNAMED = "(none)"
#: what a fingerprint's namespace looks like (`ModelFingerprint.namespace`)
_NAMESPACE = re.compile(r"m[0-9a-f]{20}")


def namespace_of(tier_key: str) -> str:
    """The fingerprint namespace of a tier key (UNNAMED for a key without one)."""
    ns, sep, _ = tier_key.partition(SEPARATOR)
    return ns if sep and _NAMESPACE.fullmatch(ns) else UNNAMED


@dataclass(frozen=True)
class KeyNamespace:
    """`name` "" keeps keys as they are (a tier without a namespace: tests, replays)."""

    name: str = ""

    def __post_init__(self) -> None:
        if SEPARATOR in self.name or "@" in self.name:
            raise ValueError(f"a namespace cannot contain {SEPARATOR!r} or '@': {self.name!r}")

    @property
    def prefix(self) -> str:
        return self.name + SEPARATOR if self.name else ""

    def qualify(self, key: str) -> str:
        return self.prefix + key if self.name else key

    def owns(self, tier_key: str) -> bool:
        return not self.name or tier_key.startswith(self.prefix)

    def strip(self, tier_key: str) -> str:
        """The adapter's key of one of this namespace's tier keys."""
        return tier_key[len(self.prefix):] if self.name else tier_key
