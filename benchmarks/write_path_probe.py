"""Probe: how much a durable SSD tier can win on writes, and what the tier's own write path costs.

1. Ceiling of prepared slots: four threads write 256 MiB as 32 MiB O_DIRECT requests and fdatasync, either into
   a new file (a first fill of unwritten extents, as LMCache's `fs_native` and `LocalDiskBackend` write every
   chunk) or over blocks written before (what a tier with `kvtier.prepare_slots` does), from a source in 4 KiB pages
   of shared anonymous memory (like the MP server's shared-memory L1) or in transparent huge pages.
   The overwrite / first-fill ratio is the most a durable tier can gain from where it writes.
2. The tier's cost: `SSDTier.submit_puts` + `flush` of 8-chunk batches (CRC-32 per segment, header, fdatasync,
   fsync'd journal; slots prepared, then reused) against raw 32 MiB overwrites of the same slots from the same
   huge-page sources, four threads, fdatasync per batch.

    python benchmarks/write_path_probe.py --dir /var/tmp/probe [--rounds 4]

Rounds shuffle the variants; medians are reported, ratios as medians of the same round's ratios. Needs a real disk
(O_DIRECT).
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from kvtier.testing.host_memory import huge_page_buffer

MIB = 1 << 20
CHUNK = 32 * MIB
BATCH = 8
TOTAL = BATCH * CHUNK


def source(nbytes: int, kind: str, seed: int) -> memoryview:
    """Random bytes in shared anonymous memory in 4 KiB pages (`4k`) or private memory in huge pages (`huge`)."""
    out = huge_page_buffer(nbytes, huge=kind == "huge", shared=kind == "4k")
    np.frombuffer(out, dtype=np.uint8)[:] = np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)
    return out


def write_requests(fd: int, src: memoryview, base: int, stride: int) -> None:
    """Chunk i of `src` at `base + i * stride`, one 32 MiB O_DIRECT request each, on four threads."""
    def one(i: int) -> None:
        done, off = 0, base + i * stride
        while done < CHUNK:
            done += os.pwritev(fd, [src[i * CHUNK + done:(i + 1) * CHUNK]], off + done)

    with ThreadPoolExecutor(4) as ex:
        list(ex.map(one, range(BATCH)))


def fill_vs_overwrite(root: str, src: memoryview, overwrite: bool) -> float:
    path = os.path.join(root, "fill.dat")
    fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_DIRECT, 0o600)
    try:
        if overwrite:
            write_requests(fd, src, 0, CHUNK)
            os.fsync(fd)
        t0 = time.perf_counter()
        write_requests(fd, src, 0, CHUNK)
        os.fdatasync(fd)
        return TOTAL / (time.perf_counter() - t0) / 1e9
    finally:
        os.close(fd)
        os.unlink(path)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", required=True, help="directory on the disk to probe (not tmpfs)")
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args()
    root = os.path.join(args.dir, f"write-path-{os.getpid()}")
    os.makedirs(root)
    from kvtier.storage_backends.config import parse_kvtier_config
    from kvtier.storage_backends.ssd.index import ChunkMeta
    from kvtier.storage_backends.ssd.tier import SSDTier

    try:
        srcs = {kind: source(TOTAL, kind, i) for i, kind in enumerate(("4k", "huge"))}
        tier = SSDTier(parse_kvtier_config({"kvtier.ssd_path": os.path.join(root, "tier"),
                                            "kvtier.ssd_capacity_gb": 4 * BATCH * 33 / 1024,
                                            "kvtier.prepare_slots": True}), CHUNK)
        if not tier.wait_prepared(600):
            print("the tier's slot files were not prepared", file=sys.stderr)
            return 1
        meta = ChunkMeta(CHUNK, (CHUNK,), "torch.uint8", "KV_2LTD")
        huge = srcs["huge"]
        batches = [0]

        def tier_batch() -> float:
            b = batches[0] = batches[0] + 1
            keys = [f"probe@1@0@{b:032x}{i:032x}@uint8" for i in range(BATCH)]
            t0 = time.perf_counter()
            ok = tier.submit_puts([(k, meta, huge[i * CHUNK:(i + 1) * CHUNK], lambda stored: None)
                                   for i, k in enumerate(keys)])
            if not (all(ok) and tier.flush(600)):
                raise RuntimeError("a chunk was not stored")
            dt = time.perf_counter() - t0
            for k in keys:  # the next batch reuses these (written) slots
                tier.remove(k)
            return TOTAL / dt / 1e9

        def raw_batch() -> float:
            path, first = tier.io.files.locate_path(0)
            fd = os.open(path, os.O_RDWR | os.O_DIRECT)
            try:
                t0 = time.perf_counter()
                write_requests(fd, huge, first + 4096, tier.io.slot_size)
                os.fdatasync(fd)
                return TOTAL / (time.perf_counter() - t0) / 1e9
            finally:
                os.close(fd)

        variants = {f"{kind} source, {'overwrite' if ow else 'first fill'}":
                    (lambda kind=kind, ow=ow: fill_vs_overwrite(root, srcs[kind], ow))
                    for kind in srcs for ow in (False, True)}
        variants["tier: submit_puts + flush (prepared slots)"] = tier_batch
        variants["raw overwrite of the same slots"] = raw_batch
        res: dict[str, list[float]] = {n: [] for n in variants}
        for r in range(args.rounds):
            names = list(variants)
            random.Random(r).shuffle(names)
            for n in names:
                res[n].append(variants[n]())
        tier.close()
        med = {n: statistics.median(v) for n, v in res.items()}
        print(f"256 MiB per write (8 x 32 MiB O_DIRECT, 4 threads, fdatasync), {args.rounds} rounds, medians:")
        for n, v in res.items():
            print(f"  {n:<46} {med[n]:.2f} GB/s ({', '.join(f'{x:.2f}' for x in v)})")
        def ratio(a: str, b: str) -> float:  # median over rounds of a / b in the same round
            return statistics.median(x / y for x, y in zip(res[a], res[b]))

        for kind in srcs:
            print(f"  ceiling of prepared slots, {kind} source: overwrite / first fill = "
                  f"{ratio(f'{kind} source, overwrite', f'{kind} source, first fill'):.2f}")
        print(f"  tier / raw overwrite of the same slots = "
              f"{ratio('tier: submit_puts + flush (prepared slots)', 'raw overwrite of the same slots'):.2f}")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
