"""Typed descriptions of the two sides of a KV page transfer, and their validation.

Device side: the per-layer paged KV tensors that vLLM hands a connector (``register_kv_caches``).
Their shapes differ between vLLM versions and attention backends, so every supported shape is named by a
:class:`KVLayoutKind` and reduced to one *canonical strided view* ``[num_blocks, 2, block_size, heads,
head_dim]`` (block, K/V, token-in-block, head, dim) without copying. The kernels only see that view's
strides, so a new backend layout needs one entry here and nothing else.

Host side: the *page-first* layout. A page holds ``n`` tokens (``n <= page_tokens``; only the last page of a
short chunk is shorter) of every layer's K and V contiguously::

    page = [num_layers * 2, n, heads * head_dim]      # row (2 * layer + kv), token, hidden

and pages follow each other. A whole-page buffer is ``[num_pages, num_layers * 2, page_tokens, hidden]``.

:class:`TransferPlan` is what the gather/scatter implementations execute: per page, where it sits in a flat
host tensor, how many tokens it holds, and the vLLM slot (``block * block_size + offset``) of each token.
Everything crossing a module boundary is a frozen dataclass; every check raises :class:`LayoutError` (a
``ValueError``) before any KV memory is read or written.
"""

from __future__ import annotations

import enum
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

#: dtypes the kernels move (bit-exactly; fp8 is moved as bytes).
SUPPORTED_DTYPES: tuple[torch.dtype, ...] = (
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
)

#: integer dtype of the same width, used to move elements as raw bits.
_BITS_DTYPE: dict[int, torch.dtype] = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class LayoutError(ValueError):
    """A KV cache, host buffer or block list does not match the layout it is used with."""


def bits_dtype(dtype: torch.dtype) -> torch.dtype:
    """The signed integer dtype with the same element size (for bit-exact moves)."""
    return _BITS_DTYPE[torch.empty(0, dtype=dtype).element_size()]


def check_dtype(dtype: torch.dtype) -> None:
    if dtype not in SUPPORTED_DTYPES:
        raise LayoutError(
            f"unsupported KV dtype {dtype}; supported: {', '.join(str(d) for d in SUPPORTED_DTYPES)}"
        )


class KVLayoutKind(str, enum.Enum):
    """Shape of one layer's paged KV tensor as an attention backend registers it.

    ``B`` blocks, ``N`` tokens per block, ``H`` KV heads, ``D`` head dim.
    """

    #: ``[2, B, N, H, D]``: vLLM <= 0.11 FlashAttention backend (``kv_cache[0]`` is K).
    KV_FIRST = "kv_first"
    #: ``[B, 2, N, H, D]``: vLLM <= 0.11 FlashInfer / Triton backends, LMCache's "NL_X_TWO_NB_BS_NH_HS".
    BLOCK_FIRST = "block_first"
    #: ``[B, 2, H, N, D]``: the same with head-major block interiors (FlashInfer ``HND``).
    BLOCK_FIRST_HND = "block_first_hnd"
    #: ``[B, H, N, 2*D]`` with K = ``[..., :D]``: vLLM >= 0.32 FlashAttention / Triton attention
    #: (``kv_cache.transpose(1, 2).split(D, -1)``); any physical order (LBHNC, LBNHC, ...) via strides.
    SPLIT_LAST_DIM = "split_last_dim"
    #: ``[B, H, N, 2*D]`` read as ``[B, H, 2, N, D]``: vLLM >= 0.32 CPU backend (``cpu_attn``), which views a
    #: block/head plane as ``2*N`` rows of ``D`` and takes K from the first ``N`` rows.
    SPLIT_TOKEN_DIM = "split_token_dim"
    #: ``[B, 2*H, N, D]`` with K = heads ``[:H]``: vLLM >= 0.32 FlashInfer head-slot mode.
    SPLIT_HEAD_DIM = "split_head_dim"


