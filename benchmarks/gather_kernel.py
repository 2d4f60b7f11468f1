"""Benchmark: kvtier's one-launch page kernel against per-page copies, batched copies and one big copy.

For Llama-3-8B / 70B-like KV shapes (32 / 80 layers, 8 KV heads, head dim 128, bf16) and 16- / 32-token
pages (vLLM block = page), in both directions (GPU->host gather, host->GPU scatter), median GB/s of

  (a)  kvtier ``PageMover`` (Triton kernel reading/writing pinned host memory, one launch; "a" includes
       plan building and validation on the CPU, "a_kern" replays a prebuilt plan),
  (b)  one ``copy_`` (cudaMemcpyAsync) per page per layer,
  (c)  one ``cudaMemcpyBatchAsync`` of the same copies (cuda-python, or libcudart through ctypes; skipped
       cleanly when neither is available),
  (d)  one large pinned-memory copy of the same number of bytes (the PCIe limit),

the ratios a/d, a/b, a/c, and the slowdown of a concurrent bf16 matmul while (a) runs (and, for reference,
while (d) runs). Also checks bit-exactness on the GPU first (Triton vs the torch path, fp8 included).

Imports only torch, triton and ``kvtier.kernels`` (no vLLM, no LMCache). Run on a GPU machine::

    python benchmarks/gather_kernel.py --json out.json             # a, b, d, matmul (+ c if available)
    python benchmarks/gather_kernel.py --methods c --json c.json   # (c) alone (isolated: ctypes ABI risk)
    python benchmarks/gather_kernel.py --summarize out.json c.json

``--smoke`` runs tiny shapes on the CPU (torch path; no c, no matmul) to check the script itself.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import glob
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvtier.kernels import KVLayoutKind, PageMover, vllm_cache_shape
from kvtier.kernels.layout import bits_dtype

MODELS = {
    "llama3-8b": dict(layers=32, heads=8, head_dim=128),
    "llama3-70b": dict(layers=80, heads=8, head_dim=128),
}
SMOKE_MODELS = {"tiny": dict(layers=2, heads=2, head_dim=8)}
TARGETS = {"a/d": 0.8, "a/b@16": 4.0, "a/c": 1.0, "matmul_slowdown": 0.10}


# ---------------------------------------------------------------------------------------------------------
# setup and timing


@dataclass
class Setup:
    model: str
    page_tokens: int
    kind: KVLayoutKind
    caches: list
    host: torch.Tensor
    block_ids: list
    pages: int
    page_bytes: int

    @property
    def nbytes(self) -> int:
        return self.pages * self.page_bytes


def make_setup(model: str, dims: dict, page_tokens: int, kind: KVLayoutKind, target_bytes: int,
               device: torch.device, dtype=torch.bfloat16, seed: int = 0) -> Setup:
    L, H, D = dims["layers"], dims["heads"], dims["head_dim"]
    esize = torch.empty(0, dtype=dtype).element_size()
    page_bytes = 2 * L * page_tokens * H * D * esize
    pages = max(2, target_bytes // page_bytes)
    num_blocks = 2 * pages + 8
    g = torch.Generator().manual_seed(seed)
    caches = []
    for _ in range(L):
        if kind is KVLayoutKind.SPLIT_LAST_DIM:  # vLLM >= 0.32 GPU layout, LBNHC physical order
            t = torch.empty(num_blocks, page_tokens, H, 2 * D, dtype=dtype, device=device).permute(0, 2, 1, 3)
        else:
            t = torch.empty(vllm_cache_shape(kind, num_blocks, page_tokens, H, D), dtype=dtype, device=device)
        info = torch.iinfo(bits_dtype(dtype))
        t.view(bits_dtype(dtype)).random_(max(info.min, -30000), min(info.max, 30000))
        caches.append(t)
    pin = device.type == "cuda"
    host = torch.zeros((pages, 2 * L, page_tokens, H * D), dtype=dtype, pin_memory=pin)
    block_ids = torch.randperm(num_blocks, generator=g)[:pages].tolist()
    return Setup(model, page_tokens, kind, caches, host, block_ids, pages, page_bytes)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_op(fn: Callable[[], None], device: torch.device, reps: int, warmup: int = 2) -> list[float]:
    """Seconds per call (CUDA events on the current stream; wall clock on CPU)."""
    for _ in range(warmup):
        fn()
    sync(device)
    out = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            out.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
    return out


def gbps(nbytes: int, seconds: list[float]) -> float:
    return nbytes / statistics.median(seconds) / 1e9


# ---------------------------------------------------------------------------------------------------------
# methods


def method_a(s: Setup, to_host: bool, **mover_kw) -> Callable[[], None]:
    mover = PageMover(s.caches, s.kind, s.page_tokens, **mover_kw)
    if to_host:
        return lambda: mover.gather_blocks(s.block_ids, s.host)
    return lambda: mover.scatter_blocks(s.block_ids, s.host)


def method_a_kernel(s: Setup, to_host: bool, **mover_kw) -> Callable[[], None]:
    mover = PageMover(s.caches, s.kind, s.page_tokens, **mover_kw)
    plan = mover.plan_blocks(s.block_ids, s.host)
    return lambda: mover.run(plan, to_host, check=False)


def per_page_copies(s: Setup) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(gpu block of one layer, host slot) pairs: one contiguous copy per page per layer (BLOCK_FIRST)."""
    assert s.kind is KVLayoutKind.BLOCK_FIRST, "per-page copies are set up for the block_first layout"
    L = len(s.caches)
    host = s.host.view(s.pages, L, -1)
    return [(s.caches[layer][b].view(-1), host[p, layer]) for p, b in enumerate(s.block_ids) for layer in range(L)]


