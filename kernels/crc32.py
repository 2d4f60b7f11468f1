"""CRC-32 of a buffer's segments, computed where the bytes are: verifying a chunk that kvikio read into GPU memory
never copies the chunk back to the host.

The value is zlib's CRC-32 (reflected polynomial 0xEDB88320), the one the SSD tier's slot headers record per
segment, so slots need no new format.

- On CUDA tensors the Triton kernel of `kernels/crc32_triton.py` runs (imported lazily, as the page kernel is): one
  program per piece of a segment, the pieces' values combined into the segments' on the device, so one 4-byte
  value per segment reaches the host (about 0.16 ms for a 32 MiB chunk on an H200).
- Elsewhere a vectorized torch version runs (CPU tests, the host stand-in for kvikio, and a second reference for
  the Triton kernel under Triton's interpreter): every piece's CRC in parallel, four bytes per step with
  slicing-by-4 tables, then combined on the host (`crc32_combine`).
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Literal

import numpy as np
import torch
from isal.isal_zlib import crc32_combine as _crc32_combine

__all__ = ["DEFAULT_PIECE", "GPU_PIECE", "piece_crcs", "segment_crcs", "slicing_tables"]

#: bytes per piece of the torch path (one lane each); a divisor of every segment size the SSD tier uses
DEFAULT_PIECE = 16384
#: bytes per piece of the Triton kernel (one program each): the fastest of 4 KiB to 256 KiB on an H200
GPU_PIECE = 65536
_POLY = 0xEDB88320
Impl = Literal["auto", "torch", "triton"]


@lru_cache(maxsize=1)
def slicing_tables() -> np.ndarray:
    """The four slicing-by-4 tables of zlib's CRC-32, `uint32[4, 256]` (table 0 is the classic byte table)."""
    t = np.zeros((4, 256), dtype=np.uint32)
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ _POLY if c & 1 else c >> 1
        t[0, i] = c
    for k in range(1, 4):
        t[k] = (t[k - 1] >> 8) ^ t[0][t[k - 1] & 0xFF]
    return t


def _piece_layout(nbytes: int, piece: int) -> tuple[list[int], list[int]]:
    if piece <= 0 or piece % 4:
        raise ValueError(f"piece must be a positive multiple of 4 bytes, got {piece}")
    starts = list(range(0, nbytes, piece)) or [0]
    lens = [min(piece, nbytes - s) for s in starts]
    return starts, lens


def piece_crcs(buf: torch.Tensor, piece: int = DEFAULT_PIECE, impl: Impl = "auto") -> list[int]:
    """The CRC-32 of each `piece`-byte piece of `buf` (a contiguous 1-D uint8 tensor on any device), in order."""
    _check(buf)
    if _impl(buf, impl) == "triton":
        return _triton_segments(buf, piece, piece)
    starts, lens = _piece_layout(buf.numel(), piece)
    return [int(x) & 0xFFFFFFFF for x in _piece_crcs_torch(buf, starts, lens).cpu().tolist()]


