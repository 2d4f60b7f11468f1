"""`vllm.general_plugins` entry point: registers "KVTierConnector" with vLLM's KVConnectorFactory.

With it, `"kv_connector": "KVTierConnector"` works without `kv_connector_module_path`. vLLM loads general plugins
in every process (engine core, workers), so registration must be idempotent and must not import heavy modules.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

NAME = "KVTierConnector"


def register() -> None:
    try:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    except Exception:  # pragma: no cover - vLLM without KV transfer
        logger.debug("kvtier: vLLM's KVConnectorFactory is unavailable; connector not registered")
        return
    if NAME in getattr(KVConnectorFactory, "_registry", {}):
        return
    KVConnectorFactory.register_connector(NAME, "kvtier.connector.kvtier_connector", NAME)
