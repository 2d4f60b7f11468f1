"""POSIX I/O helpers for the SSD tier: page-aligned buffers and full, aligned pread/pwrite loops.

Used where no CUDA driver exists (kvikio cannot run there). O_DIRECT needs the buffer address, the length and
the file offset to be multiples of the logical block size; `ALIGN` (4 KiB) satisfies every common device.
All calls release the GIL inside the kernel, so a thread pool gives real parallel I/O.
"""

from __future__ import annotations

import contextlib
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


def free_bytes(path: str) -> int:
    """Bytes free for unprivileged use on `path`'s file system (statvfs: available blocks x fragment size)."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def fsync_dir(path: str) -> None:
    """Make a directory's entries (a created or renamed file) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


#: errors that mean "no room" rather than "cannot do this": a probe that meets them cannot tell
NO_ROOM = (errno.ENOSPC, errno.EDQUOT)


def probe_o_direct(directory: str) -> str | None:
    """Check that `directory`'s file system takes O_DIRECT: an aligned write and read of a probe file, created
    exclusively (a planted file or link of that name is removed first, never written through). On a full disk (the
    probe's creation or write fails with ENOSPC or EDQUOT) an aligned O_DIRECT read of a file already there (a slot
    file) proves it instead, without needing room. Returns None when O_DIRECT works, or why it could not be told (a
    full disk and no file of at least ALIGN bytes to read, naming ENOSPC or EDQUOT); raises OSError when the file
    system refuses O_DIRECT (EINVAL)."""
    probe = os.path.join(directory, ".o_direct_probe")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(probe)
    try:
        fd = open_nofollow(probe, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_DIRECT)
    except OSError as e:
        if e.errno not in NO_ROOM:
            raise
        return _probe_by_reading(directory, e)
    try:
        buf = aligned_buffer(ALIGN)
        pwrite_full(fd, buf, 0)
        pread_full(fd, buf, 0)
    except OSError as e:
        if e.errno not in NO_ROOM:
            raise
        return _probe_by_reading(directory, e)
    finally:
        os.close(fd)
        os.unlink(probe)
    return None


def _probe_by_reading(directory: str, full: OSError) -> str | None:
    """The probe for a full disk: an aligned O_DIRECT read of the first regular file of at least ALIGN bytes in
    `directory` (slot files first; links are never followed). None when it works; why it could not be told when no
    such file exists; OSError when the read is refused."""
    with os.scandir(directory) as it:
        files = sorted((e.name for e in it if e.is_file(follow_symlinks=False) and not e.name.startswith(".")),
                       key=lambda n: (not n.endswith(".dat"), n))
    for name in files:
        path = os.path.join(directory, name)
        if os.lstat(path).st_size < ALIGN:
            continue
        fd = open_nofollow(path, os.O_RDONLY | os.O_DIRECT)
        try:
            pread_full(fd, aligned_buffer(ALIGN), 0)
        except EOFError:
            continue  # cut short since: try the next one
        finally:
            os.close(fd)
        return None
    code = errno.errorcode.get(full.errno or 0, str(full.errno))
    return (f"{full.strerror} ({code}): the disk is full, so the probe could not write, and no file there to read "
            "with O_DIRECT instead; cannot tell")


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
