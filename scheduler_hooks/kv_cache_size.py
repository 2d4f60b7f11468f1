"""The model's KV bytes per token, read from vLLM's KV cache config (`KVCacheConfig`: every layer of every KV cache
group, each group's page bytes over its block size). One rank's share under tensor parallelism, as the engine holds
it. None when the config does not say (an older vLLM that passes none, or a spec without page sizes).

Used by the dual-queue hook (the load plan's cost model) and by the connector's scheduler side (the bytes budget of
loads inside an engine step). Reads attributes only; no vLLM import.
"""

from __future__ import annotations

from typing import Any

__all__ = ["kv_bytes_per_token"]


def kv_bytes_per_token(kv_cache_config: Any) -> int | None:
    """KV bytes per token of `kv_cache_config` (vLLM's KVCacheConfig), or None if it does not say."""
    if kv_cache_config is None:
        return None
    try:
        total = sum(len(g.layer_names) * g.kv_cache_spec.page_size_bytes / g.kv_cache_spec.block_size
                    for g in kv_cache_config.kv_cache_groups)
    except (AttributeError, TypeError, ZeroDivisionError):
        return None
    return int(total) if total > 0 else None
