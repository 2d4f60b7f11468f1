"""kvtier.kernels Triton kernel under the Triton interpreter: bit-exact against the naive reference.

``TRITON_INTERPRET=1`` only takes effect if it is set before triton is first imported, and other test
modules (LMCache, vLLM) import triton during collection. So the cases run in one subprocess that sets the
variable first; it reuses the case matrix and reference of ``test_kernels_torch.py`` (loaded by path) and
reports one JSON line per check, which the tests below assert on.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve()
TORCH_TESTS = HERE.with_name("test_kernels_torch.py")


def _load_torch_tests():
    import importlib.util

    spec = importlib.util.spec_from_file_location("kvtier_kernel_cases", TORCH_TESTS)
    mod = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    sys.modules[spec.name] = mod  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(mod)
    return mod


# ---------------------------------------------------------------------------------------------------------
# worker (runs in the subprocess)


def _worker() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    import torch

    from kvtier.kernels import HostChunk, KVLayoutKind, LayoutError, PageMover, triton_ops, vllm_cache_shape

    cases = _load_torch_tests()

    def report(name: str, ok: bool, detail: str = "") -> None:
        print(json.dumps({"name": name, "ok": ok, "detail": detail}), flush=True)

    # count launches and record grids
    launches: list[tuple] = []
    kernel = triton_ops._page_copy_kernel

    class _Counting:
        def __getitem__(self, grid):
            launches.append(tuple(grid))
            return kernel[grid]

    triton_ops._page_copy_kernel = _Counting()  # type: ignore[assignment]

    for case in cases.standard_cases() + [cases.big_page_case()]:
        launches.clear()
        try:
            cases.run_case(case, "triton")
            pages = len(case.host_page_ids)
            scattered = len(set(case.block_ids)) == len(case.block_ids)
            expect = 0 if pages == 0 else (2 if scattered else 1)
            if len(launches) != expect:
                raise AssertionError(f"{len(launches)} launches, expected {expect}")
            if any(g[0] > triton_ops.DEFAULT_MAX_PROGRAMS for g in launches):
                raise AssertionError(f"grid {launches} exceeds the program bound")
            report("case:" + case.label(), True)
        except Exception as exc:  # noqa: BLE001 - reported to the parent
            report("case:" + case.label(), False, f"{type(exc).__name__}: {exc}")

    # bounded programs: a tiny bound still moves everything (programs loop over work items)
    try:
        kind = KVLayoutKind.SPLIT_LAST_DIM
        caches = [torch.randn(vllm_cache_shape(kind, 8, 4, 2, 4)).to(torch.bfloat16) for _ in range(2)]
        ref_host = torch.zeros(4, 4, 4, 8, dtype=torch.bfloat16)
        PageMover(caches, kind, 4, impl="torch").gather_blocks([7, 0, 3, 5], ref_host)
        for progs in (1, 3):
            launches.clear()
            host = torch.zeros_like(ref_host)
            PageMover(caches, kind, 4, impl="triton", max_programs=progs).gather_blocks([7, 0, 3, 5], host)
            assert launches == [(progs,)], launches
            assert torch.equal(host.view(torch.int16), ref_host.view(torch.int16))
        report("bounded-programs", True)
    except Exception as exc:  # noqa: BLE001
        report("bounded-programs", False, f"{type(exc).__name__}: {exc}")

    # chunks in two storages + a short page + skipped slots, against the torch path
    try:
        kind = KVLayoutKind.SPLIT_TOKEN_DIM
        caches = [torch.randn(vllm_cache_shape(kind, 16, 4, 2, 4)).half() for _ in range(3)]
        mt = PageMover(caches, kind, 8, impl="triton")
        mr = PageMover(caches, kind, 8, impl="torch")
        pg = mt.pages
        slots = torch.randperm(64)[:27]
        pool = torch.zeros(pg.page_elems(24) + 40, dtype=torch.float16)
        other = torch.zeros(pg.page_elems(3), dtype=torch.float16)
        mk = lambda p, o: [HostChunk(p[8 : 8 + pg.page_elems(16)], slots[:16]),  # noqa: E731
                           HostChunk(p[8 + pg.page_elems(16) + 4 : 8 + pg.page_elems(24) + 4], slots[16:24]),
                           HostChunk(o, slots[24:])]
        ct, cr = mk(pool, other), mk(pool.clone(), other.clone())
        launches.clear()
        mt.gather_chunks(ct)
        assert len(launches) == 2, launches  # one per host storage
        mr.gather_chunks(cr)
        for a, b in zip(ct, cr):
            assert torch.equal(a.host.view(torch.int16), b.host.view(torch.int16))
        dt = [torch.zeros_like(c) for c in caches]
        dr = [torch.zeros_like(c) for c in caches]
        skip = [HostChunk(c.host, c.slots.clone()) for c in ct]
        skip[0].slots[:3] = -1
        PageMover(dt, kind, 8, impl="triton").scatter_chunks(skip)
        PageMover(dr, kind, 8, impl="torch").scatter_chunks(skip)
        for a, b in zip(dt, dr):
            assert torch.equal(a.view(torch.int16), b.view(torch.int16))
        report("chunks", True)
    except Exception as exc:  # noqa: BLE001
        report("chunks", False, f"{type(exc).__name__}: {exc}")

    # errors: raised before launching
    try:
        kind = KVLayoutKind.BLOCK_FIRST
        caches = [torch.randn(vllm_cache_shape(kind, 6, 4, 2, 4)) for _ in range(2)]
        host = torch.randn(3, 4, 4, 8)
        before = [c.clone() for c in caches], host.clone()
        m = PageMover(caches, kind, 4, impl="triton")
        launches.clear()
        for fn, ids in ((m.gather_blocks, [0, 6]), (m.scatter_blocks, [-2]), (m.scatter_blocks, [1, 1])):
            try:
                fn(ids, host)
            except LayoutError:
                pass
            else:
                raise AssertionError(f"{ids} accepted")
        assert not launches, launches
        assert all(torch.equal(a, b) for a, b in zip(before[0], caches)) and torch.equal(before[1], host)
        report("errors-before-launch", True)
    except Exception as exc:  # noqa: BLE001
        report("errors-before-launch", False, f"{type(exc).__name__}: {exc}")


def _aot_worker() -> None:
    """Compile the kernel for sm_90 without a GPU; report the width of its data loads/stores per variant."""
    import re

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kvtier.kernels import triton_ops

    fn = triton_ops._page_copy_kernel
    runtime = {"dev_ptr": "*i16", "host_ptr": "*i16", "layer_off_ptr": "*i64", "page_meta_ptr": "*i64",
               "slots_ptr": "*i64", "num_pages": "i32", "tiles_per_page": "i32", "iters": "i32", "s_blk": "i32",
               "s_kv": "i32", "s_tok": "i32", "s_head": "i32"}
    for row_contig in (True, False):
        for to_host in (True, False):
            const = dict(NUM_LAYERS=32, BLOCK_SIZE=16, HEAD_DIM=128, HIDDEN=1024, HIDDEN_P2=1024, TOK=4, ALIGN=8,
                         ROW_CONTIG=row_contig, TO_HOST=to_host)
            sig = dict(runtime, **{k: "constexpr" for k in const})
            names = list(sig)
            # what Triton's runtime specialization sees: 16-byte aligned pointers, strides divisible by 16
            attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in
                     ("dev_ptr", "host_ptr", "layer_off_ptr", "page_meta_ptr", "slots_ptr", "s_blk", "s_kv", "s_tok",
                      "s_head")}
            src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in const.items()},
                            attrs=attrs)
            ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8}).asm["ptx"]
            data = re.findall(r"(?:ld|st)\.global(?:\.\w+)*\.v4\.b32", ptx)
            print(json.dumps({"name": f"aot-row_contig={row_contig}-to_host={to_host}", "ok": len(data) >= 2,
                              "detail": f"{len(data)} 16-byte data accesses"}), flush=True)


# ---------------------------------------------------------------------------------------------------------
# tests (parent process)


@pytest.fixture(scope="module")
def worker_results() -> dict[str, dict]:
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONHASHSEED="0")
    proc = subprocess.run(
        [sys.executable, str(HERE), "--worker"], env=env, capture_output=True, text=True, timeout=600
    )
    results = {}
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            r = json.loads(line)
            results[r["name"]] = r
    if not results:
        pytest.fail(f"interpreter worker failed (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    if proc.returncode != 0:  # a crash (e.g. a wild write) fails the checks that did not report
        results["__crash__"] = {"detail": f"worker exited with {proc.returncode}: {proc.stderr[-2000:]}"}
    return results


def _case_names() -> list[str]:
    cases = _load_torch_tests()
    return ["case:" + c.label() for c in cases.standard_cases() + [cases.big_page_case()]]


@pytest.mark.parametrize("name", _case_names() + ["bounded-programs", "chunks", "errors-before-launch"])
def test_triton_interpreter(worker_results: dict, name: str) -> None:
    r = worker_results.get(name)
    assert r is not None, f"{name} did not run; {worker_results.get('__crash__', {}).get('detail', '')}"
    assert r["ok"], r["detail"]


def _no_cuda_backend() -> str | None:
    """Why this Triton cannot compile for CUDA here (not installed, or built without its NVIDIA backend), or None."""
    import importlib.util

    try:
        spec = importlib.util.find_spec("triton.backends.nvidia.compiler")
    except ImportError:
        spec = None
    if importlib.util.find_spec("triton") is None:
        return "Triton is not installed"
    return None if spec is not None else "this Triton has no NVIDIA backend (triton.backends.nvidia)"


def test_compiles_for_sm90_with_16_byte_accesses() -> None:
    """The kernel compiles for an H100/H200 (sm_90) here, without a GPU, and moves data in 16-byte vectors."""
    why = _no_cuda_backend()
    if why:  # a positive check that this Triton cannot target CUDA at all; any failure past it fails the test
        pytest.skip(why)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    proc = subprocess.run([sys.executable, str(HERE), "--aot"], env=env, capture_output=True, text=True, timeout=300)
    lines = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    assert proc.returncode == 0 and len(lines) == 4, f"rc {proc.returncode}: {proc.stderr[-3000:]}"
    for r in lines:
        assert r["ok"], r


if __name__ == "__main__" and "--worker" in sys.argv:
    _worker()
if __name__ == "__main__" and "--aot" in sys.argv:
    _aot_worker()