def method_b(s: Setup, to_host: bool) -> Callable[[], None]:
    pairs = per_page_copies(s)
    if to_host:
        def run() -> None:
            for dev, hst in pairs:
                hst.copy_(dev, non_blocking=True)
    else:
        def run() -> None:
            for dev, hst in pairs:
                dev.copy_(hst, non_blocking=True)
    return run


def method_d(s: Setup, to_host: bool) -> Callable[[], None]:
    dev = torch.empty(s.host.numel(), dtype=s.host.dtype, device=s.caches[0].device)
    flat = s.host.view(-1)
    if to_host:
        return lambda: flat.copy_(dev, non_blocking=True)
    return lambda: dev.copy_(flat, non_blocking=True)


class BatchCopier:
    """cudaMemcpyBatchAsync through cuda-python, else libcudart via ctypes (CUDA >= 12.8)."""

    def __init__(self) -> None:
        self.how = ""
        self.reason = ""
        try:
            try:
                from cuda.bindings import runtime as rt  # cuda-python >= 12.8
            except ImportError:
                from cuda import cudart as rt  # type: ignore[no-redef]
            if not hasattr(rt, "cudaMemcpyBatchAsync"):
                raise ImportError("cuda-python has no cudaMemcpyBatchAsync")
            self.rt = rt
            self.how = "cuda-python"
            return
        except Exception as exc:  # noqa: BLE001
            self.reason = f"cuda-python: {exc}"
        try:
            self._init_ctypes()
            self.how = "ctypes"
        except Exception as exc:  # noqa: BLE001
            self.reason += f"; ctypes: {exc}"

    def _init_ctypes(self) -> None:
        cands = []
        for d in sys.path:
            cands += glob.glob(os.path.join(d, "nvidia", "cu*", "lib", "libcudart.so*"))
            cands += glob.glob(os.path.join(d, "nvidia", "cuda_runtime", "lib", "libcudart.so*"))
        cands += glob.glob(os.path.join(os.path.dirname(torch.__file__), "lib", "libcudart*.so*"))
        found = ctypes.util.find_library("cudart")
        if found:
            cands.append(found)
        last = None
        for c in cands:
            try:
                lib = ctypes.CDLL(c)
                fn = lib.cudaMemcpyBatchAsync
                break
            except (OSError, AttributeError) as exc:
                last = exc
        else:
            raise RuntimeError(f"no libcudart with cudaMemcpyBatchAsync ({last}; tried {cands[:4]})")
        ver = ctypes.c_int()
        lib.cudaRuntimeGetVersion(ctypes.byref(ver))
        self.version = ver.value
        if self.version < 12080:
            raise RuntimeError(f"CUDA runtime {self.version} < 12.8")
        self.lib, self.fn = lib, fn

    class _Loc(ctypes.Structure):
        _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]

    class _Attr(ctypes.Structure):
        _fields_ = [("srcAccessOrder", ctypes.c_int), ("srcLocHint", ctypes.c_int * 2),
                    ("dstLocHint", ctypes.c_int * 2), ("flags", ctypes.c_uint)]

    def prepare(self, dsts: list[int], srcs: list[int], sizes: list[int]) -> Callable[[], None]:
        run = self._prepare(dsts, srcs, sizes)
        side = torch.cuda.Stream()  # the batch call refuses the legacy default stream (cudaErrorInvalidValue)

        def ordered() -> None:
            cur = torch.cuda.current_stream()
            side.wait_stream(cur)
            with torch.cuda.stream(side):
                run()
            cur.wait_stream(side)
        return ordered

    def _prepare(self, dsts: list[int], srcs: list[int], sizes: list[int]) -> Callable[[], None]:
        n = len(dsts)
        if self.how == "cuda-python":
            rt = self.rt
            attr = rt.cudaMemcpyAttributes()
            attr.srcAccessOrder = rt.cudaMemcpySrcAccessOrder.cudaMemcpySrcAccessOrderStream

            def run() -> None:
                stream = torch.cuda.current_stream().cuda_stream
                res = rt.cudaMemcpyBatchAsync(dsts, srcs, sizes, n, [attr], [0], 1, stream)
                err = res[0] if isinstance(res, tuple) else res
                if int(err) != 0:
                    raise RuntimeError(f"cudaMemcpyBatchAsync failed: {res}")
            return run
        arr_p = ctypes.c_void_p * n
        d, s_, z = arr_p(*dsts), arr_p(*srcs), (ctypes.c_size_t * n)(*sizes)
        attr = self._Attr(1, (ctypes.c_int * 2)(0, 0), (ctypes.c_int * 2)(0, 0), 0)  # srcAccessOrderStream = 1
        idx = (ctypes.c_size_t * 1)(0)
        fail = ctypes.c_size_t(0)

        def run() -> None:
            stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
            if self.version >= 13000:
                err = self.fn(d, s_, z, ctypes.c_size_t(n), ctypes.byref(attr), idx, ctypes.c_size_t(1), stream)
            else:
                err = self.fn(d, s_, z, ctypes.c_size_t(n), ctypes.byref(attr), idx, ctypes.c_size_t(1),
                              ctypes.byref(fail), stream)
            if err != 0:
                raise RuntimeError(f"cudaMemcpyBatchAsync returned {err}")
        return run


