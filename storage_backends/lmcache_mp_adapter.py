"""The module path LMCache's `--l2-adapter` JSON names (`configs/lmcache-mp-l2-kvtier.json`): a re-export of
`kvtier.storage_backends.lmcache.mp_adapter`, where the adapter lives."""

from kvtier.storage_backends.lmcache.mp_adapter import KVTierL2Adapter, KVTierL2AdapterConfig

__all__ = ["KVTierL2Adapter", "KVTierL2AdapterConfig"]