def vllm_cache_shape(
    kind: KVLayoutKind, num_blocks: int, block_size: int, num_heads: int, head_dim: int
) -> tuple[int, ...]:
    """The per-layer tensor shape a backend of ``kind`` registers (for tests and benchmarks)."""
    b, n, h, d = num_blocks, block_size, num_heads, head_dim
    kind = KVLayoutKind(kind)
    return {
        KVLayoutKind.KV_FIRST: (2, b, n, h, d),
        KVLayoutKind.BLOCK_FIRST: (b, 2, n, h, d),
        KVLayoutKind.BLOCK_FIRST_HND: (b, 2, h, n, d),
        KVLayoutKind.SPLIT_LAST_DIM: (b, h, n, 2 * d),
        KVLayoutKind.SPLIT_TOKEN_DIM: (b, h, n, 2 * d),
        KVLayoutKind.SPLIT_HEAD_DIM: (b, 2 * h, n, d),
    }[kind]


def canonical_view(cache: torch.Tensor, kind: KVLayoutKind, head_dim: int | None = None) -> torch.Tensor:
    """View one layer's tensor as ``[B, 2, N, H, D]`` (block, K/V, token, head, dim) without copying.

    Works for any physical order (strides) of the logical shape. ``head_dim``, when given, is checked.
    """
    kind = KVLayoutKind(kind)
    if cache.dim() not in (4, 5):
        raise LayoutError(f"a {kind.value} KV tensor has 4 or 5 dims, got shape {tuple(cache.shape)}")
    if kind is KVLayoutKind.KV_FIRST:
        _expect_dims(cache, kind, 5)
        if cache.shape[0] != 2:
            raise LayoutError(f"{kind.value} expects [2, B, N, H, D], got {tuple(cache.shape)}")
        view = cache.permute(1, 0, 2, 3, 4)
    elif kind is KVLayoutKind.BLOCK_FIRST:
        _expect_dims(cache, kind, 5)
        if cache.shape[1] != 2:
            raise LayoutError(f"{kind.value} expects [B, 2, N, H, D], got {tuple(cache.shape)}")
        view = cache
    elif kind is KVLayoutKind.BLOCK_FIRST_HND:
        _expect_dims(cache, kind, 5)
        if cache.shape[1] != 2:
            raise LayoutError(f"{kind.value} expects [B, 2, H, N, D], got {tuple(cache.shape)}")
        view = cache.permute(0, 1, 3, 2, 4)
    elif kind is KVLayoutKind.SPLIT_LAST_DIM:
        _expect_dims(cache, kind, 4)
        b, h, n, c = cache.shape
        if c % 2:
            raise LayoutError(f"{kind.value} expects [B, H, N, 2*D], last dim {c} is odd")
        view = cache.unflatten(3, (2, c // 2)).permute(0, 3, 2, 1, 4)
    elif kind is KVLayoutKind.SPLIT_TOKEN_DIM:
        _expect_dims(cache, kind, 4)
        b, h, n, c = cache.shape
        if c % 2:
            raise LayoutError(f"{kind.value} expects [B, H, N, 2*D], last dim {c} is odd")
        try:
            planes = cache.view(b, h, 2, n, c // 2)
        except RuntimeError as exc:
            raise LayoutError(
                f"{kind.value} needs each block/head plane [N, 2*D] to be contiguous (strides "
                f"{tuple(cache.stride())}): {exc}"
            ) from exc
        view = planes.permute(0, 2, 3, 1, 4)
    elif kind is KVLayoutKind.SPLIT_HEAD_DIM:
        _expect_dims(cache, kind, 4)
        b, h2, n, d = cache.shape
        if h2 % 2:
            raise LayoutError(f"{kind.value} expects [B, 2*H, N, D], head dim {h2} is odd")
        view = cache.unflatten(1, (2, h2 // 2)).permute(0, 1, 3, 2, 4)
    else:  # pragma: no cover - exhaustive
        raise LayoutError(f"unknown layout kind {kind}")
    if head_dim is not None and view.shape[4] != head_dim:
        raise LayoutError(f"head_dim {head_dim} does not match the tensor's {view.shape[4]} ({kind.value})")
    return view


def _expect_dims(cache: torch.Tensor, kind: KVLayoutKind, ndim: int) -> None:
    if cache.dim() != ndim:
        raise LayoutError(
            f"{kind.value} expects a {ndim}-dim tensor {_SYMBOLIC_SHAPE[kind]}, got shape {tuple(cache.shape)}"
        )


_SYMBOLIC_SHAPE: dict[KVLayoutKind, str] = {
    KVLayoutKind.KV_FIRST: "[2, B, N, H, D]",
    KVLayoutKind.BLOCK_FIRST: "[B, 2, N, H, D]",
    KVLayoutKind.BLOCK_FIRST_HND: "[B, 2, H, N, D]",
    KVLayoutKind.SPLIT_LAST_DIM: "[B, H, N, 2*D]",
    KVLayoutKind.SPLIT_TOKEN_DIM: "[B, H, N, 2*D]",
    KVLayoutKind.SPLIT_HEAD_DIM: "[B, 2*H, N, D]",
}


@dataclass(frozen=True)
class PagedKVLayout:
    """All layers' paged KV tensors, described through their canonical ``[B, 2, N, H, D]`` views.

    ``strides`` are element strides of that view (identical for every layer; checked).
    """

    kind: KVLayoutKind
    num_layers: int
    num_blocks: int
    block_size: int
    num_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device
    strides: tuple[int, int, int, int, int]

    @property
    def hidden(self) -> int:
        """Elements of one token of one layer's K (or V): ``heads * head_dim``."""
        return self.num_heads * self.head_dim

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def element_size(self) -> int:
        return torch.empty(0, dtype=self.dtype).element_size()

    @property
    def token_bytes(self) -> int:
        """Bytes of one token across all layers, K and V."""
        return 2 * self.num_layers * self.hidden * self.element_size

    @property
    def row_contiguous(self) -> bool:
        """Whether one token's ``heads * head_dim`` elements are contiguous in a layer tensor."""
        s = self.strides
        return s[4] == 1 and (self.num_heads == 1 or s[3] == self.head_dim)


def describe_kv_caches(
    kv_caches: Sequence[torch.Tensor], kind: KVLayoutKind | str
) -> tuple[PagedKVLayout, tuple[torch.Tensor, ...]]:
    """Validate the per-layer tensors and return their layout and canonical views (same order)."""
    kind = KVLayoutKind(kind)
    if len(kv_caches) == 0:
        raise LayoutError("no KV cache tensors given")
    views = tuple(canonical_view(t, kind) for t in kv_caches)
    first, v0 = kv_caches[0], views[0]
    check_dtype(first.dtype)
    for i, (t, v) in enumerate(zip(kv_caches, views)):
        if t.shape != first.shape or t.dtype != first.dtype or t.device != first.device:
            raise LayoutError(
                f"layer {i}: {tuple(t.shape)} {t.dtype} on {t.device} differs from layer 0's "
                f"{tuple(first.shape)} {first.dtype} on {first.device}"
            )
        if v.stride() != v0.stride():
            raise LayoutError(f"layer {i}: strides {v.stride()} differ from layer 0's {v0.stride()}")
    if v0.stride(4) != 1:
        raise LayoutError(f"head_dim must be the innermost, contiguous dim (canonical strides {v0.stride()})")
    b, _, n, h, d = v0.shape
    layout = PagedKVLayout(
        kind=kind,
        num_layers=len(kv_caches),
        num_blocks=b,
        block_size=n,
        num_heads=h,
        head_dim=d,
        dtype=first.dtype,
        device=first.device,
        strides=tuple(v0.stride()),
    )
    return layout, views


@dataclass(frozen=True)
class PageFirstLayout:
    """The host page-first format for one model: what every page and chunk in it looks like."""

    num_layers: int
    num_heads: int
    head_dim: int
    page_tokens: int
    dtype: torch.dtype

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_heads", "head_dim", "page_tokens"):
            if int(getattr(self, name)) <= 0:
                raise LayoutError(f"PageFirstLayout.{name} must be positive, got {getattr(self, name)}")
        check_dtype(self.dtype)

    @classmethod
    def for_kv(cls, kv: PagedKVLayout, page_tokens: int) -> PageFirstLayout:
        return cls(kv.num_layers, kv.num_heads, kv.head_dim, page_tokens, kv.dtype)

    @property
    def hidden(self) -> int:
        return self.num_heads * self.head_dim

    def page_elems(self, num_tokens: int | None = None) -> int:
        """Elements of one page holding ``num_tokens`` (default: a full page)."""
        n = self.page_tokens if num_tokens is None else num_tokens
        return 2 * self.num_layers * n * self.hidden

    def buffer_shape(self, num_pages: int) -> tuple[int, int, int, int]:
        """Shape of a buffer of ``num_pages`` full pages."""
        return (num_pages, 2 * self.num_layers, self.page_tokens, self.hidden)

    def chunk_pages(self, num_tokens: int) -> tuple[int, int]:
        """How a chunk of ``num_tokens`` is paged: ``(num_pages, tokens_per_page)``.

        A multiple of ``page_tokens`` is cut into full pages; any other length is one page of all its tokens
        (so that the chunk's shape says exactly how its bytes are ordered; see :meth:`chunk_shape`).
        """
        if num_tokens <= 0:
            raise LayoutError(f"a chunk needs at least one token, got {num_tokens}")
        if num_tokens % self.page_tokens == 0:
            return num_tokens // self.page_tokens, self.page_tokens
        return 1, num_tokens

    def chunk_shape(self, num_tokens: int) -> torch.Size:
        """4-D shape recorded for a page-first chunk: ``[num_pages, 2 * num_layers, tokens_per_page, hidden]``."""
        p, n = self.chunk_pages(num_tokens)
        return torch.Size([p, 2 * self.num_layers, n, self.hidden])

    def check_chunk_shape(self, shape: Sequence[int], dtype: torch.dtype) -> int:
        """Validate a recorded chunk shape/dtype against this layout; return its token count."""
        shape = tuple(int(s) for s in shape)
        if dtype != self.dtype:
            raise LayoutError(f"page-first chunk dtype {dtype} != expected {self.dtype}")
        if len(shape) != 4:
            raise LayoutError(f"page-first chunk shape must be 4-D [pages, 2*layers, tokens, hidden], got {shape}")
        p, rows, n, hid = shape
        if rows != 2 * self.num_layers or hid != self.hidden:
            raise LayoutError(
                f"page-first chunk shape {shape} is for another model: expected rows {2 * self.num_layers} "
                f"and hidden {self.hidden}"
            )
        if p < 1 or n < 1:
            raise LayoutError(f"page-first chunk shape {shape} is empty")
        if p > 1 and n != self.page_tokens:
            raise LayoutError(f"page-first chunk shape {shape}: multi-page chunks use {self.page_tokens}-token pages")
        if tuple(self.chunk_shape(p * n)) != shape:
            raise LayoutError(f"page-first chunk shape {shape} is not how this layout pages {p * n} tokens")
        return p * n


@dataclass(frozen=True)
class TransferPlan:
    """One gather or scatter: every page, where it lives on the host, and the slot of each of its tokens.

    ``host`` is a flat 1-D tensor; page ``p`` occupies ``host[host_offsets[p] : host_offsets[p] +
    2 * num_layers * page_ntok[p] * hidden]`` in page-first order. Its tokens' slots are
    ``slots[tok_start[p] : tok_start[p] + page_ntok[p]]``; a negative slot (scatter only) leaves that token
    untouched. Index tensors are int64 on the CPU.
    """

    kv: PagedKVLayout
    host: torch.Tensor
    host_offsets: torch.Tensor
    page_ntok: torch.Tensor
    tok_start: torch.Tensor
    slots: torch.Tensor
    max_page_tokens: int

    @property
    def num_pages(self) -> int:
        return int(self.host_offsets.numel())

    @property
    def num_tokens(self) -> int:
        return int(self.slots.numel())

    @property
    def nbytes(self) -> int:
        """KV bytes moved (skipped tokens included)."""
        return self.num_tokens * self.kv.token_bytes


def validate_plan(plan: TransferPlan, to_host: bool) -> None:
    """Every check that must pass before a kernel touches memory; raises :class:`LayoutError`."""
    kv = plan.kv
    idx = (plan.host_offsets, plan.page_ntok, plan.tok_start, plan.slots)
    for name, t in zip(("host_offsets", "page_ntok", "tok_start", "slots"), idx):
        if t.dtype != torch.int64 or t.dim() != 1 or t.device.type != "cpu":
            raise LayoutError(f"plan.{name} must be a 1-D int64 CPU tensor, got {t.dtype} {tuple(t.shape)} {t.device}")
    p = plan.num_pages
    if not (plan.page_ntok.numel() == plan.tok_start.numel() == p):
        raise LayoutError("plan page arrays differ in length")
    if plan.host.dim() != 1:
        raise LayoutError(f"plan.host must be flat, got shape {tuple(plan.host.shape)}")
    if plan.host.dtype != kv.dtype:
        raise LayoutError(f"host buffer dtype {plan.host.dtype} != KV cache dtype {kv.dtype}")
    if p == 0:
        return
    ntok = plan.page_ntok
    if int(ntok.min()) < 1:
        raise LayoutError("every page needs at least one token")
    if int(ntok.max()) > plan.max_page_tokens:
        raise LayoutError("plan.max_page_tokens is smaller than a page")
    if int(plan.tok_start.min()) < 0 or int((plan.tok_start + ntok).max()) > plan.num_tokens:
        raise LayoutError("page token ranges fall outside the slot list")
    sizes = 2 * kv.num_layers * kv.hidden * ntok
    ends = plan.host_offsets + sizes
    if int(plan.host_offsets.min()) < 0 or int(ends.max()) > plan.host.numel():
        raise LayoutError(
            f"host pages need elements [{int(plan.host_offsets.min())}, {int(ends.max())}) "
            f"but the host buffer has {plan.host.numel()}"
        )
    if to_host and p > 1:
        order = torch.argsort(plan.host_offsets)
        if bool((ends[order][:-1] > plan.host_offsets[order][1:]).any()):
            raise LayoutError("two destination host pages overlap")
    slots = plan.slots
    if slots.numel():
        lo, hi = int(slots.min()), int(slots.max())
        if hi >= kv.num_slots or (lo < 0 and (to_host or lo < -1)):
            bad = slots[(slots >= kv.num_slots) | (slots < (0 if to_host else -1))]
            raise LayoutError(
                f"slot/block ids out of range: slots {bad[:8].tolist()} (block = slot // {kv.block_size}) "
                f"with {kv.num_blocks} blocks of {kv.block_size} tokens"
            )
        if not to_host:
            live = slots[slots >= 0]
            if live.numel() != torch.unique(live).numel():
                raise LayoutError("scatter writes the same destination slot twice (repeated block ids)")


def pick_align(elem_size: int, offsets: Sequence[int]) -> int:
    """Largest power of two <= 16 bytes / element size dividing every offset (a kernel alignment hint)."""
    align = max(1, 16 // elem_size)
    g = 0
    for o in offsets:
        g = math.gcd(g, int(o))
    while align > 1 and g % align:
        align //= 2
    return align