def method_c(s: Setup, to_host: bool, copier: BatchCopier) -> Callable[[], None]:
    pairs = per_page_copies(s)
    dev = [p[0].data_ptr() for p in pairs]
    hst = [p[1].data_ptr() for p in pairs]
    sizes = [p[0].numel() * p[0].element_size() for p in pairs]
    return copier.prepare(hst, dev, sizes) if to_host else copier.prepare(dev, hst, sizes)


# ---------------------------------------------------------------------------------------------------------
# checks


def check_bit_exact(device: torch.device, impl: str) -> list[str]:
    """kvtier kernel vs torch path vs per-page copies, both directions, several dtypes/layouts."""
    problems = []
    dims = dict(layers=4, heads=8, head_dim=128) if device.type == "cuda" else dict(layers=2, heads=2, head_dim=8)
    for kind in (KVLayoutKind.BLOCK_FIRST, KVLayoutKind.SPLIT_LAST_DIM):
        for dtype in (torch.bfloat16, torch.float8_e4m3fn, torch.float32):
            for pt in (16, 32):
                s = make_setup("check", dims, pt, kind, 8 * 2 * dims["layers"] * pt * 1024, device, dtype, seed=pt)
                bits = bits_dtype(dtype)
                ref = torch.zeros_like(s.host)
                PageMover(s.caches, kind, pt, impl="torch").gather_blocks(s.block_ids, ref)
                m = PageMover(s.caches, kind, pt, impl=impl)
                m.gather_blocks(s.block_ids, s.host)
                sync(device)
                tag = f"{kind.value}/{dtype}/pt{pt}"
                if not torch.equal(s.host.view(bits), ref.view(bits)):
                    problems.append(f"gather mismatch {tag}")
                if kind is KVLayoutKind.BLOCK_FIRST:
                    alt = s.host.clone()
                    s.host.zero_()
                    method_b(s, True)()
                    sync(device)
                    if not torch.equal(s.host.view(bits), alt.view(bits)):
                        problems.append(f"per-page copies disagree with the kernel {tag}")
                    s.host.copy_(alt)
                fresh = [torch.zeros_like(c) for c in s.caches]
                PageMover(fresh, kind, pt, impl=impl).scatter_blocks(s.block_ids, s.host)
                sync(device)
                ids = torch.tensor(s.block_ids, device=device)
                for a, b in zip(fresh, s.caches):
                    if not torch.equal(a[ids].view(bits), b[ids].view(bits)):
                        problems.append(f"scatter round trip mismatch {tag}")
                        break
    return problems


