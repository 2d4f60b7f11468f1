"""Probe: does an O_DIRECT read's speed depend on where its destination buffer landed in physical memory?

On a VM, a block request carries at most `max_segments` physically contiguous runs (virtio-blk: 254), so a read
into scattered 4 KiB pages is cut into ~1 MiB requests while one into contiguous memory goes as 4 MiB requests
(`max_sectors_kb`). Which pages a buffer gets depends on the state of the free lists when it is first touched: the
first large buffer a process touches tends to get the most scattered ones. This probe writes `--chunks` files of
32 MiB (as LMCache's LocalDiskBackend does: one O_DIRECT write each), then reads them cold (page cache dropped,
needs root) with four threads of one 32 MiB read each, into sets of destination buffers that differ only in when
they were allocated, and optionally one set in transparent huge pages (private anonymous memory with
MADV_HUGEPAGE, which the kernel's `madvise` THP mode grants; shared anonymous memory follows `shmem_enabled`).

    python benchmarks/dest_layout_probe.py --dir /var/tmp/probe [--sets first,second,third,huge] [--rounds 4]

Reported: GB/s per set (median over rounds, each round in a shuffled order), and the device's queue limits.
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

from kvtier.testing.host_memory import anon_huge_mib, drop_page_cache, huge_page_buffer

MIB = 1 << 20
CHUNK = 32 * MIB


def queue_limits(path: str) -> str:
    dev = os.stat(path).st_dev
    name = os.path.basename(os.path.realpath(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}"))
    q = f"/sys/class/block/{name}/queue"
    if not os.path.isdir(q):  # a partition: its disk's queue
        q = os.path.join(os.path.dirname(os.path.realpath(f"/sys/class/block/{name}")), "queue")
    vals = []
    for key in ("max_segments", "max_sectors_kb", "nr_requests"):
        try:
            with open(os.path.join(q, key)) as f:
                vals.append(f"{key} {f.read().strip()}")
        except OSError:
            pass
    return f"{name}: " + ", ".join(vals)


def read_all(paths: list[str], dests: list[memoryview], threads: int = 4) -> float:
    def one(t: int) -> None:
        for i in range(t, len(paths), threads):
            fd = os.open(paths[i], os.O_RDONLY | os.O_DIRECT)
            try:
                buf, done = dests[t], 0
                while done < CHUNK:
                    done += os.preadv(fd, [buf[done:]], done)
            finally:
                os.close(fd)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as ex:
        list(ex.map(one, range(threads)))
    return len(paths) * CHUNK / (time.perf_counter() - t0) / 1e9


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", required=True, help="directory on the disk to probe (not tmpfs)")
    ap.add_argument("--chunks", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--sets", default="first,second,third,huge",
                    help="destination sets in allocation order; a name starting with 'huge' asks for huge pages")
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("needs root (drops the page cache before every read)", file=sys.stderr)
        return 2
    root = os.path.join(args.dir, f"dest-layout-{os.getpid()}")
    os.makedirs(root)
    try:
        src = huge_page_buffer(CHUNK, huge=False)
        np.frombuffer(src, dtype=np.uint8)[:] = np.random.default_rng(0).integers(0, 256, CHUNK, dtype=np.uint8)
        paths = []
        for i in range(args.chunks):
            p = os.path.join(root, f"chunk-{i}")
            fd = os.open(p, os.O_CREAT | os.O_WRONLY | os.O_DIRECT, 0o600)
            try:
                os.write(fd, src)
            finally:
                os.close(fd)
            paths.append(p)
        os.sync()
        names = [n.strip() for n in args.sets.split(",") if n.strip()]
        # allocated in order
        sets = {n: [huge_page_buffer(CHUNK, huge=n.startswith("huge")) for _ in range(4)] for n in names}
        print(f"{args.chunks} files of 32 MiB, read cold by 4 threads x one 32 MiB read; {queue_limits(root)}; "
              f"{anon_huge_mib():.0f} MiB of this process in huge pages")
        res: dict[str, list[float]] = {n: [] for n in names}
        for r in range(args.rounds):
            order = names[:]
            random.Random(r).shuffle(order)
            for n in order:
                drop_page_cache()
                res[n].append(read_all(paths, sets[n]))
        first = statistics.median(res[names[0]])
        for n in names:
            med = statistics.median(res[n])
            print(f"  destinations '{n}'{' (huge pages)' if n.startswith('huge') else ''}: median {med:.2f} GB/s "
                  f"({', '.join(f'{x:.2f}' for x in res[n])}); {med / first:.2f}x '{names[0]}'")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
