"""Host memory and page-cache control for the disk benchmarks and probes (test tooling, not the tiers).

- `huge_page_buffer`: a page-aligned buffer, faulted in, in transparent huge pages where the kernel grants them.
  On a VM an O_DIRECT request carries at most `max_segments` physically contiguous runs (254 on virtio-blk), so
  where a reader's destination (or a writer's source) lies in physical memory changes the request sizes and the
  speed (`benchmarks/dest_layout_probe.py`); benchmarks that compare readers give them all huge pages.
- `anon_huge_mib`: how much of this process is in huge pages (0 where THP is off).
- `drop_page_cache`: sync, then drop the page cache (cold reads; needs root).
"""

from __future__ import annotations

import mmap
import os

import numpy as np

HUGE_PAGE = 2 << 20


def huge_page_buffer(nbytes: int, huge: bool = True, shared: bool = False) -> memoryview:
    """`nbytes` of zeroed, faulted-in memory, 2 MiB aligned: private anonymous memory advised into huge pages
    (`huge`), or left in 4 KiB pages; `shared` maps shared anonymous memory instead (shmem: huge pages only where
    /sys/kernel/mm/transparent_hugepage/shmem_enabled allows, as for a process's shared-memory pools)."""
    flags = mmap.MAP_SHARED if shared else mmap.MAP_PRIVATE
    m = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=flags | mmap.MAP_ANONYMOUS)
    if huge:
        m.madvise(mmap.MADV_HUGEPAGE)
    start = -np.frombuffer(m, dtype=np.uint8).ctypes.data % HUGE_PAGE
    out = memoryview(m)[start:start + nbytes]
    np.frombuffer(out, dtype=np.uint8)[:] = 0  # fault it in now, not during a timed request
    return out


def anon_huge_mib() -> float:
    """This process's anonymous memory in transparent huge pages, MiB."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            return sum(int(line.split()[1]) for line in f if line.startswith("AnonHugePages:")) / 1024
    except OSError:
        return 0.0


def drop_page_cache() -> bool:
    """Write dirty pages back and drop the page cache; False where that is not allowed (not root)."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False
