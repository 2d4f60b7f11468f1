"""kvtier's storage side: the SSD tier, its LMCache plugin, configuration and eviction policies.

`KVTierBackend` (the LMCache plugin named in `storage_plugin.kvtier.class_name`) is imported lazily so that the
policies and the replay tools work without LMCache installed.
"""

__all__ = ["KVTierBackend"]


def __getattr__(name: str):
    if name == "KVTierBackend":
        from kvtier.storage_backends.lmcache_backend import KVTierBackend

        return KVTierBackend
    raise AttributeError(name)
