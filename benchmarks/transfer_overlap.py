"""Benchmark: does a KV load off the forward path overlap with the forward pass? (#14, GPU overlap check)

A forward-like step (per layer, bf16 matmuls of a decode/prefill batch against the layer's weights) is timed on
the default stream, in three modes, with medians over several steps:

  alone      the step loop by itself;
  copy       while a page-first load (host pinned pages -> vLLM's paged KV cache, one ``copy_`` per page and
             layer: what LMCache's page-first connector issues) runs on a copy stream;
  triton     while kvtier's Triton scatter kernel (``PageMover(impl="triton").scatter_blocks``) does the same
             load on a copy stream (it uses SMs, so it competes with the matmuls).

Printed: step ms per mode, the step slowdown against ``alone`` (the cost the forward pays for an asynchronous
load), the load's own GB/s alone and while overlapped, and ``overlap`` = (step alone + load alone) / (both
together): 2.0 is perfect overlap, 1.0 none. After the overlapped runs every loaded page is compared bit-exactly
with the host pages it came from (a load that overlaps must still be exact).

Imports only torch, triton (GPU) and ``kvtier.kernels``; run from ``benchmarks/gpu_check.sh``::

    python benchmarks/transfer_overlap.py --json overlap.json
    python benchmarks/transfer_overlap.py --dry-run     # CPU: tiny shapes, torch path, no streams; checks the
                                                        # script, the modes and the bit-exact check
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable

import torch
from gather_kernel import MODELS, SMOKE_MODELS, make_setup, method_b, sync  # same directory (run as a script)

from kvtier.kernels import KVLayoutKind, PageMover
from kvtier.kernels.layout import bits_dtype


def step_fn(device: torch.device, layers: int, hidden: int, tokens: int) -> Callable[[], None]:
    """One forward-like step: per layer a QKV-like and an MLP-like matmul of `tokens` rows."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    x = torch.randn(tokens, hidden, device=device, dtype=dtype)
    w1 = [torch.randn(hidden, 3 * hidden, device=device, dtype=dtype) / hidden ** 0.5 for _ in range(layers)]
    w2 = [torch.randn(3 * hidden, hidden, device=device, dtype=dtype) / hidden ** 0.5 for _ in range(layers)]

    def run() -> None:
        h = x
        for a, b in zip(w1, w2):
            h = torch.matmul(torch.matmul(h, a), b)

    return run


