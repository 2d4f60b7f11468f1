"""Hits by tier in vLLM's own metrics: the one connector-interface difference between vLLM 0.31 and 0.32+.

- vLLM >= 0.32 asks a connector `get_external_cache_hit_sources(request, n)` after each admission and counts the
  split in `vllm:prompt_tokens_cached_by_source{source}` (`CacheHitSource.HOST`, `.DISK`, ...).
- vLLM 0.31 has neither the method nor `CacheHitSource`: a connector's external hits are one number there, and
  kvtier's own `kvtier_connector_hit_tokens_total{tier}` is the only split by tier.

`hit_source_labels()` answers which applies; the connector's scheduler side maps its host/SSD split through it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class HitSourceLabelsVllm032:
    """vLLM >= 0.32: the labels the connector reports its host-tier and SSD-tier hits under."""

    host: Any
    disk: Any
    remote: Any  #: hits from the tier shared by several engines (vLLM has no label of its own for it)


def hit_source_labels() -> HitSourceLabelsVllm032 | None:
    """The labels of the installed vLLM, or None on vLLM 0.31 (no split by source there)."""
    try:
        from vllm.v1.metrics.cache_hit_source import CacheHitSource
    except ImportError:  # vLLM 0.31
        return None
    return HitSourceLabelsVllm032(host=CacheHitSource.HOST, disk=CacheHitSource.DISK,
                                  remote=CacheHitSource.EXTERNAL_UNSPECIFIED)
