"""The Triton kernel of `kernels/crc32.py`: one lane per piece, four bytes per step (slicing-by-4 tables), the
last piece's tail bytes one at a time. Pieces start on 4-byte boundaries. Under `TRITON_INTERPRET=1` (set before
triton is imported) it runs on CPU tensors: the tests check it bit for bit against zlib there."""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

LANES = 128


@triton.jit
def _crc32_pieces(words_ptr, bytes_ptr, start_ptr, nwords_ptr, ntail_ptr, out_ptr, tables_ptr, n_pieces,
                  max_words, LANES: tl.constexpr):
    lane = tl.program_id(0) * LANES + tl.arange(0, LANES)
    live = lane < n_pieces
    start = tl.load(start_ptr + lane, mask=live, other=0)  # in 4-byte words
    nw = tl.load(nwords_ptr + lane, mask=live, other=0)
    ones = tl.full([LANES], 0xFFFFFFFF, tl.uint32)
    crc = ones
    for w in range(0, max_words):
        m = live & (w < nw)
        word = tl.load(words_ptr + start + w, mask=m, other=0).to(tl.uint32, bitcast=True)
        x = crc ^ word
        b0 = (x & 0xFF).to(tl.int32)
        b1 = ((x >> 8) & 0xFF).to(tl.int32)
        b2 = ((x >> 16) & 0xFF).to(tl.int32)
        b3 = ((x >> 24) & 0xFF).to(tl.int32)
        new = (tl.load(tables_ptr + 768 + b0) ^ tl.load(tables_ptr + 512 + b1) ^ tl.load(tables_ptr + 256 + b2)
               ^ tl.load(tables_ptr + b3)).to(tl.uint32, bitcast=True)
        crc = tl.where(m, new, crc)
    nt = tl.load(ntail_ptr + lane, mask=live, other=0)
    for b in range(0, 3):
        m = live & (b < nt)
        byte = tl.load(bytes_ptr + (start + nw) * 4 + b, mask=m, other=0).to(tl.uint32)
        idx = ((crc ^ byte) & 0xFF).to(tl.int32)
        new = tl.load(tables_ptr + idx).to(tl.uint32, bitcast=True) ^ (crc >> 8)
        crc = tl.where(m, new, crc)
    tl.store(out_ptr + lane, (crc ^ ones).to(tl.int32, bitcast=True), mask=live)


def piece_crcs(buf: torch.Tensor, starts: list[int], lens: list[int], tables: np.ndarray) -> torch.Tensor:
    """Every piece's CRC-32 (int32 bit patterns) of the uint8 tensor `buf`, one launch."""
    dev = buf.device
    n = len(starts)
    if any(s % 4 for s in starts):
        raise ValueError("pieces must start on 4-byte boundaries")
    nbytes = buf.numel()
    words = buf[:nbytes // 4 * 4].view(torch.int32) if nbytes >= 4 else buf.new_zeros(1, dtype=torch.int32)
    start = torch.tensor([s // 4 for s in starts], dtype=torch.int64, device=dev)
    nwords = torch.tensor([n_ // 4 for n_ in lens], dtype=torch.int64, device=dev)
    ntail = torch.tensor([n_ % 4 for n_ in lens], dtype=torch.int64, device=dev)
    tab = torch.from_numpy(tables.view(np.int32).reshape(-1).copy()).to(dev)
    out = torch.empty(n, dtype=torch.int32, device=dev)
    _crc32_pieces[(triton.cdiv(n, LANES),)](words, buf, start, nwords, ntail, out, tab, n,
                                           max(lens) // 4, LANES=LANES)
    return out
