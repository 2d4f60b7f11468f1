"""The Triton kernel of `kernels/crc32.py`: zlib's CRC-32 of every segment of a buffer in device memory, in one
launch; only one 4-byte value per segment reaches the host.

CRC-32 without its initial and final inversion (the *linear* CRC) is linear over GF(2): the CRC of a segment is
the XOR of every 4-byte word's contribution, the word advanced by as many zero bytes as follow it in the segment.

- One program per piece (a few KiB of a segment), `BLOCK` lanes reading rows of `4 * BLOCK` consecutive bytes
  (coalesced), so a chunk of 32 MiB keeps thousands of warps busy. Lane `t` keeps one accumulator over the words
  `t, t + BLOCK, ...` of the piece, advancing it by a row of zero bytes before each word (four byte-sliced table
  lookups); at the end it advances its accumulator by the `4 * (BLOCK - t)` bytes after its last word (a per-lane
  table), and the lanes' values are XORed together: the piece's linear CRC.
- A piece shorter than a whole number of rows is read as if zeros preceded it (leading zeros leave the linear CRC
  unchanged). Pieces start on 4-byte boundaries; only the buffer's last piece can end off one, and it is read byte
  by byte in a launch of its own.
- The piece's value is advanced by the bytes between its end and its segment's end (tables of powers of two of
  zero bytes, one per set bit) and XORed atomically into the segment's slot.
- The host XORs in the CRC-32 of as many zero bytes as the segment has (the inversions' share): zlib's value.

Under `TRITON_INTERPRET=1` (set before triton is imported) it runs on CPU tensors: the tests check it bit for bit
against zlib there."""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch
import triton
import triton.language as tl

from .crc32 import slicing_tables

MAX_BLOCK = 128
POWERS = 48  # zero-byte advances up to 2**48 - 1 bytes


@triton.jit
def _xor(a, b):
    return a ^ b


@triton.jit
def _advance(v, tab_ptr):
    """`v` advanced by the zero bytes the 4 x 256 table at `tab_ptr` stands for (int32 bit patterns)."""
    return (tl.load(tab_ptr + (v & 0xFF)) ^ tl.load(tab_ptr + 256 + ((v >> 8) & 0xFF))
            ^ tl.load(tab_ptr + 512 + ((v >> 16) & 0xFF)) ^ tl.load(tab_ptr + 768 + ((v >> 24) & 0xFF)))


