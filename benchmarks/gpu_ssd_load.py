"""The SSD stream's device path end to end without vLLM: SSD -> kvikio -> GPU staging (verified on the GPU) -> the
page-first scatter kernel -> paged KV, against the host path: SSD -> pinned host (verified on the CPU) -> the same
kernel reading pinned host memory.

Builds Llama-3-8B-shaped paged KV (vLLM's `[B, 2, N, H, D]` per layer, bf16, 16-token blocks), gathers `--chunks`
chunks of 256 tokens into page-first buffers (what the connector saves), writes them with the SSD tier, wipes the
blocks, then loads them back by each path in windows of `--window` chunks (the stream's staging size; page cache
dropped before each pass) and checks every block bit-exact against the original. Prints GB/s (medians of
`--repeats`) and device/host. `--dry-run`: CPU, tiny shapes, POSIX reads into CPU tensors through the tier's device
read path (`kvtier.testing.host_device_reader`), the torch kernel path.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--chunks", type=int, default=16)
    ap.add_argument("--window", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default=None)
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args()

    import torch

    from kvtier.kernels import KVLayoutKind, PageMover, vllm_cache_shape
    from kvtier.kernels.dispatch import HostChunk
    from kvtier.storage_backends.config import parse_kvtier_config
    from kvtier.storage_backends.ssd.tier import ChunkMeta, SSDTier
    from kvtier.testing.host_memory import drop_page_cache

    dev = torch.device("cpu" if args.dry_run else "cuda")
    if dev.type == "cuda" and not torch.cuda.is_available():
        print("gpu_ssd_load: no CUDA device")
        return 2
    layers, heads, head_dim, page, tokens = (2, 2, 8, 16, 64) if args.dry_run else (32, 8, 128, 16, 256)
    per_chunk = tokens // page
    n_blocks = args.chunks * per_chunk + 8
    kind = KVLayoutKind.BLOCK_FIRST
    g = torch.Generator().manual_seed(0)
    caches = [torch.randint(-30000, 30000, vllm_cache_shape(kind, n_blocks, page, heads, head_dim), generator=g,
                            dtype=torch.int16).view(torch.bfloat16).to(dev) for _ in range(layers)]
    want = [c.clone() for c in caches]
    mover = PageMover(caches, kind, page, impl="torch" if args.dry_run else "triton")
    order = torch.randperm(n_blocks, generator=g)[:args.chunks * per_chunk]
    slots = [(order[c * per_chunk:(c + 1) * per_chunk, None] * page + torch.arange(page)).reshape(-1).to(dev)
             for c in range(args.chunks)]
    elems = 2 * layers * tokens * heads * head_dim
    nbytes = elems * 2

    tmp = tempfile.mkdtemp(prefix="kvtier-ssd-load-", dir=args.dir)
    cfg = parse_kvtier_config({"kvtier.ssd_path": tmp, "kvtier.ssd_capacity_gb": args.chunks * (nbytes + 8192) / 2**30
                               + 0.1, "kvtier.io_engine": "posix" if args.dry_run else "kvikio",
                               "kvtier.o_direct": not args.dry_run, "kvtier.io_threads": 8})
    tier = SSDTier(cfg, nbytes)
    if args.dry_run:
        from kvtier.testing.host_device_reader import HostDeviceReader

        tier.io.set_device_reader(HostDeviceReader())
    keys = [f"load@1@0@{c:x}@bf16" for c in range(args.chunks)]
    buf = torch.empty(elems, dtype=torch.bfloat16, device=dev)
    for c, k in enumerate(keys):  # save: the kernel gathers the chunk's pages, the tier writes them
        mover.gather_chunks([HostChunk(host=buf, slots=slots[c])])
        cpu = buf.cpu()
        tier.submit_put(k, ChunkMeta(nbytes, (elems,), "torch.bfloat16", "KV_2LTD"),
                        memoryview(cpu.view(torch.uint8).numpy()).cast("B"), lambda ok: None)
        tier.flush()
    staging = [torch.empty(elems, dtype=torch.bfloat16, device=dev) for _ in range(args.window)]
    pinned = [torch.empty(elems, dtype=torch.bfloat16, pin_memory=dev.type == "cuda") for _ in range(args.window)]

    def device_path(win: list[int]) -> bool:
        ok = tier.read_batch_into_device([keys[c] for c in win], lambda k, m: staging[[keys[c] for c in win]
                                                                                     .index(k)])
        mover.scatter_chunks([HostChunk(host=staging[i], slots=slots[c]) for i, c in enumerate(win)])
        return all(ok)

    def host_path(win: list[int]) -> bool:
        names = [keys[c] for c in win]
        got = tier.read_batch(names, lambda k, m: (memoryview(pinned[names.index(k)].view(torch.uint8).numpy())
                                                   .cast("B"), k), lambda h: None)
        mover.scatter_chunks([HostChunk(host=pinned[i], slots=slots[c]) for i, c in enumerate(win)])
        return all(g is not None for g in got)

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize()

    res: dict[str, list[float]] = {"device path (kvikio -> GPU staging)": [], "host path (pinned host)": []}
    exact = True
    fns = dict(zip(res, (device_path, host_path)))
    for r in range(args.repeats + 1):  # the first pass warms up (compiles the kernels), untimed
        for name, fn in fns.items():
            for c in caches:
                c.zero_()
            drop_page_cache()
            sync()
            t0 = time.perf_counter()
            ok = all(fn(list(range(s, min(s + args.window, args.chunks))))
                     for s in range(0, args.chunks, args.window))
            sync()
            dt = time.perf_counter() - t0
            same = ok and all(torch.equal(c[order].view(torch.int16), w[order].view(torch.int16))  # bits: NaNs
                              for c, w in zip(caches, want))
            exact = exact and same
            if r:
                res[name].append(args.chunks * nbytes / dt / 1e9)
    tier.close()
    shutil.rmtree(tmp, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in res.items()}
    for k, v in res.items():
        print(f"[load] {k:<38} {med[k]:6.2f} GB/s  ({', '.join(f'{x:.2f}' for x in v)})")
    paired = sorted(a / b for a, b in zip(*res.values()))
    print(f"[load] device/host per pass (paired): min {paired[0]:.2f} / median {statistics.median(paired):.2f} / "
          f"max {paired[-1]:.2f}; every block bit-exact after every pass: {exact}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"median_gbps": med, "all": res, "bit_exact": exact, "chunk_bytes": nbytes}, f)
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