def segment_crcs(buf: torch.Tensor, seg: int, piece: int | None = None, impl: Impl = "auto") -> list[int]:
    """The CRC-32 of each `seg`-byte segment of `buf` (what a slot header records), computed in pieces of at most
    `piece` bytes (`GPU_PIECE` on a GPU, else `DEFAULT_PIECE`) that divide `seg`. On a GPU the kernel combines the
    pieces itself (one value per segment reaches the host); the torch path combines the pieces' CRCs on the host."""
    _check(buf)
    impl = _impl(buf, impl)
    piece = math.gcd(seg, piece or (GPU_PIECE if impl == "triton" else DEFAULT_PIECE))
    if piece % 4:
        raise ValueError(f"segments of {seg} bytes cannot be cut into pieces of a multiple of 4 bytes")
    if impl == "triton":
        return _triton_segments(buf, seg, piece)
    n = buf.numel()
    crcs = piece_crcs(buf, piece, "torch")
    starts, lens = _piece_layout(n, piece)
    out = []
    for lo, hi in segments(n, seg):
        first = lo // piece
        last = max(first + 1, -(-hi // piece))
        out.append(combine([(crcs[i], lens[i]) for i in range(first, last)]))
    return out


def segments(nbytes: int, seg: int) -> list[tuple[int, int]]:
    """The `[lo, hi)` byte ranges of `seg`-byte segments of `nbytes` bytes (one empty range for none): the SSD slot
    format's data segments (`ssd.slot_format.segments`, the same rule; tests/test_kernels_crc32.py holds them
    equal). Here so that the kernels import no storage module."""
    return [(lo, min(lo + seg, nbytes)) for lo in range(0, nbytes, seg)] or [(0, 0)]


def combine(parts: list[tuple[int, int]]) -> int:
    """The CRC-32 of consecutive ranges from each range's (CRC-32, length), by ISA-L's `crc32_combine` (what
    `ssd.slot_format.combine_checksums` computes)."""
    crc, _ = parts[0]
    for part, n in parts[1:]:
        crc = _crc32_combine(crc, part, n)
    return crc


def _check(buf: torch.Tensor) -> None:
    if buf.dtype != torch.uint8 or buf.dim() != 1 or not buf.is_contiguous():
        raise ValueError("the CRC-32 kernels take a contiguous 1-D uint8 tensor")


def _impl(buf: torch.Tensor, impl: Impl) -> Impl:
    return ("triton" if buf.is_cuda else "torch") if impl == "auto" else impl


def _triton_segments(buf: torch.Tensor, seg: int, piece: int) -> list[int]:
    from . import crc32_triton  # lazily: TRITON_INTERPRET must be set before triton loads

    linear = crc32_triton.linear_segment_crcs(buf, seg, piece).cpu().tolist()
    return [(v & 0xFFFFFFFF) ^ zeros_crc(hi - lo) for v, (lo, hi) in zip(linear, segments(buf.numel(), seg),
                                                                          strict=True)]


@lru_cache(maxsize=256)
def zeros_crc(n: int) -> int:
    """zlib's CRC-32 of `n` zero bytes (what the initial and final inversions add to the linear CRC), by doubling."""

    crc, block, size = 0, 0xD202EF8D, 1  # crc32(b"\0")
    while n:
        if n & 1:
            crc = combine([(crc, 0), (block, size)])
        block = combine([(block, size), (block, size)])
        size *= 2
        n >>= 1
    return crc


def _piece_crcs_torch(buf: torch.Tensor, starts: list[int], lens: list[int]) -> torch.Tensor:
    """Every piece's CRC-32 as int64, all pieces advanced together four bytes per step."""
    dev = buf.device
    tables = torch.from_numpy(slicing_tables().astype(np.int64)).to(dev)
    t0, t1, t2, t3 = tables
    full = [i for i, n in enumerate(lens) if n == lens[0]]
    out = torch.empty(len(lens), dtype=torch.int64, device=dev)
    groups = [full] + [[i] for i in range(len(full), len(lens))]  # only the last piece can be shorter
    for idx in groups:
        n = lens[idx[0]]
        rows = torch.stack([buf[starts[i]:starts[i] + n] for i in idx]) if n else buf.new_zeros((len(idx), 0))
        words = n // 4
        crc = torch.full((len(idx),), 0xFFFFFFFF, dtype=torch.int64, device=dev)
        if words:
            w = rows[:, :words * 4].reshape(len(idx), words, 4).to(torch.int64)
            w = w[:, :, 0] | (w[:, :, 1] << 8) | (w[:, :, 2] << 16) | (w[:, :, 3] << 24)
            for j in range(words):
                x = crc ^ w[:, j]
                crc = t3[x & 0xFF] ^ t2[(x >> 8) & 0xFF] ^ t1[(x >> 16) & 0xFF] ^ t0[(x >> 24) & 0xFF]
        for j in range(words * 4, n):
            crc = t0[(crc ^ rows[:, j].to(torch.int64)) & 0xFF] ^ (crc >> 8)
        out[torch.tensor(idx, device=dev)] = crc ^ 0xFFFFFFFF
    return out