def matmul_slowdown(device: torch.device, background: Callable[[], None], bg_seconds: float,
                    n: int = 8192, iters: int = 40) -> dict:
    """Slowdown of ``iters`` bf16 matmuls while ``background`` runs on another stream."""
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    c = torch.empty_like(a)

    def mm() -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            torch.matmul(a, b, out=c)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    mm()
    alone = statistics.median(mm() for _ in range(3))
    side = torch.cuda.Stream(device)
    reps = max(2, int(2.0 * alone / max(bg_seconds, 1e-6)) + 1)
    together = []
    for _ in range(3):
        torch.cuda.synchronize(device)
        with torch.cuda.stream(side):
            for _ in range(reps):
                background()
        together.append(mm())
        torch.cuda.synchronize(device)
    t = statistics.median(together)
    return {"matmul_alone_ms": alone * 1e3, "matmul_with_copies_ms": t * 1e3, "slowdown": t / alone - 1.0,
            "background_calls": reps, "tflops_alone": 2 * n ** 3 * iters / alone / 1e12}


# ---------------------------------------------------------------------------------------------------------
# main


def run(args: argparse.Namespace) -> dict:
    device = torch.device("cuda" if not args.smoke else "cpu")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device (use --smoke for a CPU run of the script)")
    interpret = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    impl = "triton" if (device.type == "cuda" or interpret) else "torch"
    methods = set(args.methods.split(","))
    models = SMOKE_MODELS if args.smoke else {k: MODELS[k] for k in args.models.split(",")}
    target = args.mib * 2**20 if not args.smoke else 256 * 1024
    reps = args.reps
    res: dict = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                 "torch": torch.__version__, "rows": [], "sweep": [], "matmul": {}, "notes": []}
    try:
        import triton

        res["triton"] = triton.__version__
    except ImportError:
        res["triton"] = None
    def say(*a):
        return (print(*a, flush=True))

    if "check" in methods:
        t0 = time.time()
        problems = check_bit_exact(device, impl)
        res["bit_exact"] = not problems
        res["bit_exact_problems"] = problems
        say(f"[check] bit-exact kernel vs torch path vs per-page copies: {problems if problems else 'OK'} "
            f"({time.time() - t0:.1f}s)")

    copier = BatchCopier() if ("c" in methods and device.type == "cuda") else None
    if copier is not None and not copier.how:
        res["notes"].append(f"(c) skipped: {copier.reason}")
        say(f"[c] skipped: {copier.reason}")
        copier = None
    elif copier is not None:
        say(f"[c] cudaMemcpyBatchAsync via {copier.how}")

    # sweep the kernel's launch configuration on one case, keep the best
    tuned: dict = {}
    first_model = next(iter(models))
    if "a" in methods and "sweep" in methods and device.type == "cuda":
        s = make_setup(first_model, models[first_model], 16, KVLayoutKind.BLOCK_FIRST, target, device)
        best = None
        for progs in (8, 16, 32, 64):
            for warps in (4, 8):
                for tile in (4096, 16384):
                    kw = dict(impl=impl, max_programs=progs, num_warps=warps, tile_elems=tile)
                    row = {"programs": progs, "warps": warps, "tile": tile}
                    for to_host in (True, False):
                        op = method_a_kernel(s, to_host, **kw)
                        row["d2h" if to_host else "h2d"] = gbps(s.nbytes, time_op(op, device, 3, 1))
                    res["sweep"].append(row)
                    score = min(row["d2h"], row["h2d"])
                    if best is None or score > best[0]:
                        best = (score, kw)
                    say(f"[sweep] programs {progs:3d} warps {warps} tile {tile:5d}: "
                        f"GPU->host {row['d2h']:6.1f} GB/s  host->GPU {row['h2d']:6.1f} GB/s")
        tuned = best[1] if best else {}
        res["tuned"] = {k: v for k, v in tuned.items() if k != "impl"}
        say(f"[sweep] best: {res['tuned']}")
        del s
        torch.cuda.empty_cache()

    for model, dims in models.items():
        for pt in (16, 32):
            for kind in (KVLayoutKind.BLOCK_FIRST, KVLayoutKind.SPLIT_LAST_DIM):
                if kind is KVLayoutKind.SPLIT_LAST_DIM and not ({"a"} & methods):
                    continue
                s = make_setup(model, dims, pt, kind, target, device)
                for to_host in (True, False):
                    row = {"model": model, "page_tokens": pt, "layout": kind.value,
                           "dir": "GPU->host" if to_host else "host->GPU", "bytes": s.nbytes, "pages": s.pages}
                    if "a" in methods:
                        row["a"] = gbps(s.nbytes, time_op(method_a(s, to_host, impl=impl), device, reps))
                        row["a_kern"] = gbps(s.nbytes, time_op(method_a_kernel(s, to_host, impl=impl), device, reps))
                        if tuned:
                            row["a_tuned"] = gbps(s.nbytes, time_op(method_a(s, to_host, **tuned), device, reps))
                    if kind is KVLayoutKind.BLOCK_FIRST:
                        if "b" in methods:
                            row["b"] = gbps(s.nbytes, time_op(method_b(s, to_host), device, max(3, reps // 2), 1))
                        if copier is not None:
                            try:
                                row["c"] = gbps(s.nbytes, time_op(method_c(s, to_host, copier), device, reps))
                            except Exception as exc:  # noqa: BLE001
                                res["notes"].append(f"(c) failed: {exc}")
                                say(f"[c] failed: {exc}")
                                copier = None
                        if "d" in methods:
                            row["d"] = gbps(s.nbytes, time_op(method_d(s, to_host), device, reps))
                    res["rows"].append(row)
                    say("[row] " + "  ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}"
                                             for k, v in row.items()))
                if ("matmul" in methods and device.type == "cuda" and model == first_model and pt == 16
                        and kind is KVLayoutKind.BLOCK_FIRST):
                    setup = s
                    makers = (("a", lambda th: method_a_kernel(setup, th, impl=impl)),
                              ("d", lambda th: method_d(setup, th)))
                    for name, mk in makers:
                        fg, fs = mk(True), mk(False)
                        bg = lambda: (fg(), fs())  # noqa: E731
                        secs = statistics.median(time_op(bg, device, 3, 1))
                        m = matmul_slowdown(device, bg, secs)
                        res["matmul"][name] = m
                        say(f"[matmul] while ({name}) runs: {m['matmul_alone_ms']:.1f} ms -> "
                            f"{m['matmul_with_copies_ms']:.1f} ms, slowdown {100 * m['slowdown']:.1f}%")
                del s
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    return res


def summarize(results: list[dict]) -> str:
    """Merge result files (e.g. the main run and the isolated (c) run) and print medians, ratios, targets."""
    rows: dict = {}
    merged: dict = {"notes": [], "matmul": {}}
    for r in results:
        for k in ("device", "torch", "triton", "tuned", "bit_exact", "bit_exact_problems"):
            if k in r and k not in merged:
                merged[k] = r[k]
        merged["notes"] += r.get("notes", [])
        merged["matmul"].update(r.get("matmul", {}))
        for row in r.get("rows", []):
            key = (row["model"], row["page_tokens"], row["layout"], row["dir"])
            rows.setdefault(key, {}).update(row)
    lines = [f"device: {merged.get('device')}  torch {merged.get('torch')}  triton {merged.get('triton')}"]
    if "bit_exact" in merged:
        lines.append(f"bit-exact on device: {'yes' if merged['bit_exact'] else merged['bit_exact_problems']}")
    if merged.get("tuned"):
        lines.append(f"tuned launch config (a_tuned): {merged['tuned']}")
    hdr = f"{'model':11s} {'page':>4s} {'layout':15s} {'direction':10s} " + " ".join(
        f"{c:>7s}" for c in ("a", "a_kern", "a_tuned", "b", "c", "d", "a/d", "a/b", "a/c"))
    lines += ["GB/s (median)", hdr]
    verdicts = []
    for key, row in rows.items():
        def f(k):
            return f"{row[k]:7.1f}" if k in row else f"{'-':>7s}"

        best_a = max(row.get("a", 0.0), row.get("a_tuned", 0.0)) or None
        ratios = {}
        for name, base in (("a/d", "d"), ("a/b", "b"), ("a/c", "c")):
            if best_a and row.get(base):
                ratios[name] = best_a / row[base]
        rtxt = " ".join(f"{ratios[n]:7.2f}" if n in ratios else f"{'-':>7s}" for n in ("a/d", "a/b", "a/c"))
        lines.append(f"{key[0]:11s} {key[1]:4d} {key[2]:15s} {key[3]:10s} "
                     + " ".join(f(k) for k in ("a", "a_kern", "a_tuned", "b", "c", "d")) + " " + rtxt)
        if "a/d" in ratios:
            verdicts.append(("a >= 0.8 d", key, ratios["a/d"] >= TARGETS["a/d"]))
        if "a/b" in ratios and key[1] == 16:
            verdicts.append(("a >= 4 b (16-token pages)", key, ratios["a/b"] >= TARGETS["a/b@16"]))
        if "a/c" in ratios:
            verdicts.append(("a >= c", key, ratios["a/c"] >= TARGETS["a/c"]))
    for name, m in merged["matmul"].items():
        lines.append(f"bf16 matmul ({m['tflops_alone']:.0f} TFLOP/s alone) slowdown while ({name}) runs: "
                     f"{100 * m['slowdown']:.1f}%")
        if name == "a":
            verdicts.append(("matmul slowdown < 10%", ("a",), m["slowdown"] < TARGETS["matmul_slowdown"]))
    lines.append("targets (a = best of a / a_tuned):")
    for target in sorted({v[0] for v in verdicts}):
        vs = [v for v in verdicts if v[0] == target]
        ok = sum(v[2] for v in vs)
        lines.append(f"  {target}: {ok}/{len(vs)} {'PASS' if ok == len(vs) else 'MISS'}")
    lines += [f"note: {n}" for n in merged["notes"]]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--methods", default="check,sweep,a,b,c,d,matmul",
                   help="comma list of: check, sweep, a, b, c, d, matmul")
    p.add_argument("--models", default="llama3-8b,llama3-70b")
    p.add_argument("--mib", type=int, default=512, help="bytes per transfer (MiB)")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--json", help="write results here")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (tests the script)")
    p.add_argument("--summarize", nargs="+", metavar="JSON", help="merge result files and print the summary")
    args = p.parse_args()
    if args.summarize:
        results = []
        for path in args.summarize:
            try:
                with open(path) as fh:
                    results.append(json.load(fh))
            except (OSError, ValueError) as exc:
                print(f"(skipping {path}: {exc})")
        print(summarize(results))
        return
    res = run(args)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as fh:
            json.dump(res, fh, indent=1, default=str)
    print(summarize([res]))


if __name__ == "__main__":
    main()
