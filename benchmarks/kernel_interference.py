"""How much a page-kernel transfer slows the model beside it, for each launch configuration of the kernel.

The page kernel's programs loop over the work, so its grid (`max_programs`) bounds the SMs it takes from a
concurrent forward. For each configuration (programs, warps per program, elements per step): GB/s both ways on
Llama-3-8B pages of 16 tokens (256 MiB per transfer by default) and the slowdown of a bf16 8192^3 matmul stream while
the kernel moves pages back and forth on a side stream; one big pinned copy (the copy engines, no SM) for reference.
Run on a CUDA machine (`gpu_check.sh` has it); `--smoke` checks the script on the CPU (no timings).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch
from gather_kernel import MODELS, gbps, make_setup, matmul_slowdown, method_a_kernel, method_d, time_op

from kvtier.kernels import KVLayoutKind

#: (programs, warps, tile elements); None: the kernel's default (4, 8, 16384 since 2026-12-04; 32, 8, 4096 before)
CONFIGS = [(32, 8, 4096), (32, 8, 16384), (16, 8, 16384), (8, 8, 16384), (8, 4, 16384), (4, 8, 16384),
           (None, None, None)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--json", default=None)
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    if args.smoke:
        return 0 if CONFIGS else 1
    if not torch.cuda.is_available():
        print("kernel_interference: no CUDA device")
        return 2
    dev = torch.device("cuda")
    s = make_setup("llama3-8b", MODELS["llama3-8b"], 16, KVLayoutKind.BLOCK_FIRST, args.mib << 20, dev)
    out = []
    d_g, d_s = method_d(s, True), method_d(s, False)
    ref = lambda: (d_g(), d_s())  # noqa: E731
    m = matmul_slowdown(dev, ref, statistics.median(time_op(ref, dev, 3, 1)))
    print(f"[interference] one big copy: matmul slowdown {100 * m['slowdown']:5.1f}%")
    for progs, warps, tile in CONFIGS:
        kw = dict(impl="triton", max_programs=progs, num_warps=warps, tile_elems=tile)
        g, sc = method_a_kernel(s, True, **kw), method_a_kernel(s, False, **kw)
        d2h, h2d = gbps(s.nbytes, time_op(g, dev, 5, 1)), gbps(s.nbytes, time_op(sc, dev, 5, 1))
        both = lambda: (g(), sc())  # noqa: E731
        m = matmul_slowdown(dev, both, statistics.median(time_op(both, dev, 3, 1)))
        row = {"programs": progs, "warps": warps, "tile": tile, "d2h_gbps": d2h, "h2d_gbps": h2d,
               "matmul_slowdown": m["slowdown"]}
        out.append(row)
        name = f"programs {progs:3d} warps {warps} tile {tile:5d}" if progs else "the kernel's default        "
        print(f"[interference] {name}: GPU->host {d2h:5.1f} GB/s, "
              f"host->GPU {h2d:5.1f} GB/s, matmul slowdown {100 * m['slowdown']:5.1f}%")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
