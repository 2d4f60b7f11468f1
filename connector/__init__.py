"""kvtier.connector: the vLLM KV connector (`KVTierConnector`) serving KV from kvtier's host and SSD tiers.

`kv_connector_module_path: kvtier.connector` loads `KVTierConnector` from here (imported lazily: importing this
package does not import vLLM).
"""

__all__ = ["KVTierConnector"]


def __getattr__(name: str):
    if name == "KVTierConnector":
        from kvtier.connector.kvtier_connector import KVTierConnector

        return KVTierConnector
    raise AttributeError(name)
