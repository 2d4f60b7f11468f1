"""kvtier's storage side: the SSD tier, its LMCache adapters, configuration and eviction policies.

Public classes, imported lazily (the policies and the replay tools work without LMCache installed):
- `SSDTier` (`ssd_tier`): the SSD tier, composed of `SlotIndex` (`ssd_index`, no I/O) and `SlotIO` (`ssd_io`);
- `ChunkMeta`: what the tier records about a chunk besides its bytes;
- `KVTierBackend` (`lmcache_backend`): the in-process LMCache storage plugin named in
  `storage_plugin.kvtier.class_name`.
"""

__all__ = ["ChunkMeta", "KVTierBackend", "SSDTier", "SlotIndex"]

_WHERE = {
    "KVTierBackend": "kvtier.storage_backends.lmcache.backend",
    "SSDTier": "kvtier.storage_backends.ssd.tier",
    "ChunkMeta": "kvtier.storage_backends.ssd.index",
    "SlotIndex": "kvtier.storage_backends.ssd.index",
}


def __getattr__(name: str):
    if name in _WHERE:
        import importlib

        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(name)