def timed(fn: Callable[[], None], device: torch.device, n: int) -> list[float]:
    """Seconds of each of `n` calls on the current stream (CUDA events; wall clock on CPU)."""
    out = []
    for _ in range(n):
        if device.type == "cuda":
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            e.synchronize()
            out.append(s.elapsed_time(e) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
    return out


def check_exact(setup) -> bool:
    """Every loaded page equals the host page it came from (read back through the torch path)."""
    back = torch.empty_like(setup.host)
    PageMover(setup.caches, setup.kind, setup.page_tokens, impl="torch").gather_blocks(setup.block_ids, back)
    sync(setup.caches[0].device)
    bits = bits_dtype(back.dtype)
    return bool(torch.equal(back.view(bits), setup.host.view(bits)))


def measure(args: argparse.Namespace) -> dict:
    dry = args.dry_run
    device = torch.device("cpu" if dry else "cuda")
    if not dry and not torch.cuda.is_available():
        raise SystemExit("no CUDA device (use --dry-run for a CPU run of the script)")
    dims = SMOKE_MODELS["tiny"] if dry else MODELS[args.model]
    hidden = 64 if dry else args.hidden
    step = step_fn(device, 2 if dry else dims["layers"], hidden, 8 if dry else args.tokens)
    setup = make_setup("tiny" if dry else args.model, dims, args.page_tokens, KVLayoutKind.BLOCK_FIRST,
                       (256 * 1024) if dry else args.mib * 2 ** 20, device,
                       dtype=torch.float32 if dry else torch.bfloat16)
    setup.host.copy_(torch.randn(setup.host.shape).to(setup.host.dtype))  # pages differ from the cache's bytes
    loads = {"copy": method_b(setup, to_host=False)}
    if not dry:
        tri = PageMover(setup.caches, setup.kind, setup.page_tokens, impl="triton")
        loads["triton"] = lambda: tri.scatter_blocks(setup.block_ids, setup.host)
    n = 3 if dry else args.steps
    for _ in range(2):  # warm-up (Triton compile, cuBLAS heuristics)
        step()
        for f in loads.values():
            f()
    sync(device)
    res: dict = {"device": "cpu (dry run)" if dry else torch.cuda.get_device_name(device), "model": setup.model,
                 "load_bytes": setup.nbytes, "pages": setup.pages, "page_tokens": setup.page_tokens,
                 "tokens_per_step": 8 if dry else args.tokens, "hidden": hidden}
    alone = statistics.median(timed(step, device, n))
    res["step_alone_ms"] = alone * 1e3
    side = torch.cuda.Stream(device) if device.type == "cuda" else None
    for name, load in loads.items():
        load_alone = statistics.median(timed(load, device, n))
        reps = max(1, int(round(n * alone / max(load_alone, 1e-9))))  # loads spanning the n steps
        if side is not None:
            torch.cuda.synchronize(device)
            ls, le = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(side):
                ls.record(side)
                for _ in range(reps):
                    load()
                le.record(side)
            steps = timed(step, device, n)
            torch.cuda.synchronize(device)
            load_total = ls.elapsed_time(le) / 1e3
        else:  # dry run: the same sequence without streams (checks the bookkeeping, not overlap)
            t0 = time.perf_counter()
            for _ in range(reps):
                load()
            load_total = time.perf_counter() - t0
            steps = timed(step, device, n)
        together = statistics.median(steps)
        serial = sum(steps) + reps * load_alone
        wall = max(sum(steps), load_total)
        res[name] = {"step_ms": together * 1e3, "step_slowdown": together / alone - 1.0,
                     "load_gbps_alone": setup.nbytes / load_alone / 1e9,
                     "load_gbps_overlapped": reps * setup.nbytes / load_total / 1e9, "loads": reps,
                     "overlap": serial / wall if wall > 0 else 0.0, "bit_exact": check_exact(setup)}
    return res


def report(res: dict) -> str:
    lines = [f"[overlap] {res['device']}: {res['model']} KV, {res['pages']} pages of {res['page_tokens']} tokens "
             f"({res['load_bytes'] / 2**20:.0f} MiB per load); step = {res['tokens_per_step']} tokens x "
             f"hidden {res['hidden']}: {res['step_alone_ms']:.2f} ms alone"]
    for name in ("copy", "triton"):
        r = res.get(name)
        if r is None:
            continue
        lines.append(f"[overlap] with a concurrent {name} load: step {r['step_ms']:.2f} ms "
                     f"({100 * r['step_slowdown']:+.1f}%), load {r['load_gbps_alone']:.1f} GB/s alone, "
                     f"{r['load_gbps_overlapped']:.1f} GB/s overlapped, overlap {r['overlap']:.2f} "
                     f"(2 = full), bit-exact {r['bit_exact']}")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, no streams: checks the script")
    p.add_argument("--model", default="llama3-8b", choices=sorted(MODELS))
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--tokens", type=int, default=256, help="tokens per forward-like step")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--page-tokens", type=int, default=16)
    p.add_argument("--mib", type=int, default=256, help="bytes of one load")
    p.add_argument("--json")
    args = p.parse_args()
    res = measure(args)
    print(report(res))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    bad = [k for k in ("copy", "triton") if k in res and not res[k]["bit_exact"]]
    if bad:
        print(f"[overlap] FAIL: pages loaded while overlapping differ from the host pages ({', '.join(bad)})")
        sys.exit(1)


if __name__ == "__main__":
    main()
