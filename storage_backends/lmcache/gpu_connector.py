"""LMCache ``GPUConnectorInterface`` that stores and retrieves chunks in kvtier's page-first layout.

``LMCacheEngine`` allocates each chunk as ``[2, layers, tokens, hidden]`` (``KV_2LTD``) and hands it to the GPU
connector. :class:`PageFirstGPUConnector` fills it with one kvtier page kernel launch per batch (Triton on
CUDA, torch index ops on CPU) and then *re-tags* it (same bytes, new metadata)::

    metadata.fmt   = MemoryFormat.KV_2TD                                  (PAGE_FIRST_FMT)
    metadata.shape = [pages, 2 * layers, tokens_per_page, heads * head_dim]   (4-D)

How the layout is recorded, and why this way:

* LMCache's own vLLM readers require ``fmt == KV_2LTD`` (``KV_MLA_FMT`` for MLA) and raise otherwise, so a
  page-first chunk can never be decoded as ``KV_2LTD``; :meth:`PageFirstGPUConnector.check_chunk` refuses
  anything but this model's exact page-first ``(fmt, shape, dtype)``, so the reverse cannot happen either.
* A new ``MemoryFormat`` member is not an option: LMCache's host allocators route ``allocate``/``free`` by
  ``fmt`` through a closed list and raise ``Unsupported memory format`` on any other value (an object so
  tagged is never freed). ``KV_2TD`` is accepted everywhere (allocators, ``LocalDiskBackend`` reloads, the
  remote protocol's 4-D shape header). LMCache itself only creates 3-D ``KV_2TD`` objects (layerwise
  blending buffers, under per-layer keys), so ``KV_2TD`` with a 4-D shape identifies a kvtier page-first
  chunk: :func:`is_page_first`.
* A tier that stores chunks (the SSD tier's slot header) records ``fmt``, ``shape`` and ``dtype`` and
  compares them with :meth:`PageFirstGPUConnector.chunk_format` (a :class:`ChunkFormat`) on read; it can
  allocate a stored chunk with LMCache's allocator as ``allocate(shape, dtype, fmt)`` directly.

Caveat: ``MemoryObj.get_num_tokens()`` (``shape[fmt.token_dim()]``) returns the page count for page-first
chunks; LMCache only uses it for statistics and in PD/P2P transfer paths, which page-first does not support.
"""

from __future__ import annotations

from kvtier.compat.extras import require_lmcache
from kvtier.compat.guard import COMPONENT_PLUGIN

require_lmcache(COMPONENT_PLUGIN)  # before LMCache's imports: without LMCache, one line naming kvtier[lmcache]

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from lmcache.v1.gpu_connector.gpu_connectors import GPUConnectorInterface
from lmcache.v1.memory_management import MemoryFormat, MemoryObj, TensorMemoryObj

from kvtier.kernels.dispatch import HostChunk, Impl, PageMover, flat_storage
from kvtier.kernels.layout import KVLayoutKind, LayoutError, PageFirstLayout, validate_plan

logger = logging.getLogger(__name__)

#: the ``MemoryFormat`` a page-first chunk carries (together with a 4-D shape)
PAGE_FIRST_FMT: MemoryFormat = MemoryFormat.KV_2TD


class PageFormatMismatch(LayoutError):
    """A chunk's recorded format/shape/dtype is not the page-first layout this reader expects."""


@dataclass(frozen=True)
class ChunkFormat:
    """What a stored chunk records about its bytes; equal formats mean the bytes are interchangeable."""

    fmt: MemoryFormat
    shape: torch.Size
    dtype: torch.dtype

    @classmethod
    def of(cls, memory_obj: MemoryObj) -> ChunkFormat:
        m = memory_obj.metadata
        return cls(m.fmt, torch.Size(m.shape), m.dtype)


def is_page_first(memory_obj: MemoryObj) -> bool:
    """Whether a memory object is tagged as a kvtier page-first chunk (of any model)."""
    meta = memory_obj.metadata
    return meta.fmt == PAGE_FIRST_FMT and len(meta.shape) == 4


