"""Probe: durable O_DIRECT writes into fallocated space vs overwrites of blocks already written.

A growing SSD tier writes its first fills into fallocated slot files (ext4 unwritten extents, converted when each
write completes); a tier whose slots are reused overwrites written blocks. The probe writes 8 x 32 MiB on 4 threads
(fdatasync'd) into 1, 4 or 8 fallocated files and over a file already written, 4 rounds in rotating order, and
prints the median GB/s of each. Not a test: a measurement of the file system under benchmarks/ssd_tier.py, whose
writes are all first fills.

    .venv/bin/python benchmarks/first_fill_probe.py [--dir /var/tmp/mp-bench/wp]   (256 MiB, removed at the end)
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

from kvtier.storage_backends.ssd.posix_io import aligned_buffer, open_file

BLOCK = 32 << 20
CHUNKS = 8
CASES = [("1 fallocated file (unwritten extents)", 1, False), ("4 fallocated files", 4, False),
         ("8 fallocated files", 8, False), ("1 file, overwrite of written blocks", 1, True)]


def one_round(directory: str, files: int, overwrite: bool, src: memoryview) -> float:
    """GB/s of CHUNKS durable 32 MiB O_DIRECT writes spread over `files` fallocated files."""
    paths = [os.path.join(directory, f"f{i}") for i in range(files)]
    fds = [open_file(p, o_direct=True) for p in paths]
    per = CHUNKS // files
    try:
        for fd in fds:
            os.posix_fallocate(fd, 0, per * BLOCK)
            if overwrite:
                for j in range(per):
                    os.pwrite(fd, src, j * BLOCK)
                os.fdatasync(fd)
        jobs = [(fds[i % files], (i // files) * BLOCK) for i in range(CHUNKS)]
        t0 = time.perf_counter()
        with ThreadPoolExecutor(4) as ex:
            list(ex.map(lambda job: os.pwrite(job[0], src, job[1]), jobs))
        for fd in fds:
            os.fdatasync(fd)
        return CHUNKS * BLOCK / (time.perf_counter() - t0) / 1e9
    finally:
        for fd, p in zip(fds, paths):
            os.close(fd)
            os.unlink(p)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="/var/tmp/mp-bench/wp")
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    src = aligned_buffer(BLOCK)
    src[:] = os.urandom(BLOCK)
    res: dict[str, list[float]] = {}
    for r in range(args.rounds):
        k = r % len(CASES)
        for name, files, overwrite in CASES[k:] + CASES[:k]:
            res.setdefault(name, []).append(one_round(args.dir, files, overwrite, src))
    for name, v in res.items():
        print(f"{name:40s} median {statistics.median(v):.2f} GB/s   runs {' '.join(f'{x:.2f}' for x in v)}")
    os.rmdir(args.dir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
