"""kvtier.kernels: move KV pages between vLLM's paged, layer-first cache and a page-first host layout.

A *page* holds ``page_tokens`` tokens of every layer's K and V contiguously (``[2 * layers, tokens,
heads * head_dim]``), so many small pages move in one kernel launch per direction instead of one copy per
page per layer (Strata's GPU-assisted I/O).

* :mod:`.layout`: typed layout descriptions (vLLM backend shapes, the page-first format, transfer plans)
  and their validation.
* :mod:`.dispatch`: :class:`PageMover`, plan building from block ids or chunks, path choice by device.
* :mod:`.torch_ops`: vectorized torch path (CPU KV caches) and reference.
* :mod:`.triton_ops`: the one-launch Triton kernel (GPU; pinned host memory through UVA). Imported lazily,
  so this package imports with torch alone and ``TRITON_INTERPRET`` can still be set before triton loads.
* :mod:`.crc32` (:mod:`.crc32_triton` on GPU): zlib's CRC-32 of a buffer's segments where the bytes are, so the SSD
  tier verifies what kvikio read into GPU memory without copying it back.

The LMCache GPU connectors that use these kernels live in :mod:`kvtier.storage_backends.lmcache`.
"""

from .dispatch import HostChunk, PageMover, gather_pages, scatter_pages
from .layout import (
    SUPPORTED_DTYPES,
    KVLayoutKind,
    LayoutError,
    PagedKVLayout,
    PageFirstLayout,
    TransferPlan,
    canonical_view,
    describe_kv_caches,
    validate_plan,
    vllm_cache_shape,
)

__all__ = [
    "SUPPORTED_DTYPES",
    "HostChunk",
    "KVLayoutKind",
    "LayoutError",
    "PageFirstLayout",
    "PageMover",
    "PagedKVLayout",
    "TransferPlan",
    "canonical_view",
    "describe_kv_caches",
    "gather_pages",
    "scatter_pages",
    "validate_plan",
    "vllm_cache_shape",
]