def retag_chunk(memory_obj: MemoryObj, fmt: MemoryFormat, shape: Sequence[int]) -> None:
    """Record ``fmt`` and ``shape`` on a memory object (same number of elements as it was allocated with)."""
    meta = memory_obj.metadata
    size = torch.Size(int(s) for s in shape)
    if size.numel() != meta.shape.numel():
        raise PageFormatMismatch(f"cannot re-tag a {tuple(meta.shape)} chunk as {tuple(size)}")
    if meta.shapes is not None and len(meta.shapes) > 1:
        raise PageFormatMismatch("multi-group (hybrid) chunks are not supported in page-first layout")
    meta.shape = size
    if meta.shapes is not None:
        meta.shapes = [size]
    meta.fmt = fmt


def _flat(memory_obj: MemoryObj) -> torch.Tensor:
    t = memory_obj.tensor
    if t is None:
        raise PageFormatMismatch("memory object has no tensor (invalidated?)")
    return t.reshape(-1)


class PageFirstGPUConnector(GPUConnectorInterface):
    """Moves LMCache chunks between vLLM's paged KV tensors and page-first host memory objects.

    ``kwargs`` per call, as LMCache's vLLM adapter passes them: ``kvcaches`` (list of per-layer tensors, in
    layer order), ``slot_mapping`` (slot of every token of the request), optional ``vllm_cached_tokens``
    (tokens already in vLLM's cache; a retrieve leaves them untouched).
    """

    def __init__(
        self,
        num_layers: int,
        num_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        page_tokens: int,
        kind: KVLayoutKind | str,
        *,
        impl: Impl = "auto",
        max_programs: int | None = None,
        num_warps: int | None = None,
        tile_elems: int | None = None,
    ) -> None:
        self.kind = KVLayoutKind(kind)
        self.pages = PageFirstLayout(num_layers, num_heads, head_dim, page_tokens, dtype)
        self.impl = impl
        self.max_programs = max_programs
        self.num_warps = num_warps
        self.tile_elems = tile_elems
        self.kvcaches: list[torch.Tensor] | None = None
        self._mover: PageMover | None = None
        self._mover_key: tuple = ()
        self.store_stream: Any = None
        self.load_stream: Any = None
        #: (storage address, bytes) -> a flat view of the KV dtype over that whole storage (`host_region`)
        self._host_views: dict[tuple[int, int], torch.Tensor] = {}

    @classmethod
    def from_metadata(
        cls,
        metadata: Any,
        kind: KVLayoutKind | str,
        page_tokens: int,
        **kwargs: Any,
    ) -> PageFirstGPUConnector:
        """Build from ``LMCacheMetadata`` (``kv_shape = (layers, 2, chunk, heads, head_dim)``)."""
        if getattr(metadata, "use_mla", False):
            raise LayoutError("the page-first connector does not support MLA caches")
        num_layers, kv, _, heads, head_dim = metadata.kv_shape
        if kv != 2:
            raise LayoutError(f"expected K and V (kv_shape[1] == 2), got {metadata.kv_shape}")
        chunk = int(getattr(metadata, "chunk_size", 0) or metadata.kv_shape[2])
        if chunk % page_tokens:
            raise LayoutError(f"LMCache chunk_size {chunk} is not a multiple of page_tokens {page_tokens}")
        return cls(num_layers, heads, head_dim, metadata.kv_dtype, page_tokens, kind, **kwargs)

    # -- GPUConnectorInterface ---------------------------------------------------------------------

    def get_shape(self, num_tokens: int) -> torch.Size:
        """Shape a page-first chunk of ``num_tokens`` is recorded with."""
        return self.pages.chunk_shape(num_tokens)

    def chunk_format(self, num_tokens: int) -> ChunkFormat:
        """The exact ``(fmt, shape, dtype)`` this connector writes, and accepts, for ``num_tokens``."""
        return ChunkFormat(PAGE_FIRST_FMT, self.pages.chunk_shape(num_tokens), self.pages.dtype)

    def from_gpu(self, memory_obj: MemoryObj, start: int, end: int, **kwargs: Any) -> None:
        self.batched_from_gpu([memory_obj], [start], [end], **kwargs)

    def to_gpu(self, memory_obj: MemoryObj, start: int, end: int, **kwargs: Any) -> None:
        self.batched_to_gpu([memory_obj], [start], [end], **kwargs)

    def batched_from_gpu(
        self,
        memory_objs: list[list[MemoryObj]] | list[MemoryObj],
        starts: list[int],
        ends: list[int],
        **kwargs: Any,
    ) -> None:
        objs = self._flat_objs(memory_objs)
        mover = self._get_mover(kwargs)
        slot_mapping = self._slot_mapping(kwargs)
        chunks = []
        for obj, start, end in zip(objs, starts, ends, strict=True):
            n = end - start
            if obj.metadata.dtype != self.pages.dtype:
                raise PageFormatMismatch(f"chunk dtype {obj.metadata.dtype} != KV dtype {self.pages.dtype}")
            if obj.metadata.shape.numel() != self.pages.page_elems(n):
                raise PageFormatMismatch(
                    f"chunk of {tuple(obj.metadata.shape)} cannot hold {n} tokens in page-first layout"
                )
            chunks.append(HostChunk(host=self.host_region(obj), slots=slot_mapping[start:end]))
        self._run(mover, chunks, to_host=True)
        for obj, start, end in zip(objs, starts, ends, strict=True):
            retag_chunk(obj, PAGE_FIRST_FMT, self.pages.chunk_shape(end - start))

    def batched_to_gpu(
        self,
        memory_objs: list[list[MemoryObj]] | list[MemoryObj] | list[int] | None = None,
        starts: list[int] | None = None,
        ends: list[int] | None = None,
        **kwargs: Any,
    ) -> None:
        if memory_objs is None or starts is None or ends is None:
            raise LayoutError("the page-first connector is not layerwise: pass memory_objs, starts and ends")
        objs = self._flat_objs(memory_objs)
        for obj, start, end in zip(objs, starts, ends, strict=True):
            self.check_chunk(obj, end - start)
        self.scatter_pages([self.host_region(obj) for obj in objs], starts, ends, **kwargs)

    def scatter_pages(self, hosts: Sequence[torch.Tensor], starts: Sequence[int], ends: Sequence[int],
                      **kwargs: Any) -> None:
        """Write page-first chunks held in plain host tensors (flat, of the KV dtype, one per token range
        ``[start, end)``) into vLLM's blocks, in one launch per batch: what ``batched_to_gpu`` does for LMCache
        memory objects, for buffers kvtier owns (the SSD stream's staging area). ``kwargs`` as ``batched_to_gpu``."""
        for host, start, end in zip(hosts, starts, ends, strict=True):
            if host.dtype != self.pages.dtype or host.dim() != 1 or host.numel() != self.pages.page_elems(end - start):
                raise PageFormatMismatch(f"a staged region of {host.numel()} {host.dtype} cannot hold {end - start} "
                                         f"tokens of {self.pages.dtype} in page-first layout")
        mover = self._get_mover(kwargs)
        slot_mapping = self._slot_mapping(kwargs)
        vllm_cached = int(kwargs.get("vllm_cached_tokens", 0) or 0)
        if vllm_cached > 0:  # tokens already in vLLM's cache, maybe shared: not rewritten (one copy, not per chunk)
            slot_mapping = slot_mapping.clone()
            slot_mapping[:vllm_cached] = -1
        chunks = [HostChunk(host=host, slots=slot_mapping[start:end])
                  for host, start, end in zip(hosts, starts, ends, strict=True)]
        self._run(mover, chunks, to_host=False)

    # -- helpers ------------------------------------------------------------------------------------

    def check_chunk(self, memory_obj: MemoryObj, num_tokens: int) -> None:
        """Raise :class:`PageFormatMismatch` unless ``memory_obj`` is this model's page-first chunk of
        ``num_tokens``."""
        meta = memory_obj.metadata
        if not is_page_first(memory_obj):
            raise PageFormatMismatch(
                f"chunk is {meta.fmt} {tuple(meta.shape)}, this reader expects kvtier page-first "
                f"({PAGE_FIRST_FMT} with a 4-D shape)"
            )
        try:
            n = self.pages.check_chunk_shape(meta.shape, meta.dtype)
        except LayoutError as exc:
            raise PageFormatMismatch(str(exc)) from exc
        if n != num_tokens:
            raise PageFormatMismatch(f"chunk holds {n} tokens, the request range has {num_tokens}")

    #: storages whose flat views `host_region` keeps (LMCache's host pool is one storage; a bound all the same)
    MAX_HOST_VIEWS = 8

    def host_region(self, obj: MemoryObj) -> torch.Tensor:
        """A chunk (loaded or stored) as a flat tensor of the KV dtype: a slice of a kept flat view over the
        storage it lives in. `MemoryObj.tensor` builds three views and the reshape a fourth, and each view call
        releases the GIL: on a busy engine (another thread wants the GIL) every release costs the transfer thread
        up to the switch interval, so four of them per chunk made a 32-chunk load last seconds
        (`benchmarks/load_gil.py`)."""
        if not isinstance(obj, TensorMemoryObj):
            return _flat(obj)
        if not obj.is_valid():
            raise PageFormatMismatch("memory object has no tensor (invalidated?)")
        raw = obj.raw_data
        storage = raw.untyped_storage()
        key = (storage.data_ptr(), storage.nbytes())
        base = self._host_views.get(key)
        if base is None:
            if len(self._host_views) >= self.MAX_HOST_VIEWS:
                self._host_views.clear()
            base = self._host_views[key] = flat_storage(raw, self.pages.dtype)
        esize = base.element_size()
        offset, size = obj.data_ptr - key[0], obj.get_size()
        if offset % esize or size % esize:
            return _flat(obj)
        return base[offset // esize:(offset + size) // esize]

    @staticmethod
    def _flat_objs(memory_objs: Sequence[Any]) -> list[MemoryObj]:
        out: list[MemoryObj] = []
        for o in memory_objs:
            if isinstance(o, (list, tuple)):
                if len(o) != 1:
                    raise LayoutError("multi-group chunks are not supported by the page-first connector")
                out.append(o[0])
            else:
                out.append(o)
        return out

    @staticmethod
    def _slot_mapping(kwargs: dict) -> torch.Tensor:
        if "slot_mapping" not in kwargs:
            raise LayoutError("'slot_mapping' should be provided in kwargs")
        sm = kwargs["slot_mapping"]
        sm = sm if isinstance(sm, torch.Tensor) else torch.as_tensor(sm)
        return sm.to(device="cpu", dtype=torch.int64)

    def _get_mover(self, kwargs: dict) -> PageMover:
        caches = kwargs.get("kvcaches", self.kvcaches)
        if caches is None:
            raise LayoutError("'kvcaches' should be provided in kwargs or set beforehand")
        if isinstance(caches, dict):
            caches = list(caches.values())
        caches = list(caches)
        key = tuple((t.data_ptr(), tuple(t.shape), tuple(t.stride())) for t in caches)
        if self._mover is None or key != self._mover_key:
            mover = PageMover(
                caches,
                self.kind,
                self.pages.page_tokens,
                impl=self.impl,
                max_programs=self.max_programs,
                num_warps=self.num_warps,
                tile_elems=self.tile_elems,
            )
            if PageFirstLayout.for_kv(mover.kv, self.pages.page_tokens) != self.pages:
                raise LayoutError(f"KV caches {mover.kv} do not match the connector's {self.pages}")
            self.kvcaches, self._mover, self._mover_key = caches, mover, key
            if mover.kv.device.type == "cuda":
                self.store_stream = torch.cuda.Stream(device=mover.kv.device)
                self.load_stream = torch.cuda.Stream(device=mover.kv.device)
        return self._mover

    def _run(self, mover: PageMover, chunks: list[HostChunk], to_host: bool) -> None:
        plans = mover.plan_chunks(chunks)
        for plan in plans:  # every check passes before the first copy
            validate_plan(plan, to_host)
        if mover.kv.device.type != "cuda":
            for plan in plans:
                mover.run(plan, to_host, check=False)
            return
        stream = self.store_stream if to_host else self.load_stream
        stream.wait_stream(torch.cuda.current_stream(mover.kv.device))
        with torch.cuda.stream(stream):
            for plan in plans:
                mover.run(plan, to_host, check=False)
        stream.synchronize()
