"""Streams a load's SSD-resident chunks into vLLM's blocks through a bounded staging area.

A request's history can be far larger than the host tier's free room. Staging every SSD hit in LMCache's host
pool first (a prefetch) capped a request's SSD hits at that room: with a host tier of 4 chunks no request got
more than 4 chunks back, however many the SSD held. The part of a load the prefetch could not bring into host
memory is therefore streamed here instead, on the worker's transfer thread (never inside a forward pass): up to
`stage_chunks` chunks are read from the SSD tier into kvtier's own staging buffers (every byte verified by the
tier, a torn, flipped or foreign slot is a miss), written into the request's blocks with the page-first scatter,
and the buffers are reused for the next window. The host tier is neither filled nor evicted by it. Where the SSD
tier reads with kvikio (`io_engine: auto` on a CUDA machine) the staging area lives in device memory beside vLLM's
KV: chunks go from the SSD straight into it (GPUDirect Storage where the platform has it) and the scatter kernel
moves them into the blocks on the device; the prefetch then leaves SSD chunks to the stream, so no byte of them
passes through the host pool.

A chunk that is not on the SSD but is in the host tier (another rank's write-through still queued, say) is taken
from there; a chunk in neither, or whose recorded format is not this model's page-first chunk, ends the stream:
the load reports its first token as not arrived, and vLLM recomputes from there. Never wrong KV.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from kvtier.connector.worker_storage import SSDTierHandle
    from kvtier.storage_backends.base import ChunkMeta, HostTier
    from kvtier.storage_backends.lmcache.gpu_connector import PageFirstGPUConnector

logger = logging.getLogger(__name__)

__all__ = ["SSDStream", "StreamResult"]


@dataclass(frozen=True)
class StreamResult:
    """What one streamed load moved: `bad_from` is the first token that did not arrive (None: all did)."""

    bad_from: int | None
    ssd_chunks: int = 0
    host_chunks: int = 0
    windows: int = 0


class SSDStream:
    """A worker rank's bounded staging area between the SSD tier and vLLM's KV blocks (one user at a time: the
    transfer thread, under the engine lock)."""

    def __init__(self, ssd: SSDTierHandle, host: HostTier, connector: PageFirstGPUConnector, stage_chunks: int,
                 device: torch.device | str = "cpu") -> None:
        if stage_chunks < 1:
            raise ValueError(f"a staging area needs at least one chunk, got {stage_chunks}")
        self.ssd = ssd
        self.host = host  # LMCache LocalCPUBackend
        self.connector = connector
        self.stage_chunks = stage_chunks
        self.device = torch.device(device)  # where vLLM's KV lives
        #: the SSD tier reads straight into device memory (kvikio): the staging area lives beside vLLM's KV and
        #: no byte of a streamed chunk passes through host memory
        self.direct = ssd.reads_into_device
        self._staging: torch.Tensor | None = None  # (stage_chunks, chunk_bytes) uint8, allocated on first use

    @property
    def staging_bytes(self) -> int:
        """The staging area's size: the most memory (host, or device for `direct`) a streamed load holds, however
        long the request."""
        return self.stage_chunks * self.ssd.chunk_bytes

    def _buffers(self) -> torch.Tensor:
        if self._staging is None:
            shape = (self.stage_chunks, self.ssd.chunk_bytes)
            if self.direct:
                self._staging = torch.empty(shape, dtype=torch.uint8, device=self.device)
            else:  # host staging; pinned where the scatter kernel reads it from a GPU
                self._staging = torch.empty(shape, dtype=torch.uint8, pin_memory=self.device.type == "cuda")
        return self._staging

    def _accepts(self, meta: ChunkMeta, num_tokens: int) -> bool:
        """Whether a stored chunk's recorded format is this model's page-first chunk of `num_tokens`."""
        want = self.connector.chunk_format(num_tokens)
        return (meta.fmt == want.fmt.name and meta.dtype == str(want.dtype)
                and tuple(meta.shape) == tuple(want.shape))

    def load(self, chunks: Sequence[tuple[int, int, Any]], **scatter_kw: Any) -> StreamResult:
        """Write `chunks` ((start, end, LMCache key), in token order, contiguous) into vLLM's blocks; `scatter_kw`
        as the page-first connector's `batched_to_gpu` takes them (kvcaches, slot_mapping, vllm_cached_tokens)."""
        buffers = self._buffers()
        ssd_n = host_n = windows = 0
        for w in range(0, len(chunks), self.stage_chunks):
            window = list(chunks[w:w + self.stage_chunks])
            windows += 1
            regions, ends, taken = self._read_window(window, buffers)
            if regions:
                try:
                    self.connector.scatter_pages(regions, [s for s, _, _ in window[:len(regions)]], ends,
                                                 **scatter_kw)
                finally:
                    for obj in taken:
                        obj.ref_count_down()
            got = len(regions)
            ssd_n += got - len(taken)
            host_n += len(taken)
            if got < len(window):
                return StreamResult(window[got][0], ssd_n, host_n, windows)
        return StreamResult(None, ssd_n, host_n, windows)

    def _read_window(self, window: list[tuple[int, int, Any]], buffers: torch.Tensor
                     ) -> tuple[list[torch.Tensor], list[int], list[Any]]:
        """Read a window's chunks into the staging buffers (the SSD tier first, then the host tier for a chunk
        the SSD does not hold); returns the flat KV regions of the arrived prefix, their ends, and the host
        objects taken (released by the caller after the scatter)."""
        dtype = self.connector.pages.dtype
        staged: dict[int, torch.Tensor] = {}

        def stage(i: int, meta: ChunkMeta) -> torch.Tensor | None:
            start, end, key = window[i]
            if not self._accepts(meta, end - start):
                logger.warning("kvtier: SSD chunk %s is %s %s %s, not this model's page-first chunk of %d tokens; "
                               "streamed as a miss", key, meta.fmt, meta.shape, meta.dtype, end - start)
                return None
            staged[i] = buffers[i, :meta.nbytes]
            return staged[i]

        keys = [k for _, _, k in window]
        if self.direct:
            arrived = self.ssd.read_into_device(keys, stage)
        else:
            arrived = self.ssd.read_into(keys, lambda i, meta: None if (t := stage(i, meta)) is None
                                         else memoryview(t.numpy()))
        regions: list[torch.Tensor] = []
        ends: list[int] = []
        taken: list[Any] = []
        for i, ((start, end, key), ok) in enumerate(zip(window, arrived)):
            if ok:
                regions.append(staged[i].view(dtype))
            else:
                obj = self._from_host(key, end - start)
                if obj is None:
                    break
                taken.append(obj)
                regions.append(self.connector.host_region(obj))
            ends.append(end)
        return regions, ends, taken

    def _from_host(self, key: Any, num_tokens: int) -> Any:
        """The host tier's copy of a chunk the SSD tier does not hold (a reference the caller releases), or None."""
        try:
            obj = self.host.get_blocking(key)
        except Exception:
            logger.exception("kvtier: cannot read chunk %s from the host tier", key)
            return None
        if obj is None:
            return None
        try:
            self.connector.check_chunk(obj, num_tokens)
        except Exception as e:
            logger.warning("kvtier: host chunk %s cannot be streamed (%s); treated as a miss", key, e)
            obj.ref_count_down()
            return None
        return obj