@triton.jit
def _crc32_segments(bytes_ptr, words_ptr, out_ptr, row_tab_ptr, lane_tab_ptr, pow_tab_ptr, first_piece, piece,
                    nbytes, seg, BLOCK: tl.constexpr, BYTEWISE: tl.constexpr):
    pid = first_piece + tl.program_id(0)
    start = pid.to(tl.int64) * piece
    piece_len = tl.minimum(nbytes - start, piece)
    nrows = tl.cdiv(piece_len, 4 * BLOCK)
    pad = nrows * 4 * BLOCK - piece_len  # the zeros read as if before the piece
    lane = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for r in range(0, nrows):
        q = start - pad + r * 4 * BLOCK + 4 * lane  # byte offset of each lane's word
        if BYTEWISE:
            word = tl.zeros([BLOCK], dtype=tl.int32)
            for i in tl.static_range(4):
                b = tl.load(bytes_ptr + q + i, mask=q + i >= start, other=0).to(tl.int32)
                word = word | (b << (8 * i))
        else:
            word = tl.load(words_ptr + q // 4, mask=q >= start, other=0)
        acc = _advance(acc, row_tab_ptr) ^ word
    lin = tl.reduce(_advance(acc, lane_tab_ptr + lane * 1024), 0, _xor)
    seg_index = start // seg
    after = tl.minimum(seg_index * seg + seg, nbytes) - (start + piece_len)  # bytes to the segment's end
    bit = 0
    while after > 0:
        if (after & 1) != 0:
            lin = _advance(lin, pow_tab_ptr + bit * 1024)
        after = after >> 1
        bit += 1
    tl.atomic_xor(out_ptr + seg_index, lin)


def _apply(tab: np.ndarray, v: np.ndarray) -> np.ndarray:
    """A byte-sliced advance table (`uint32[1024]`) applied to the values `v`."""
    return tab[v & 0xFF] ^ tab[256 + ((v >> 8) & 0xFF)] ^ tab[512 + ((v >> 16) & 0xFF)] ^ tab[768 + (v >> 24)]


def _basis() -> np.ndarray:
    return (np.arange(256, dtype=np.uint32)[None, :] << (8 * np.arange(4, dtype=np.uint32))[:, None]).reshape(-1)


@lru_cache(maxsize=8)
def advance_tables(block: int) -> tuple[np.ndarray, np.ndarray]:
    """(row, lanes): byte-sliced tables of the linear CRC advanced by zero bytes; `row` (1024 entries) by a row of
    `4 * block` bytes, `lanes[t]` (1024 each) by the `4 * (block - t)` bytes after lane `t`'s last word."""
    t0 = slicing_tables()[0]
    lanes = np.zeros((block, 1024), dtype=np.uint32)
    v = _basis()
    for words in range(1, block + 1):
        for _ in range(4):
            v = t0[v & 0xFF] ^ (v >> 8)
        lanes[block - words] = v  # lane block - words has `words` words of bytes after its own
    return lanes[0].copy(), lanes.reshape(-1).copy()


@lru_cache(maxsize=1)
def power_tables() -> np.ndarray:
    """`uint32[POWERS, 1024]`: the linear CRC advanced by 2**i zero bytes, byte-sliced."""
    t0 = slicing_tables()[0]
    out = np.zeros((POWERS, 1024), dtype=np.uint32)
    out[0] = t0[_basis() & 0xFF] ^ (_basis() >> 8)
    for i in range(1, POWERS):
        out[i] = _apply(out[i - 1], out[i - 1])  # twice the advance of the row before
    return out


_device_tables: dict[tuple[torch.device, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}


def _tables_on(dev: torch.device, block: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    key = (dev, block)
    if key not in _device_tables:
        row, lanes = advance_tables(block)
        _device_tables[key] = tuple(torch.from_numpy(t.view(np.int32)).to(dev)
                                    for t in (row, lanes, power_tables().reshape(-1)))
    return _device_tables[key]


def block_for(piece: int) -> int:
    """Lanes per program: a power of two, at most `MAX_BLOCK`, no more than a piece has words (at least 16)."""
    return max(16, min(MAX_BLOCK, 1 << max(0, (piece // 4 - 1).bit_length())))


def linear_segment_crcs(buf: torch.Tensor, seg: int, piece: int) -> torch.Tensor:
    """The linear CRC-32 (no inversions; int32 bit patterns) of every `seg`-byte segment of the contiguous uint8
    tensor `buf`, computed in pieces of `piece` bytes (a multiple of 4 dividing `seg`); one launch, two when the
    buffer ends off a 4-byte boundary."""
    if piece <= 0 or piece % 4 or seg % piece:
        raise ValueError(f"pieces of {piece} bytes cannot cut {seg}-byte segments on 4-byte boundaries")
    dev, nbytes = buf.device, buf.numel()
    out = torch.zeros(max(1, -(-nbytes // seg)), dtype=torch.int32, device=dev)
    if nbytes == 0:
        return out
    block = block_for(piece)
    row_tab, lane_tab, pow_tab = _tables_on(dev, block)
    words = buf[:nbytes // 4 * 4].view(torch.int32) if nbytes >= 4 else buf.new_zeros(1, dtype=torch.int32)
    n = -(-nbytes // piece)
    aligned = n if nbytes % 4 == 0 else n - 1
    if aligned:
        _crc32_segments[(aligned,)](buf, words, out, row_tab, lane_tab, pow_tab, 0, piece, nbytes, seg,
                                    BLOCK=block, BYTEWISE=False)
    if aligned < n:
        _crc32_segments[(1,)](buf, words, out, row_tab, lane_tab, pow_tab, n - 1, piece, nbytes, seg,
                              BLOCK=block, BYTEWISE=True)
    return out
