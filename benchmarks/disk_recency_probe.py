"""Probe: are "cold" O_DIRECT reads on this disk faster the more recently their blocks were written?

On a VM whose disk is a file on the host, the host's page cache may still hold recently written blocks; dropping
the guest's page cache does not touch it. The probe writes file A (O_DIRECT, fdatasync), then writes K GiB of other
data, drops the guest cache and reads A with O_DIRECT in 32 MiB requests on 4 threads; for K in --k-gib, --repeats
times. It also reads A right after a fresh write of A vs after reading other data of the same size. Prints the
median GB/s per case. Needs root (drop_caches). Not a test: a measurement of the disk under the benchmarks.

    .venv/bin/python benchmarks/disk_recency_probe.py --dir /var/tmp/mp-bench [--gib 1] [--k-gib 0 1 3]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

from kvtier.storage_backends.ssd.posix_io import aligned_buffer, open_file

BLOCK = 32 << 20
THREADS = 4


def drop_caches() -> None:
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def write(path: str, nbytes: int, buf: memoryview) -> None:
    fd = open_file(path, o_direct=True)
    try:
        with ThreadPoolExecutor(THREADS) as ex:
            list(ex.map(lambda off: os.pwrite(fd, buf, off), range(0, nbytes, BLOCK)))
        os.fdatasync(fd)
    finally:
        os.close(fd)


def read(path: str, nbytes: int, bufs: list[memoryview]) -> float:
    """GB/s of an O_DIRECT read of the whole file, 32 MiB requests, THREADS threads."""
    fd = open_file(path, o_direct=True, create=False)
    offs = list(range(0, nbytes, BLOCK))
    try:
        t0 = time.perf_counter()
        with ThreadPoolExecutor(THREADS) as ex:
            list(ex.map(lambda i: [os.preadv(fd, [bufs[i]], o) for o in offs[i::THREADS]], range(THREADS)))
        return nbytes / (time.perf_counter() - t0) / 1e9
    finally:
        os.close(fd)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--k-gib", type=float, nargs="+", default=[0, 1, 3])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    n = int(args.gib * (1 << 30)) // BLOCK * BLOCK
    buf = aligned_buffer(BLOCK)
    buf[:] = os.urandom(BLOCK)
    bufs = [aligned_buffer(BLOCK) for _ in range(THREADS)]
    a, other = os.path.join(args.dir, "probe-a.dat"), os.path.join(args.dir, "probe-other.dat")
    res: dict[str, list[float]] = {}
    try:
        for _r in range(args.repeats):
            for k in args.k_gib:
                write(a, n, buf)
                if k:
                    write(other, int(k * (1 << 30)) // BLOCK * BLOCK, buf)
                drop_caches()
                res.setdefault(f"write A, write {k:g} GiB other, read A", []).append(read(a, n, bufs))
                if os.path.exists(other):
                    os.unlink(other)
            # reverse: read right after a write vs after reading other data of the same size
            write(a, n, buf)
            drop_caches()
            res.setdefault("write A, read A at once", []).append(read(a, n, bufs))
            write(other, n, buf)
            drop_caches()
            read(other, n, bufs)  # reading other data in between (A was written before `other`)
            drop_caches()
            res.setdefault("write A, write+read other, read A", []).append(read(a, n, bufs))
            drop_caches()
            res.setdefault("A read again (just read)", []).append(read(a, n, bufs))
            os.unlink(other)
    finally:
        for p in (a, other):
            if os.path.exists(p):
                os.unlink(p)
    for name, v in res.items():
        print(f"{name:45s} median {statistics.median(v):5.2f} GB/s   runs {' '.join(f'{x:.2f}' for x in v)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
