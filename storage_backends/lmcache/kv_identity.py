"""The KV identity of an LMCache engine's chunks in kvtier's SSD tier (`identity.model.ModelFingerprint`), from
what LMCache hands a storage plugin: its metadata (model name, KV shape and dtype, chunk size, world size and rank)
and kvtier's settings (chunk format, page size, a declared model identity).

Inside kvtier's connector the metadata's model name already is the connector's fingerprint (`FINGERPRINT_PREFIX`:
the weights, the engine's model config, dtype and quantization); elsewhere (vLLM's `LMCacheConnectorV1`) it is the
model's path or Hugging Face id, whose files are fingerprinted here.
"""

from __future__ import annotations

import logging
from typing import Any

from kvtier.identity.model import FINGERPRINT_PREFIX, ModelFingerprint, config_digest, read_config, weights_identity
from kvtier.storage_backends.config import KVTierConfig

logger = logging.getLogger(__name__)

__all__ = ["ConnectorFingerprint", "plugin_fingerprint", "under_kvtier_connector"]


class ConnectorFingerprint(ModelFingerprint):
    """The fingerprint the kvtier connector computed (from vLLM's config: more parts than LMCache's metadata has),
    carried in the engine's model name: its digest is the connector's."""

    @property
    def digest(self) -> str:
        return self.weights.digest


def under_kvtier_connector(metadata: Any) -> bool:
    """Whether the engine is the one kvtier's connector built (its keys then carry each request's identity)."""
    return str(metadata.model_name).startswith(FINGERPRINT_PREFIX)


def plugin_fingerprint(metadata: Any, cfg: KVTierConfig) -> ModelFingerprint:
    """The engine's fingerprint. Under kvtier's connector, the connector's own (its namespace: the same name in the
    connector's start-up line and the SSD tier's)."""
    layers, _kv, _chunk, heads, head_dim = (int(x) for x in metadata.kv_shape)
    model = str(metadata.model_name)
    weights = weights_identity(model, cfg.model_identity)
    if weights.source == "connector":
        return ConnectorFingerprint(weights, "", str(metadata.kv_dtype), cfg.chunk_format, int(metadata.chunk_size),
                                    int(metadata.world_size), int(metadata.worker_id))
    config = "" if weights.source == "connector" else config_digest(read_config(model))
    layout = cfg.chunk_format + (f"/p{cfg.page_tokens}" if cfg.chunk_format == "page_first" else "")
    layout += f" L{layers} H{heads}x{head_dim}" + (" mla" if bool(metadata.use_mla) else "")
    return ModelFingerprint(weights, config, str(metadata.kv_dtype), layout, int(metadata.chunk_size),
                            int(metadata.world_size), int(metadata.worker_id))
