"""SSD -> GPU reads of SSD-tier chunks through kvikio, against SSD -> pinned host (-> GPU) reads of the same chunks.

Runs on a CUDA machine only (kvikio needs libcuda). Writes `--chunks` chunks of `--chunk-mib` MiB with the SSD
tier, drops the page cache (root), then reads them (a) straight into GPU tensors (`SSDTier.read_into_device`,
checksum-verified on the GPU by `kvtier.kernels.crc32`), (r) the same slots' bytes with raw kvikio `pread`s into the
same GPU tensors (no header, no check), (b) into pinned host memory (`read_batch`), and (c) (b) plus the host->GPU
copy. Prints medians of GB/s and the ratios a/r (target >= 0.95: what the check costs), a/b and a/c; `--json` writes
them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--chunks", type=int, default=16)
    ap.add_argument("--chunk-mib", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    import torch

    from kvtier.storage_backends.config import parse_kvtier_config
    from kvtier.storage_backends.ssd.kvikio_io import kvikio_status
    from kvtier.storage_backends.ssd.tier import ChunkMeta, SSDTier

    ok, why = kvikio_status()
    if not ok or not torch.cuda.is_available():
        print(f"kvikio SSD->GPU check skipped: {why if not ok else 'no CUDA device'}")
        return 2
    tmp = tempfile.mkdtemp(prefix="kvtier-kvikio-", dir=args.dir)
    nbytes = args.chunk_mib << 20
    capacity_gb = args.chunks * (nbytes + 8192) / (1 << 30) + 0.1
    cfg = parse_kvtier_config({"kvtier.ssd_path": tmp, "kvtier.ssd_capacity_gb": capacity_gb,
                               "kvtier.io_engine": "kvikio", "kvtier.io_threads": 8})
    tier = SSDTier(cfg, nbytes)
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8).pin_memory()
    keys = [f"bench@1@0@{i:x}@bf16" for i in range(args.chunks)]
    for i, k in enumerate(keys):
        src[:8] = i  # distinct chunks
        tier.submit_put(k, ChunkMeta(nbytes, (nbytes,), "torch.uint8", "KV_2LTD"), memoryview(src.numpy()).cast("B"),
                        lambda ok: None)
        tier.flush()
    want = src.cuda()
    gpu = [torch.empty(nbytes, dtype=torch.uint8, device="cuda") for _ in range(4)]
    host = [torch.empty(nbytes, dtype=torch.uint8).pin_memory() for _ in range(4)]
    res: dict[str, list[float]] = {"kvikio SSD->GPU (verified)": [], "raw kvikio SSD->GPU": [],
                                   "SSD->pinned host": [], "SSD->pinned host->GPU": []}
    import kvikio

    from kvtier.storage_backends.ssd.slot_format import HEADER_SIZE

    places = [tier.io.files.locate_path(tier.entry(k).slot) for k in keys]
    raw_files = {path: kvikio.CuFile(path, "r") for path, _ in places}

    def drop():
        os.sync()
        with contextlib.suppress(OSError):
            open("/proc/sys/vm/drop_caches", "w").write("3\n")

    # warm-up, untimed: the checksum kernel's first launch compiles it; kvikio opens its thread pool
    assert tier.read_into_device(keys[0], gpu[0])
    raw_files[places[0][0]].pread(gpu[1], nbytes, places[0][1] + HEADER_SIZE).get()
    from kvtier.kernels.crc32 import segment_crcs

    check_s = []
    for _ in range(5):  # the check alone, on a chunk already in GPU memory (kernel + host combine)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        segment_crcs(gpu[0], tier.seg)
        check_s.append(time.perf_counter() - t0)
    check_ms = statistics.median(check_s) * 1e3
    print(f"GPU check of one {args.chunk_mib} MiB chunk ({tier.seg >> 20} MiB segments): {check_ms:.2f} ms "
          f"({nbytes / check_ms / 1e6:.1f} GB/s)")
    for _ in range(args.repeats):
        drop()
        t0 = time.perf_counter()
        for i, k in enumerate(keys):
            assert tier.read_into_device(k, gpu[i % 4])
        torch.cuda.synchronize()
        res["kvikio SSD->GPU (verified)"].append(args.chunks * nbytes / (time.perf_counter() - t0) / 1e9)
        want[:8] = len(keys) - 1
        assert torch.equal(gpu[(len(keys) - 1) % 4], want), "wrong bytes after a kvikio read"
        drop()
        t0 = time.perf_counter()
        for i, (path, base) in enumerate(places):
            got = raw_files[path].pread(gpu[i % 4], nbytes, base + HEADER_SIZE).get()
            assert got == nbytes
        torch.cuda.synchronize()
        res["raw kvikio SSD->GPU"].append(args.chunks * nbytes / (time.perf_counter() - t0) / 1e9)
        for with_copy in (False, True):
            drop()
            t0 = time.perf_counter()
            for s in range(0, len(keys), 4):
                batch = keys[s:s + 4]
                got = tier.read_batch(batch, lambda k, m: (memoryview(host[batch.index(k)].numpy()).cast("B"), k),
                                      lambda h: None)
                assert all(g is not None for g in got)
                if with_copy:
                    for j in range(len(batch)):
                        gpu[j].copy_(host[j], non_blocking=True)
            torch.cuda.synchronize()
            name = "SSD->pinned host->GPU" if with_copy else "SSD->pinned host"
            res[name].append(args.chunks * nbytes / (time.perf_counter() - t0) / 1e9)
    for f in raw_files.values():
        f.close()
    path, base = places[-1]  # a flipped byte on the disk: the GPU check must call the chunk a miss
    with open(path, "r+b") as f:
        f.seek(base + HEADER_SIZE + nbytes // 2 + 1)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0x10]))
    flipped_miss = not tier.read_into_device(keys[-1], gpu[0])
    print(f"a byte flipped on the disk: {'a miss (correct)' if flipped_miss else 'SERVED (WRONG)'}")
    tier.close()
    shutil.rmtree(tmp, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in res.items()}
    for k, v in med.items():
        print(f"{k:<30} {v:6.2f} GB/s   ({', '.join(f'{x:.2f}' for x in res[k])})")
    a = med["kvikio SSD->GPU (verified)"]
    paired = sorted(v / r for v, r in zip(res["kvikio SSD->GPU (verified)"], res["raw kvikio SSD->GPU"]))
    print(f"verified/raw kvikio per repeat (paired): min {paired[0]:.2f} / median {statistics.median(paired):.2f} / "
          f"max {paired[-1]:.2f}")
    print(f"ratio verified/raw kvikio = {a / med['raw kvikio SSD->GPU']:.2f} (target >= 0.95); "
          f"ratio kvikio/host read = {a / med['SSD->pinned host']:.2f}; "
          f"kvikio/(host read + copy) = {a / med['SSD->pinned host->GPU']:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"median_gbps": med, "all": res, "check_ms_per_chunk": check_ms,
                       "flipped_is_miss": flipped_miss, "chunk_mib": args.chunk_mib, "chunks": args.chunks}, f)
    return 0 if flipped_miss else 1


if __name__ == "__main__":
    sys.exit(main())
