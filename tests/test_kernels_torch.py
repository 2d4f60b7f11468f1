"""kvtier.kernels torch path: bit-exact against a naive per-element reference, and validation errors.

The reference below reads each backend's native tensor by its own indexing rule (not through
``canonical_view``), element by element, so it checks the layout interpretation as well as the copy. The
Triton tests load this file by path and reuse ``make_case`` / ``run_case``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

from kvtier.kernels import (
    HostChunk,
    KVLayoutKind,
    LayoutError,
    PageMover,
    canonical_view,
    gather_pages,
    scatter_pages,
    vllm_cache_shape,
)
from kvtier.kernels.layout import bits_dtype

K = KVLayoutKind
DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float8_e4m3fn]


# ---------------------------------------------------------------------------------------------------------
# naive reference


def native_index(kind: KVLayoutKind, b: int, kv: int, n: int, h: int, d: int, N: int, H: int, D: int) -> tuple:
    """Index of element (block b, K/V kv, token n, head h, dim d) in a layer tensor of ``kind``."""
    if kind is K.KV_FIRST:
        return (kv, b, n, h, d)
    if kind is K.BLOCK_FIRST:
        return (b, kv, n, h, d)
    if kind is K.BLOCK_FIRST_HND:
        return (b, kv, h, n, d)
    if kind is K.SPLIT_LAST_DIM:  # K = [..., :D], V = [..., D:]
        return (b, h, n, kv * D + d)
    if kind is K.SPLIT_TOKEN_DIM:  # plane [N, 2D] read as [2N, D]: K rows first
        f = (kv * N + n) * D + d
        return (b, h, f // (2 * D), f % (2 * D))
    if kind is K.SPLIT_HEAD_DIM:  # heads [:H] are K
        return (b, kv * H + h, n, d)
    raise AssertionError(kind)


def as_np(t: torch.Tensor) -> np.ndarray:
    return t.view(bits_dtype(t.dtype)).numpy()


def naive_transfer(case: Case, caches: list[torch.Tensor], host: torch.Tensor, to_host: bool):
    """Expected (caches, host) after the case's transfer, as numpy int arrays (inputs untouched)."""
    nat = [as_np(c).copy() for c in caches]
    hst = as_np(host).reshape(-1).copy()
    N, H, D, pt = case.block_size, case.heads, case.head_dim, case.page_tokens
    page_elems = 2 * case.layers * pt * H * D
    toks = [(case.block_ids[g // N], g % N) for g in range(len(case.block_ids) * N)]
    for p, dst in enumerate(case.host_page_ids):
        for t in range(pt):
            b, o = toks[p * pt + t]
            for layer in range(case.layers):
                for kv in range(2):
                    row = dst * page_elems + ((2 * layer + kv) * pt + t) * H * D
                    for h in range(H):
                        for d in range(D):
                            idx = native_index(case.kind, b, kv, o, h, d, N, H, D)
                            if to_host:
                                hst[row + h * D + d] = nat[layer][idx]
                            else:
                                nat[layer][idx] = hst[row + h * D + d]
    return nat, hst


# ---------------------------------------------------------------------------------------------------------
# random cases


@dataclass
class Case:
    kind: KVLayoutKind
    dtype: torch.dtype
    layers: int
    num_blocks: int
    block_size: int
    heads: int
    head_dim: int
    page_tokens: int
    block_ids: list[int]
    host_page_ids: list[int]
    host_pages: int
    storage: str  # "separate" | "shared" (one allocation, layer views) | "permuted" (other physical order)
    seed: int = 0
    note: str = field(default="")

    def label(self) -> str:
        dt = str(self.dtype).replace("torch.", "")
        return (
            f"{self.kind.value}-{dt}-L{self.layers}-N{self.block_size}-H{self.heads}-D{self.head_dim}"
            f"-pt{self.page_tokens}-{len(self.block_ids)}blk-{self.storage}{('-' + self.note) if self.note else ''}"
        )


def make_caches(case: Case) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(case.seed)
    shape = vllm_cache_shape(case.kind, case.num_blocks, case.block_size, case.heads, case.head_dim)
    bits = bits_dtype(case.dtype)
    info = torch.iinfo(bits)

    def rand(*s):
        return torch.randint(info.min, info.max, s, generator=g, dtype=torch.int64).to(bits).view(case.dtype)

    if case.storage == "shared":
        big = rand(case.layers, *shape)
        return [big[i] for i in range(case.layers)]
    if case.storage == "permuted":
        # allocate in another physical order, present the logical shape (like vLLM's KVCacheLayout views)
        if case.kind in (K.SPLIT_LAST_DIM, K.SPLIT_HEAD_DIM):
            b, h, n, c = shape
            return [rand(b, n, h, c).permute(0, 2, 1, 3) for _ in range(case.layers)]  # LBNHC
        if case.kind is K.BLOCK_FIRST:
            b, two, n, h, d = shape
            return [rand(two, b, n, h, d).transpose(0, 1) for _ in range(case.layers)]
        raise AssertionError(case.kind)
    return [rand(*shape) for _ in range(case.layers)]


def make_host(case: Case) -> torch.Tensor:
    g = torch.Generator().manual_seed(case.seed + 1)
    bits = bits_dtype(case.dtype)
    info = torch.iinfo(bits)
    shape = (case.host_pages, 2 * case.layers, case.page_tokens, case.heads * case.head_dim)
    return torch.randint(info.min, info.max, shape, generator=g, dtype=torch.int64).to(bits).view(case.dtype)


def make_case(seed: int, *, kind=None, dtype=None, page_mult=None, nblocks=None, storage=None, repeat=False) -> Case:
    rng = random.Random(seed)
    kind = kind or rng.choice(list(K))
    dtype = dtype or rng.choice(DTYPES)
    block_size = rng.choice([2, 4, 8])
    heads = rng.choice([1, 2, 3])
    head_dim = rng.choice([2, 4, 8])
    layers = rng.choice([1, 2, 3])
    num_blocks = rng.choice([6, 9, 12])
    mult = page_mult if page_mult is not None else rng.choice([0.5, 1, 2, 4])
    page_tokens = max(1, int(block_size * mult))
    if block_size % page_tokens and page_tokens % block_size:
        page_tokens = block_size
    per_page = max(1, page_tokens // block_size)
    if nblocks is None:
        nblocks = per_page * rng.choice([1, 2, 3])
    nblocks = max(nblocks, 0)
    if repeat:
        pool = [rng.randrange(num_blocks) for _ in range(max(1, nblocks // 2))]
        block_ids = [rng.choice(pool) for _ in range(nblocks)]
    else:
        block_ids = rng.sample(range(num_blocks), min(nblocks, num_blocks))
        while (len(block_ids) * block_size) % page_tokens:
            block_ids.pop()
    num_pages = len(block_ids) * block_size // page_tokens
    host_pages = num_pages + rng.choice([0, 1, 2])
    host_page_ids = rng.sample(range(host_pages), num_pages)
    if storage is None:
        storage = rng.choice(["separate", "shared"])
    return Case(
        kind=kind, dtype=dtype, layers=layers, num_blocks=num_blocks, block_size=block_size, heads=heads,
        head_dim=head_dim, page_tokens=page_tokens, block_ids=block_ids, host_page_ids=host_page_ids,
        host_pages=host_pages, storage=storage, seed=seed,
    )


def run_case(case: Case, impl: str) -> None:
    """Gather, check bit-exactly; then scatter (unique destinations only), check bit-exactly."""
    caches = make_caches(case)
    host = make_host(case)
    mover = PageMover(caches, case.kind, case.page_tokens, impl=impl)
    exp_caches, exp_host = naive_transfer(case, caches, host, to_host=True)
    mover.gather_blocks(case.block_ids, host, case.host_page_ids)
    assert np.array_equal(as_np(host).reshape(-1), exp_host), f"gather mismatch: {case.label()}"
    for c, e in zip(caches, exp_caches):
        assert np.array_equal(as_np(c), e), "gather modified the KV cache"
    if len(set(case.block_ids)) != len(case.block_ids):
        return
    host2 = make_host(Case(**{**case.__dict__, "seed": case.seed + 7}))
    exp_caches, exp_host = naive_transfer(case, caches, host2, to_host=False)
    mover.scatter_blocks(case.block_ids, host2, case.host_page_ids)
    for c, e in zip(caches, exp_caches):
        assert np.array_equal(as_np(c), e), f"scatter mismatch: {case.label()}"
    assert np.array_equal(as_np(host2).reshape(-1), exp_host), "scatter modified the host buffer"


def standard_cases() -> list[Case]:
    """The shared matrix: every kind x dtype, edge-case block lists, page sizes, storage layouts."""
    cases = []
    for i, kind in enumerate(K):
        for j, dtype in enumerate(DTYPES):
            cases.append(make_case(100 + 10 * i + j, kind=kind, dtype=dtype))
    cases.append(make_case(1, nblocks=0, page_mult=1))
    empty = cases[-1]
    empty.note = "empty"
    for s, mult in ((2, 0.5), (3, 1), (4, 2), (5, 4)):
        c = make_case(s, page_mult=mult, nblocks=1 if mult <= 1 else int(mult))
        c.note = "one-page"
        cases.append(c)
    for s in (6, 7):
        c = make_case(s, repeat=True, nblocks=6, page_mult=1)
        c.note = "repeated"
        cases.append(c)
    c = make_case(8, page_mult=1, nblocks=5)
    c.block_ids = sorted(c.block_ids, reverse=True)
    c.note = "unsorted"
    cases.append(c)
    for s, kind in ((9, K.SPLIT_LAST_DIM), (10, K.SPLIT_HEAD_DIM), (11, K.BLOCK_FIRST)):
        c = make_case(s, kind=kind, storage="permuted")
        cases.append(c)
    return cases


def big_page_case() -> Case:
    """256-token pages from 16-token blocks (tiny heads so the reference stays fast)."""
    return Case(
        kind=K.SPLIT_TOKEN_DIM, dtype=torch.bfloat16, layers=2, num_blocks=40, block_size=16, heads=1,
        head_dim=2, page_tokens=256, block_ids=list(range(39, 7, -1)), host_page_ids=[1, 0], host_pages=3,
        storage="shared", seed=42, note="256-from-16",
    )


# ---------------------------------------------------------------------------------------------------------
# tests


@pytest.mark.parametrize("case", standard_cases() + [big_page_case()], ids=lambda c: c.label())
def test_torch_bit_exact(case: Case) -> None:
    run_case(case, "torch")


def test_canonical_view_is_a_view() -> None:
    for kind in K:
        t = torch.zeros(vllm_cache_shape(kind, 3, 4, 2, 8))
        v = canonical_view(t, kind)
        assert tuple(v.shape) == (3, 2, 4, 2, 8)
        assert v.data_ptr() == t.data_ptr() and v.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()


def test_chunks_partial_pages_and_skipped_slots() -> None:
    """Chunk API: several chunks in one storage plus one elsewhere, a short one-page chunk, skipped slots."""
    kind, N, H, D, L, B = K.SPLIT_TOKEN_DIM, 4, 2, 4, 2, 16
    caches = [torch.randn(vllm_cache_shape(kind, B, N, H, D)).to(torch.bfloat16) for _ in range(L)]
    mover = PageMover(caches, kind, 8, impl="torch")
    pg = mover.pages
    slots = torch.randperm(B * N)[:40]
    lens = [16, 8, 13, 3]  # 2 pages, 1 page, one 13-token page, one 3-token page
    pool = torch.zeros(sum(pg.page_elems(n) for n in lens) + 64, dtype=torch.bfloat16)
    other = torch.zeros(pg.page_elems(lens[3]), dtype=torch.bfloat16)
    chunks, off, s0 = [], 32, 0
    for i, n in enumerate(lens):
        region = other if i == 3 else pool[off : off + pg.page_elems(n)]
        off += 0 if i == 3 else pg.page_elems(n)
        chunks.append(HostChunk(host=region, slots=slots[s0 : s0 + n]))
        s0 += n
    assert len(mover.plan_chunks(chunks)) == 2  # one plan per host storage
    mover.gather_chunks(chunks)
    views = [canonical_view(c, kind) for c in caches]
    s0 = 0
    for c, n in zip(chunks, lens):
        p, per = pg.chunk_pages(n)
        got = c.host.view(p, L, 2, per, H, D)
        sl = slots[s0 : s0 + n]
        for layer in range(L):
            exp = views[layer][sl // N, :, sl % N]  # [n, 2, H, D]
            assert torch.equal(got[:, layer].permute(0, 2, 1, 3, 4).reshape(n, 2, H, D), exp)
        s0 += n
    # scatter back into zeroed caches with the first 5 tokens of chunk 0 skipped
    dst = [torch.zeros_like(c) for c in caches]
    m2 = PageMover(dst, kind, 8, impl="torch")
    chunks2 = [HostChunk(c.host, c.slots.clone()) for c in chunks]
    chunks2[0].slots[:5] = -1
    m2.scatter_chunks(chunks2)
    dviews = [canonical_view(c, kind) for c in dst]
    for layer in range(L):
        rest = slots[5:]
        assert torch.equal(dviews[layer][rest // N, :, rest % N], views[layer][rest // N, :, rest % N])
        assert not dviews[layer][slots[:5] // N, :, slots[:5] % N].any()


def test_one_shot_functions() -> None:
    kind = K.KV_FIRST
    caches = [torch.randn(vllm_cache_shape(kind, 5, 4, 2, 4)) for _ in range(2)]
    host = torch.zeros(2, 4, 8, 8)
    gather_pages(caches, kind, [4, 1, 2, 0], host, 8)
    dst = [torch.zeros_like(c) for c in caches]
    scatter_pages(dst, kind, [4, 1, 2, 0], host, 8)
    for c, d in zip(caches, dst):
        assert torch.equal(c[:, [4, 1, 2, 0]], d[:, [4, 1, 2, 0]])
        assert not d[:, 3].any()


# ---------------------------------------------------------------------------------------------------------
# errors: raised before any memory is touched


def _setup(kind=K.BLOCK_FIRST, pt=4):
    caches = [torch.randn(vllm_cache_shape(kind, 6, 4, 2, 4)) for _ in range(2)]
    host = torch.randn(3, 4, pt, 8)
    return caches, host, PageMover(caches, kind, pt, impl="torch")


@pytest.mark.parametrize(
    "block_ids, match",
    [([0, 6], "out of range"), ([-1], "out of range"), ([2, 100, 3], "out of range")],
)
@pytest.mark.parametrize("to_host", [True, False])
def test_out_of_range_blocks_touch_nothing(block_ids, match, to_host) -> None:
    caches, host, mover = _setup(pt=4)
    before = [c.clone() for c in caches], host.clone()
    with pytest.raises(LayoutError, match=match):
        (mover.gather_blocks if to_host else mover.scatter_blocks)(block_ids, host)
    assert all(torch.equal(a, b) for a, b in zip(before[0], caches)) and torch.equal(before[1], host)


def test_bad_slots_in_chunks_touch_nothing() -> None:
    caches, host, mover = _setup(pt=4)
    before = [c.clone() for c in caches]
    good = HostChunk(torch.zeros(2 * 2 * 4 * 8), torch.arange(4))
    bad = HostChunk(torch.zeros(2 * 2 * 4 * 8), torch.tensor([0, 1, 2, 24]))
    with pytest.raises(LayoutError, match="out of range"):
        mover.scatter_chunks([good, bad])
    with pytest.raises(LayoutError, match="out of range"):
        mover.gather_chunks([good, HostChunk(bad.host, torch.tensor([0, -1, 2, 3]))])
    assert not good.host.any() and all(torch.equal(a, b) for a, b in zip(before, caches))


def test_shape_and_buffer_errors() -> None:
    caches, host, mover = _setup(pt=4)
    with pytest.raises(LayoutError, match="differs from layer 0"):
        PageMover([caches[0], torch.randn(vllm_cache_shape(K.BLOCK_FIRST, 7, 4, 2, 4))], K.BLOCK_FIRST, 4)
    with pytest.raises(LayoutError, match="differs from layer 0"):
        PageMover([caches[0], caches[1].half()], K.BLOCK_FIRST, 4)
    with pytest.raises(LayoutError, match=r"\[2, B, N, H, D\]"):
        PageMover(caches, K.KV_FIRST, 4)
    with pytest.raises(LayoutError, match="5-dim"):
        PageMover([torch.zeros(6, 2, 4, 8)], K.BLOCK_FIRST, 4)
    with pytest.raises(LayoutError, match="unsupported KV dtype"):
        PageMover([torch.zeros(6, 2, 4, 2, 4, dtype=torch.int32)], K.BLOCK_FIRST, 4)
    with pytest.raises(LayoutError, match="dtype"):
        mover.gather_blocks([0], host.half())
    with pytest.raises(LayoutError, match="contiguous"):
        mover.gather_blocks([0], host.transpose(1, 2))
    with pytest.raises(LayoutError, match="whole pages"):
        mover.gather_blocks([0], torch.zeros(3 * 4 * 4 * 8 + 1))
    with pytest.raises(LayoutError, match="do not fit"):
        mover.gather_blocks([0, 1, 2, 3], host)
    with pytest.raises(LayoutError, match="host page ids"):
        mover.gather_blocks([0], host, host_page_ids=[3])
    with pytest.raises(LayoutError, match="twice"):
        mover.scatter_blocks([1, 1], host)
    m8 = PageMover(caches, K.BLOCK_FIRST, 8, impl="torch")
    with pytest.raises(LayoutError, match="whole 8-token pages"):
        m8.gather_blocks([0], torch.zeros(2, 4, 8, 8))
    with pytest.raises(LayoutError, match="overlap"):
        mover.gather_chunks([HostChunk(host.view(-1)[:128], torch.arange(4)),
                             HostChunk(host.view(-1)[64:192], torch.arange(4, 8))])
    with pytest.raises(LayoutError, match="elements"):
        mover.gather_chunks([HostChunk(host.view(-1)[:100], torch.arange(4))])
    with pytest.raises(LayoutError, match="unknown impl"):
        PageMover(caches, K.BLOCK_FIRST, 4, impl="cuda")  # type: ignore[arg-type]
    with pytest.raises(LayoutError, match="Triton path needs a GPU"):
        import os

        if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
            raise LayoutError("Triton path needs a GPU (interpreter active here; skipped)")
        PageMover(caches, K.BLOCK_FIRST, 4, impl="triton").gather_blocks([0], host)


def test_chunks_unaligned_offsets() -> None:
    """Chunks whose host offsets differ modulo the row size take the element-index path."""
    kind, N, H, D, L, B = K.BLOCK_FIRST_HND, 4, 3, 2, 2, 8
    caches = [torch.randn(vllm_cache_shape(kind, B, N, H, D)) for _ in range(L)]
    mover = PageMover(caches, kind, 4, impl="torch")
    pg = mover.pages
    slots = torch.randperm(B * N)[:12]
    pool = torch.zeros(3 * pg.page_elems(4) + 16)
    a, b = pool[3 : 3 + pg.page_elems(8)], pool[3 + pg.page_elems(8) + 5 : 3 + pg.page_elems(12) + 5]
    chunks = [HostChunk(a, slots[:8]), HostChunk(b, slots[8:])]
    mover.gather_chunks(chunks)
    dst = [torch.zeros_like(c) for c in caches]
    PageMover(dst, kind, 4, impl="torch").scatter_chunks(chunks)
    for c, d in zip(caches, dst):
        cv, dv = canonical_view(c, kind), canonical_view(d, kind)
        assert torch.equal(cv[slots // N, :, slots % N], dv[slots // N, :, slots % N])
    assert pool[:3].eq(0).all() and pool[3 + pg.page_elems(8) : 3 + pg.page_elems(8) + 5].eq(0).all()


def test_imports_need_only_torch(tmp_path) -> None:
    """kvtier.kernels and the GPU benchmark import with lmcache, vllm and triton unavailable.

    Imported the way benchmarks/gpu_check.sh does it: a directory holding a symlink named ``kvtier``.
    """
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    (tmp_path / "kvtier").symlink_to(root)
    code = r"""
import importlib.abc, importlib.util, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("lmcache", "vllm", "triton"):
            raise ImportError("blocked: " + name)
sys.meta_path.insert(0, Block())
import kvtier.kernels as k
assert k.__file__.startswith(sys.argv[1]), k.__file__
spec = importlib.util.spec_from_file_location("gather_kernel", sys.argv[2])
mod = importlib.util.module_from_spec(spec); sys.modules["gather_kernel"] = mod; spec.loader.exec_module(mod)
bad = [m for m in sys.modules if m.split(".")[0] in ("lmcache", "vllm", "triton")]
assert not bad, bad
print("ok")
"""
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(tmp_path), "PYTHONNOUSERSITE": "1"}
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "kvtier"), str(root / "benchmarks" / "gather_kernel.py")],
        env=env, capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-2000:]
