"""One-launch Triton gather/scatter between the paged, layer-first KV cache and page-first host pages.

One kernel launch moves every page of a :class:`~kvtier.kernels.layout.TransferPlan`, across all layers, in
one direction. Work items are ``(page, layer, K/V, tile of tokens)``; a fixed, small number of programs
(``max_programs``, default 4) loops over them, so the copy occupies only a few SMs and leaves the rest to the
model. On NVIDIA GPUs the host side is pinned memory that the kernel reads or writes directly through unified
virtual addressing: no staging buffer and no ``cudaMemcpy``.

Layers are separate tensors: the kernel gets the lowest-addressed layer as its base pointer and each layer's
element offset from it (one flat address space on the GPU, and real CPU addresses under the interpreter);
the host side likewise gets one base and per-page offsets. Offsets are passed divided by ``ALIGN`` (a power
of two up to 16 bytes) so the compiler knows their alignment and can emit 16-byte accesses. Elements move as
same-width integers: bit-exact for fp16, bf16, fp32 and fp8.

Under ``TRITON_INTERPRET=1`` (set before triton is imported) the same kernel runs on CPU tensors; the tests
use that to check its indexing bit-exactly.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from .layout import LayoutError, TransferPlan, bits_dtype, pick_align

logger = logging.getLogger(__name__)

#: default bound on programs (thread blocks) per launch: 4 programs of 8 warps moving 16384-element tiles fill PCIe
#: (46 to 49 GB/s on an H200, as 32 programs did) while a concurrent bf16 matmul loses nothing measurable; 32
#: programs of 4096-element tiles slowed it by 27 to 29% (benchmarks/kernel_interference.py,
#: docs/results/2026-12-04-first-gpu-run.md)
DEFAULT_MAX_PROGRAMS = 4
#: default warps per program
DEFAULT_NUM_WARPS = 8
#: target elements per tile (tokens x hidden)
_TILE_ELEMS = 16384


def interpreter_active() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@triton.jit
def _page_copy_kernel(
    dev_ptr,
    host_ptr,
    layer_off_ptr,
    page_meta_ptr,
    slots_ptr,
    num_pages,
    tiles_per_page,
    iters,
    s_blk,
    s_kv,
    s_tok,
    s_head,
    NUM_LAYERS: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HIDDEN: tl.constexpr,
    HIDDEN_P2: tl.constexpr,
    TOK: tl.constexpr,
    ALIGN: tl.constexpr,
    ROW_CONTIG: tl.constexpr,
    TO_HOST: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    n_items = num_pages * (NUM_LAYERS * 2 * tiles_per_page)
    t_in = tl.arange(0, TOK)
    col = tl.arange(0, HIDDEN_P2)
    col_ok = col < HIDDEN
    if ROW_CONTIG:  # noqa: SIM108 - a constexpr branch: one of the two is compiled
        dev_col = col
    else:
        dev_col = (col // HEAD_DIM) * s_head + (col % HEAD_DIM)
    for it in range(0, iters):
        item = pid + it * nprog
        valid = item < n_items
        item = tl.where(valid, item, 0)
        tile = item % tiles_per_page
        rest = item // tiles_per_page
        kv = rest % 2
        rest = rest // 2
        layer = rest % NUM_LAYERS
        page = rest // NUM_LAYERS
        # page metadata: [host offset / ALIGN, token count, first slot index] per page, stored as 3 rows
        host_off = tl.load(page_meta_ptr + page, mask=valid, other=0).to(tl.int64) * ALIGN
        ntok = tl.load(page_meta_ptr + num_pages + page, mask=valid, other=0)
        tok0 = tl.load(page_meta_ptr + 2 * num_pages + page, mask=valid, other=0)
        layer_off = tl.load(layer_off_ptr + layer, mask=valid, other=0).to(tl.int64) * ALIGN
        t = tile * TOK + t_in
        t_ok = t < ntok  # ntok is 0 for an invalid item, so this masks it out
        slot = tl.load(slots_ptr + tok0 + t, mask=t_ok, other=-1)
        t_ok = t_ok & (slot >= 0)
        blk = slot // BLOCK_SIZE
        off = slot % BLOCK_SIZE
        dev_row = layer_off + blk * s_blk + kv * s_kv + off * s_tok
        host_row = host_off + ((2 * layer + kv) * ntok + t) * HIDDEN
        m = t_ok[:, None] & col_ok[None, :]
        dev_offs = dev_row[:, None] + dev_col[None, :]
        host_offs = host_row[:, None] + col[None, :]
        if TO_HOST:
            x = tl.load(dev_ptr + dev_offs, mask=m)
            tl.store(host_ptr + host_offs, x, mask=m)
        else:
            x = tl.load(host_ptr + host_offs, mask=m)
            tl.store(dev_ptr + dev_offs, x, mask=m)


def _next_pow2(x: int) -> int:
    return 1 << max(0, (int(x) - 1).bit_length())


def run_plan(
    plan: TransferPlan,
    views: Sequence[torch.Tensor],
    to_host: bool,
    max_programs: int | None = None,
    num_warps: int | None = None,
    tile_elems: int | None = None,
) -> None:
    """Execute a validated plan in one kernel launch (returns without waiting for the GPU).

    ``max_programs`` bounds the grid (default :data:`DEFAULT_MAX_PROGRAMS`), ``num_warps`` the warps per
    program, ``tile_elems`` the elements one program moves per step (default 16384).
    """
    kv = plan.kv
    if plan.num_pages == 0 or plan.num_tokens == 0:
        return
    device = views[0].device
    if device.type == "cpu" and not interpreter_active():
        raise LayoutError("the Triton path needs a GPU KV cache, or TRITON_INTERPRET=1 for CPU tensors")
    host = plan.host
    if device.type == "cuda":
        if host.device.type == "cpu" and not host.is_pinned():
            raise LayoutError("the GPU kernel reads/writes host memory directly: the host buffer must be pinned")
    elif host.device != device:
        raise LayoutError(f"host buffer on {host.device}, KV cache on {device}")
    bits = bits_dtype(kv.dtype)
    esize = kv.element_size

    ptrs = [v.data_ptr() for v in views]
    base_layer = min(range(len(ptrs)), key=ptrs.__getitem__)
    base_ptr = ptrs[base_layer]
    layer_offs = []
    for p in ptrs:
        if (p - base_ptr) % esize:
            raise LayoutError("layer tensors are not element-aligned with each other")
        layer_offs.append((p - base_ptr) // esize)
    host_offs = plan.host_offsets
    # align divides 16, so the host offsets only matter modulo 16
    align = pick_align(esize, layer_offs + torch.unique(host_offs % 16).tolist() + [kv.hidden])

    meta = torch.cat(
        (
            host_offs // align,
            plan.page_ntok,
            plan.tok_start,
            torch.tensor(layer_offs, dtype=torch.int64) // align,
            plan.slots,
        )
    )
    if device.type == "cuda":
        meta = meta.pin_memory().to(device, non_blocking=True)
    p = plan.num_pages
    page_meta = meta[: 3 * p]
    layer_meta = meta[3 * p : 3 * p + kv.num_layers]
    slots = meta[3 * p + kv.num_layers :]

    hidden_p2 = _next_pow2(kv.hidden)
    # tokens per tile: a power of two, about _TILE_ELEMS elements per tile, at most one page
    tok = min(_next_pow2(plan.max_page_tokens), max(1, _next_pow2(tile_elems or _TILE_ELEMS) // hidden_p2))
    tiles_per_page = -(-plan.max_page_tokens // tok)
    n_items = p * kv.num_layers * 2 * tiles_per_page
    progs = max(1, min(n_items, max_programs or DEFAULT_MAX_PROGRAMS))
    iters = -(-n_items // progs)
    s_blk, s_kv, s_tok, s_head, _ = kv.strides
    dev_base = views[base_layer].view(bits)
    host_base = host.view(bits)
    logger.debug(
        "kvtier page kernel: %s %d pages x %d layers, tok tile %d, %d programs x %d iters, align %d",
        "gather" if to_host else "scatter", p, kv.num_layers, tok, progs, iters, align,
    )
    _page_copy_kernel[(progs,)](
        dev_base,
        host_base,
        layer_meta,
        page_meta,
        slots,
        p,
        tiles_per_page,
        iters,
        s_blk,
        s_kv,
        s_tok,
        s_head,
        NUM_LAYERS=kv.num_layers,
        BLOCK_SIZE=kv.block_size,
        HEAD_DIM=kv.head_dim,
        HIDDEN=kv.hidden,
        HIDDEN_P2=hidden_p2,
        TOK=tok,
        ALIGN=align,
        ROW_CONTIG=kv.row_contiguous,
        TO_HOST=to_host,
        num_warps=num_warps or DEFAULT_NUM_WARPS,
    )

