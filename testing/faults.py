"""Faults that a soak (`testing/soak.py`) injects into a running `vllm serve` with kvtier: a small mounted file
system to fill to ENOSPC, one flipped byte of the SSD tier's journal, and SIGKILL of a server's process group.

    disk = SmallDisk(Path("work/ssd-fs"), size_mb=48)
    reason = disk.mount()             # None, or why it could not (then the ENOSPC fault is reported SKIPPED)
    disk.fill(); ...; disk.free()     # a filler file takes every free byte, then goes away
    disk.unmount()
    flip = flip_journal_byte(ssd_dir, seed=3)   # one byte of <ssd_dir>/**/journal*, at a seeded offset

Not production code: tests and benchmarks only (mounting needs root; a caller must report a refusal, never hide it).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import random
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

FILL_PIECE = 1 << 20


@dataclass
class SmallDisk:
    """A tmpfs of `size_mb` MiB mounted at `path` (made if missing), so that a filler file can fill it."""

    path: Path
    size_mb: int
    mounted: bool = False
    filler_bytes: int = 0

    @property
    def filler(self) -> Path:
        return self.path / "soak-filler"

    def mount(self) -> str | None:
        """Mount it; None on success, else the reason (not root, no mount(8), refused by the kernel...)."""
        self.path.mkdir(parents=True, exist_ok=True)
        try:
            p = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={self.size_mb}m,mode=0700", "tmpfs",
                                str(self.path)], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired) as e:
            return f"mount -t tmpfs failed: {type(e).__name__}: {e}"
        if p.returncode != 0:
            return f"mount -t tmpfs failed (exit {p.returncode}): {(p.stderr or p.stdout).strip()}"
        self.mounted = True
        return None

    def fill(self) -> int:
        """Write the filler until the file system says ENOSPC; returns the bytes it took."""
        piece = b"\xa5" * FILL_PIECE
        fd = os.open(self.filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            while True:
                try:
                    n = os.write(fd, piece)
                except OSError as e:
                    if e.errno != errno.ENOSPC:
                        raise
                    if len(piece) == 1:
                        break
                    piece = piece[:len(piece) // 2]  # take the last bytes too
                    continue
                self.filler_bytes += n
        finally:
            os.close(fd)
        return self.filler_bytes

    def free(self) -> None:
        self.filler.unlink(missing_ok=True)
        self.filler_bytes = 0

    def free_bytes(self) -> int:
        st = os.statvfs(self.path)
        return st.f_bavail * st.f_frsize

    def unmount(self) -> None:
        if not self.mounted:
            return
        p = subprocess.run(["umount", str(self.path)], capture_output=True, text=True, timeout=60)
        if p.returncode != 0:  # something still holds it: detach it now, the kernel frees it when released
            subprocess.run(["umount", "-l", str(self.path)], capture_output=True, text=True, timeout=60)
        self.mounted = False


@dataclass
class JournalFlip:
    path: str
    offset: int
    size: int
    old: int
    new: int


def journal_files(ssd_dir: Path) -> list[Path]:
    return sorted(p for p in Path(ssd_dir).rglob("journal*") if p.is_file() and not p.name.endswith(".tmp"))


def flip_journal_byte(ssd_dir: Path, seed: int) -> JournalFlip:
    """Invert one byte of the SSD tier's journal at a seeded offset in its first 3/4 (a damaged record followed by
    valid ones, not a torn tail). The server must be stopped. Raises FileNotFoundError if there is no journal."""
    found = [p for p in journal_files(ssd_dir) if p.stat().st_size > 0]
    if not found:
        raise FileNotFoundError(f"no non-empty journal under {ssd_dir}")
    path = found[0]
    size = path.stat().st_size
    offset = random.Random(seed).randrange(0, max(1, size * 3 // 4))
    with open(path, "r+b") as f:
        f.seek(offset)
        old = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([old ^ 0xFF]))
        f.flush()
        os.fsync(f.fileno())
    return JournalFlip(str(path), offset, size, old, old ^ 0xFF)


def kill_group(pid: int) -> None:
    """SIGKILL the whole process group (session) led by `pid`, as a crash or the OOM killer would end it."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)


def group_pids(pgid: int) -> list[int]:
    """The live processes of process group `pgid` (from /proc)."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()  # after "pid (comm) ": state, ppid, pgrp, ...
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] != "Z":
            out.append(int(d))
    return out


def group_usage(pgid: int) -> tuple[int, int, int]:
    """(resident bytes summed over the group's processes, open file descriptors, processes) from /proc."""
    page = os.sysconf("SC_PAGE_SIZE")
    rss = fds = n = 0
    for pid in group_pids(pgid):
        try:
            with open(f"/proc/{pid}/statm") as f:
                rss += int(f.read().split()[1]) * page
            fds += len(os.listdir(f"/proc/{pid}/fd"))
            n += 1
        except (OSError, IndexError, ValueError):
            continue  # it ended between the listing and the read
    return rss, fds, n
