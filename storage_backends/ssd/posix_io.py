"""POSIX I/O helpers for the SSD tier: page-aligned buffers and full, aligned pread/pwrite loops.

Used where no CUDA driver exists (kvikio cannot run there). O_DIRECT needs the buffer address, the length and
the file offset to be multiples of the logical block size; `ALIGN` (4 KiB) satisfies every common device.
All calls release the GIL inside the kernel, so a thread pool gives real parallel I/O.
"""

from __future__ import annotations

import errno
import mmap
import os

import numpy as np

ALIGN = 4096


def align_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


def aligned_buffer(nbytes: int) -> memoryview:
    """A zeroed, page-aligned, writable buffer (anonymous mmap)."""
    return memoryview(mmap.mmap(-1, max(align_up(nbytes), ALIGN)))[:nbytes]


def address_of(buf: memoryview) -> int:
    return np.frombuffer(buf, dtype=np.uint8).ctypes.data if len(buf) else 0


def is_aligned(buf: memoryview, align: int = ALIGN) -> bool:
    return address_of(buf) % align == 0


def open_nofollow(path: str, flags: int, mode: int = 0o600) -> int:
    """`os.open` that never follows a symbolic link in the last path component (ELOOP instead)."""
    return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode)


def open_file(path: str, *, o_direct: bool, create: bool = True) -> int:
    """Open a data file for read/write, 0600, never through a symbolic link. Raises OSError (EINVAL where the file
    system refuses O_DIRECT, ELOOP for a link)."""
    flags = os.O_RDWR | (os.O_CREAT if create else 0)
    if o_direct:
        flags |= os.O_DIRECT
    return open_nofollow(path, flags)


def fsync_dir(path: str) -> None:
    """Make a directory's entries (a created or renamed file) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def probe_o_direct(directory: str) -> None:
    """Raise OSError if `directory`'s file system cannot do an aligned O_DIRECT write and read. The probe file is
    created exclusively (a planted file or link of that name is removed first, never written through)."""
    probe = os.path.join(directory, ".o_direct_probe")
    try:
        os.unlink(probe)
    except FileNotFoundError:
        pass
    fd = open_nofollow(probe, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_DIRECT)
    try:
        buf = aligned_buffer(ALIGN)
        pwrite_full(fd, buf, 0)
        pread_full(fd, buf, 0)
    finally:
        os.close(fd)
        os.unlink(probe)


def pread_full(fd: int, buf: memoryview, offset: int) -> None:
    """Fill `buf` from `offset`; raises EOFError on a short file (a truncated slot)."""
    done, n = 0, len(buf)
    while done < n:
        got = os.preadv(fd, [buf[done:]], offset + done)
        if got == 0:
            raise EOFError(f"short read: {done} of {n} bytes at offset {offset}")
        done += got


def preadv_full(fd: int, bufs: list[memoryview], offset: int) -> None:
    """Fill consecutive buffers from `offset` with as few syscalls as possible; EOFError on a short file."""
    bufs = [b for b in bufs if len(b)]
    while bufs:
        got = os.preadv(fd, bufs, offset)
        if got == 0:
            raise EOFError(f"short read at offset {offset}")
        offset += got
        while bufs and got >= len(bufs[0]):
            got -= len(bufs[0])
            bufs.pop(0)
        if got:
            bufs[0] = bufs[0][got:]


def pwrite_full(fd: int, buf: memoryview, offset: int) -> None:
    """Write all of `buf` at `offset`."""
    done, n = 0, len(buf)
    while done < n:
        put = os.pwritev(fd, [buf[done:]], offset + done)
        if put == 0:
            raise OSError(errno.EIO, "pwrite wrote nothing")
        done += put


def bytes_view(buf) -> memoryview:
    """A flat unsigned-byte view of any C-contiguous buffer (ctypes arrays, numpy, mmap...)."""
    mv = memoryview(buf)
    return mv if mv.format == "B" and mv.ndim == 1 else mv.cast("B")
