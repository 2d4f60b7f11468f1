"""kvikio I/O for the SSD tier on CUDA machines: reads straight into GPU (or host) buffers with `CuFile.pread`.

kvikio uses GPUDirect Storage where the platform has it and its POSIX compat mode otherwise; either way it needs
a CUDA driver (`libcuda.so.1`), even for host buffers. `select_engine` picks `kvikio` or `posix` for
`kvtier.io_engine: auto` and refuses an explicit `kvikio` that cannot run (never a silent fallback).
"""

from __future__ import annotations

import ctypes
import logging
import threading
from typing import Any, Protocol

logger = logging.getLogger(__name__)


def kvikio_status() -> tuple[bool, str]:
    """(usable, reason): kvikio imports and a CUDA driver can be loaded."""
    try:
        import kvikio  # noqa: F401
    except Exception as e:  # ImportError, or a broken CUDA runtime
        return False, f"kvikio is not importable ({e})"
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False, "no CUDA driver (libcuda.so.1) on this machine"
    return True, "kvikio with a CUDA driver"


def gds_status() -> tuple[bool, str]:
    """(GDS, reason): whether kvikio would read through cuFile (GPUDirect Storage) rather than its compat mode
    (POSIX reads into a bounce buffer, then a copy to the GPU)."""
    try:
        import kvikio.defaults

        if kvikio.defaults.is_compat_mode_preferred():
            return False, "kvikio would run in its compat mode (no GPUDirect Storage on this machine)"
    except Exception as e:  # noqa: BLE001 - an old or broken kvikio: no GDS known
        return False, f"kvikio cannot say whether GPUDirect Storage is available ({e})"
    return True, "kvikio with GPUDirect Storage"


def select_engine(requested: str) -> str:
    """The I/O engine `kvtier.io_engine` resolves to. `auto` reads with kvikio (straight into device memory) only
    where GPUDirect Storage is on: in kvikio's compat mode the host path (O_DIRECT into pinned memory, the page
    kernel reading it) was faster (0.83-0.85x device/host on an H200, docs/results/2026-12-04-first-gpu-run.md);
    `kvikio` asks for it anyway."""
    from kvtier.storage_backends.config import ConfigError

    ok, why = kvikio_status()
    if requested == "posix":
        return "posix"
    if requested == "kvikio":
        if not ok:
            raise ConfigError(f"kvtier.io_engine: kvikio was requested but {why}; use auto or posix")
        return "kvikio"
    if ok:
        gds, why = gds_status()
        if gds:
            logger.info("kvtier.io_engine=auto chose kvikio (%s): SSD chunks are read straight into GPU memory", why)
            return "kvikio"
        logger.info("kvtier.io_engine=auto chose posix: %s; SSD chunks are read into pinned host memory, faster than "
                    "kvikio's compat mode here (kvtier.io_engine: kvikio uses it anyway)", why)
        return "posix"
    logger.info("kvtier.io_engine=auto chose posix (%s; POSIX pread/pwrite)", why)
    return "posix"


class DeviceReader(Protocol):
    """What the SSD tier's device reads use of kvikio: a positional read of `nbytes` at `offset` of the file at
    `path` into `buf` (a device tensor; a host one for the CPU stand-in)."""

    def pread(self, path: str, buf: Any, nbytes: int, offset: int) -> None: ...

    def close(self) -> None: ...


class KvikioFiles:
    """One `kvikio.CuFile` per slot file, opened lazily; thread-safe `pread` into any kvikio-readable buffer."""

    def __init__(self, num_threads: int) -> None:
        import kvikio
        import kvikio.defaults

        self._kvikio = kvikio
        kvikio.defaults.set({"num_threads": max(1, num_threads)})
        self._files: dict[str, Any] = {}  # kvikio CuFile handles
        self._lock = threading.Lock()
        logger.info("kvikio ready: compat_mode=%s, num_threads=%s", kvikio.defaults.get("compat_mode"),
                    kvikio.defaults.get("num_threads"))

    def _file(self, path: str):
        with self._lock:
            f = self._files.get(path)
            if f is None:
                f = self._files[path] = self._kvikio.CuFile(path, "r")
            return f

    def pread(self, path: str, buf, nbytes: int, offset: int) -> None:
        got = self._file(path).pread(buf, nbytes, offset).get()
        if got != nbytes:
            raise EOFError(f"short kvikio read: {got} of {nbytes} bytes at offset {offset}")

    def close(self) -> None:
        with self._lock:
            for f in self._files.values():
                f.close()
            self._files.clear()
