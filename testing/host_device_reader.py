"""A host stand-in for kvikio's reads (`kvtier.storage_backends.ssd.kvikio_io.DeviceReader`): POSIX `preadv`
into a CPU tensor or array, so the SSD tier's device read path (and the connector's device staging) runs on a
machine without a CUDA driver, through the same code as on a GPU machine. Counts its reads."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch

__all__ = ["HostDeviceReader"]


class HostDeviceReader:
    def __init__(self, flip_byte: int | None = None) -> None:
        self.reads = 0
        self.bytes = 0
        #: flip this byte of every destination after the read lands (a bit that went bad in device memory)
        self.flip_byte = flip_byte

    def pread(self, path: str, buf: Any, nbytes: int, offset: int) -> None:
        arr = buf.numpy() if isinstance(buf, torch.Tensor) else np.asarray(buf)
        view = memoryview(arr).cast("B")[:nbytes]
        fd = os.open(path, os.O_RDONLY)
        try:
            got = 0
            while got < nbytes:
                n = os.preadv(fd, [view[got:]], offset + got)
                if n <= 0:
                    raise EOFError(f"short read: {got} of {nbytes} bytes at offset {offset} of {path}")
                got += n
        finally:
            os.close(fd)
        if self.flip_byte is not None and self.flip_byte < nbytes:
            view[self.flip_byte] ^= 0x04
        self.reads += 1
        self.bytes += nbytes

    def close(self) -> None:
        pass
