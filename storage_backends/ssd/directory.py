"""The SSD tier's directory: created safely, checked before use, and locked against a second process.

`prepare_directory` creates missing components 0700 and refuses a path that is a symbolic link, not a directory,
not owned by this user, group- or world-writable, or not writable: the tier writes files there, and another
user able to plant links or files in it could make the tier overwrite a file of theirs choosing or serve their
bytes. `lock_directory` takes an exclusive `flock` on `lock` (opened without following links), so two engines never
share one directory.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import stat

from kvtier.storage_backends.config import ConfigError
from kvtier.storage_backends.ssd.posix_io import open_nofollow

logger = logging.getLogger(__name__)


class DirectoryInUse(RuntimeError):
    """Another process holds the directory's lock."""


def prepare_directory(path: str) -> None:
    """Create `path` (and missing parents, each 0700) and check that it is safe for the tier to use."""
    missing = []
    p = os.path.abspath(path)
    while not os.path.lexists(p):
        missing.append(p)
        parent = os.path.dirname(p)
        if parent == p:
            break
        p = parent
    for d in reversed(missing):
        try:
            os.mkdir(d, 0o700)
        except FileExistsError:
            pass
        except OSError as e:
            raise ConfigError(f"kvtier.ssd_path: cannot create {d} ({e.strerror}); choose a writable "
                              "directory") from None
    try:
        st = os.lstat(path)
    except OSError as e:
        raise ConfigError(f"kvtier.ssd_path: cannot inspect {path} ({e.strerror})") from None
    if stat.S_ISLNK(st.st_mode):
        raise ConfigError(f"kvtier.ssd_path: {path} is a symbolic link; kvtier does not follow links in its SSD "
                          f"directory: set kvtier.ssd_path to the real directory ({os.path.realpath(path)})")
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"kvtier.ssd_path: {path} exists and is not a directory")
    if st.st_uid != os.geteuid():
        raise ConfigError(f"kvtier.ssd_path: {path} is owned by uid {st.st_uid}, not by this user "
                          f"(uid {os.geteuid()}); give kvtier a directory of its own")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise ConfigError(f"kvtier.ssd_path: {path} is writable by other users (mode "
                          f"{stat.S_IMODE(st.st_mode):04o}); run 'chmod 700 {path}' or choose another directory")
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(f"kvtier.ssd_path: {path} is not writable by this user; fix its permissions or "
                          "choose another directory")


def lock_directory(path: str, name: str = "lock") -> int:
    """Lock `path` for this process through the file `name`; returns the lock's fd (closing it releases it)."""
    lock = os.path.join(path, name)
    try:
        fd = open_nofollow(lock, os.O_RDWR | os.O_CREAT)
    except OSError as e:
        raise ConfigError(f"kvtier.ssd_path: cannot open {lock} ({e.strerror}); "
                          f"{'it is a symbolic link: remove it' if os.path.islink(lock) else 'check the directory'}"
                          ) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 64, 0).decode(errors="replace").strip()
        os.close(fd)
        raise DirectoryInUse(f"kvtier.ssd_path: {path} is in use by another kvtier process ({holder}); give "
                             "each engine its own directory") from None
    note = f"pid {os.getpid()}".encode()
    try:  # over the old note, then cut to length: an existing lock file needs no new block on a full disk
        os.pwrite(fd, note, 0)
        os.ftruncate(fd, len(note))
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT):
            os.close(fd)
            raise
        logger.warning("kvtier.ssd_path: the disk of %s is full (%s): the lock is held, without the holder's pid "
                       "in %s", path, e.strerror, lock)
    return fd


def read_small_file(path: str, limit: int = 1 << 16) -> bytes | None:
    """The contents of a small file kvtier wrote (never through a link), or None if there is none."""
    try:
        fd = open_nofollow(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        return os.read(fd, limit)
    finally:
        os.close(fd)


def write_small_file(path: str, data: bytes) -> None:
    """Replace `path` by `data` atomically and durably (a planted link at its temporary name is removed first)."""
    from kvtier.storage_backends.ssd.posix_io import fsync_dir

    tmp = path + ".tmp"
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)
    fd = open_nofollow(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(path) or ".")
