"""`vllm.general_plugins` entry point: registers "KVTierConnector" with vLLM's KVConnectorFactory and routes
kvtier's log lines through vLLM's logging.

With it, `"kv_connector": "KVTierConnector"` works without `kv_connector_module_path`. vLLM loads general plugins
in every process (API server, engine core, workers), so registration must be idempotent and must not import heavy
modules.

Logging: vLLM gives its own `vllm` logger a handler and leaves the root logger bare, so under `vllm serve` a
plugin's INFO lines go nowhere. `attach_vllm_logging` hands the `kvtier` logger vLLM's handlers (same format,
stream and level; `VLLM_LOGGING_LEVEL=DEBUG` shows kvtier's debug lines too). It does nothing when vLLM's logging
is off (`VLLM_CONFIGURE_LOGGING=0`, or a custom config without a `vllm` handler) or when the application already
configured the `kvtier` logger.
"""

from __future__ import annotations

import logging

from kvtier.compat.vllm_connector_registry import is_registered

logger = logging.getLogger(__name__)

NAME = "KVTierConnector"
#: the module path a `--kv-transfer-config` may name (`kv_connector_module_path`)
MODULE = "kvtier.connector"


def attach_vllm_logging() -> bool:
    """Give the `kvtier` logger vLLM's handlers (once); True if it now has them."""
    kv, vl = logging.getLogger("kvtier"), logging.getLogger("vllm")
    if kv.handlers or not vl.handlers:
        return False
    for h in vl.handlers:
        kv.addHandler(h)
    kv.setLevel(min((h.level for h in vl.handlers if h.level), default=logging.INFO) or logging.INFO)
    kv.propagate = False  # as vLLM's own logger: a root handler set up by the application prints nothing twice
    return True


def register() -> None:
    """Register kvtier's connector with vLLM (once per process) and route kvtier's log lines through vLLM's."""
    attach_vllm_logging()
    try:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    except Exception:  # pragma: no cover - vLLM without KV transfer
        logger.debug("kvtier: vLLM's KVConnectorFactory is unavailable; connector not registered")
        return
    if is_registered(KVConnectorFactory, NAME):
        return
    KVConnectorFactory.register_connector(NAME, "kvtier.connector.kvtier_connector", NAME)
