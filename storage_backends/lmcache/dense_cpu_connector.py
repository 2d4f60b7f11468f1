"""A CPU "GPU connector" for LMCache over a dense KV buffer, for tests, demos and benchmarks without vLLM.

The engine-side KV of one sequence is a tensor `[2, num_layers, num_tokens, hidden]` (LMCache's KV_2LTD layout
with all tokens), passed to `LMCacheEngine.store/retrieve` as the keyword `kvcaches`. Chunks copy in and out
of it bit for bit. vLLM's paged caches go through the page-first connector in `kvtier.kernels` instead.
"""

from __future__ import annotations

import torch
from lmcache.v1.gpu_connector import GPUConnectorInterface
from lmcache.v1.memory_management import MemoryFormat, MemoryObj

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The same memory as integers of the same width: copies stay bit-exact, and torch's integer copy kernel
    avoids the intra-op thread hand-off that makes small strided float copies take milliseconds on CPU."""
    return t.view(_BITS[t.element_size()])


class DenseCPUConnector(GPUConnectorInterface):
    def __init__(self, num_layers: int, hidden: int, kv: int = 2) -> None:
        self.num_layers, self.hidden, self.kv = num_layers, hidden, kv

    def get_shape(self, num_tokens: int) -> torch.Size:
        return torch.Size([self.kv, self.num_layers, num_tokens, self.hidden])

    @staticmethod
    def _check(memory_obj: MemoryObj) -> None:
        if memory_obj.metadata.fmt != MemoryFormat.KV_2LTD:
            raise ValueError(f"DenseCPUConnector handles KV_2LTD chunks, got {memory_obj.metadata.fmt}")

    def from_gpu(self, memory_obj: MemoryObj, start: int, end: int, **kwargs) -> None:
        self._check(memory_obj)
        _bits(memory_obj.tensor).copy_(_bits(kwargs["kvcaches"][:, :, start:end]))

    def to_gpu(self, memory_obj: MemoryObj, start: int, end: int, **kwargs) -> None:
        self._check(memory_obj)
        _bits(kwargs["kvcaches"][:, :, start:end]).copy_(_bits(memory_obj.tensor))

    def batched_from_gpu(self, memory_objs, starts, ends, **kwargs) -> None:
        for obj, s, e in zip(memory_objs, starts, ends):
            self.from_gpu(obj, s, e, **kwargs)

    def batched_to_gpu(self, memory_objs=None, starts=None, ends=None, **kwargs) -> None:
        for obj, s, e in zip(memory_objs or [], starts or [], ends or []):
            self.to_gpu(obj, s, e, **kwargs)
