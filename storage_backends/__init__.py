"""kvtier's storage side, one subpackage per subsystem:
- `ssd/`: the SSD tier (`SSDTier`, composed of `SlotIndex`, no I/O, and `SlotIO`);
- `lmcache/`: kvtier inside LMCache (the storage plugin, the multiprocess-mode L2 adapter, host-tier policies, the
  page-first GPU connectors);
- `shared/`: the tier several engines share through LMCache's remote backend;
- `eviction/`: the eviction policies every tier, the replay and the simulator run;
- `admission/`: write admission, which chunks the SSD tier and the shared tier write (`kvtier.ssd_admission`);
and, here, the shared storage contracts (`base`: `ChunkTier`, `ChunkMeta`, `TierStats`), the `kvtier.*` settings
(`config`) and the storage metrics (`metrics`).

The module paths users name in configs are re-exported here, imported lazily (the policies and the replay tools work
without LMCache installed): `KVTierBackend` (`storage_plugin.kvtier.module_path: kvtier.storage_backends`),
`SSDTier`, `ChunkMeta` and `SlotIndex`; `lmcache_mp_adapter` re-exports the L2 adapter LMCache's `--l2-adapter`
JSON names.
"""

__all__ = ["ChunkMeta", "KVTierBackend", "SSDTier", "SlotIndex"]

_WHERE = {
    "KVTierBackend": "kvtier.storage_backends.lmcache.backend",
    "SSDTier": "kvtier.storage_backends.ssd.tier",
    "ChunkMeta": "kvtier.storage_backends.base",
    "SlotIndex": "kvtier.storage_backends.ssd.index",
}


def __getattr__(name: str):
    if name in _WHERE:
        import importlib

        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(name)
