"""A capacity larger than the disk (issue #28, bug 1): the SSD tier must never fill its own disk.

The tester's case, for real, on a small ext4 file system on a loop device (skipped where mkfs or mount cannot run):
`ssd_capacity_gb` far above the free space, so every grow meets a full disk. The slot files must stay clear of the
journal's reserve, a failed grow must leave no blocks past the slots in use, stores must go on evicting within what
the disk holds, and a restart (O_DIRECT or not, on a disk that another file filled too) must start and store again.
Fast tests inject the same errors (statvfs, posix_fallocate, pwritev) without a mount.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import subprocess
from collections.abc import Callable

import numpy as np
import pytest

from kvtier.storage_backends.config import ConfigError
from kvtier.storage_backends.ssd import journal as journal_mod
from kvtier.storage_backends.ssd import tier_writes
from kvtier.storage_backends.ssd.journal import Journal
from kvtier.storage_backends.ssd.posix_io import free_bytes, probe_o_direct
from kvtier.storage_backends.ssd.slot_files import SlotFiles
from kvtier.storage_backends.ssd.slot_format import HEADER_SIZE, CommitRecord, FreeRecord, encode_record
from kvtier.storage_backends.ssd.tier import SSDTier
from kvtier.testing.ssd import get, payload, put

#: chunks of the real-disk tests: 520 KiB slots, about 65 of them on the small file system
BIG = (1 << 19) + 100
#: chunks of the fast tests (20 KiB slots)
CHUNK = 3 * 4096 + 100
SLOT = HEADER_SIZE + 4 * 4096
#: size of the loop-mounted ext4 image
DISK_MB = 48


def capacity_gb(slots: int, slot: int = SLOT) -> float:
    return (slots * slot + 1) / (1 << 30)


def fake_statvfs(monkeypatch, free: int | list[int] | Callable[[], int]) -> None:
    """`os.statvfs` reporting `free` bytes available on every path: a figure, a list (its next figure at each call,
    the last one from then on) or a function (called each time)."""
    figures = list(free) if isinstance(free, list) else [free]

    def statvfs(path):
        n = figures.pop(0) if len(figures) > 1 else figures[0]
        n = n() if callable(n) else n
        return os.statvfs_result((4096, 1, 1 << 40, n, n, 1 << 20, 1 << 20, 1 << 20, 0, 255))

    monkeypatch.setattr(os, "statvfs", statvfs)


def no_room(*_a) -> None:
    raise OSError(errno.ENOSPC, "No space left on device")


def files_match_their_slots(files: SlotFiles) -> None:
    """Every slot file is exactly as long as its allocated slots, and holds no blocks past them."""
    for name in os.listdir(files.directory):
        if not name.endswith(".dat"):
            continue
        idx = int(name.rsplit("-", 1)[1][:-4])
        st = os.stat(os.path.join(files.directory, name))
        slots = files._extent.get(idx, 0)
        assert st.st_size == slots * files.slot_size, (name, st.st_size / files.slot_size, slots)
        assert st.st_blocks * 512 <= st.st_size + (64 << 10), (name, st.st_blocks * 512, st.st_size)


# ---------------------------------------------------------------------------------------------- the real disk
@pytest.fixture
def small_disk(tmp_path):
    """A DISK_MB ext4 file system (no blocks reserved for root) on a loop device, unmounted at teardown."""
    mkfs, mount = shutil.which("mkfs.ext4"), shutil.which("mount")
    if mkfs is None or mount is None:
        pytest.skip("mkfs.ext4 or mount is not installed: no small file system to fill")
    if os.geteuid() != 0:
        pytest.skip("mounting a loop ext4 image needs root")
    img, mnt = tmp_path / "disk.img", tmp_path / "mnt"
    mnt.mkdir()
    with open(img, "wb") as f:
        f.truncate(DISK_MB << 20)
    r = subprocess.run([mkfs, "-q", "-F", "-m", "0", str(img)], capture_output=True, text=True)
    if r.returncode:
        pytest.skip(f"mkfs.ext4 failed here: {r.stderr.strip()}")
    r = subprocess.run([mount, "-o", "loop", str(img), str(mnt)], capture_output=True, text=True)
    if r.returncode:
        pytest.skip(f"cannot mount a loop ext4 image here (CI may not allow mounts): {r.stderr.strip()}")
    try:
        yield str(mnt)
    finally:
        if subprocess.run(["umount", str(mnt)], capture_output=True).returncode:
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def fill_disk(mnt: str, leave: int = 0) -> str:
    """A file taking every block still free on `mnt` (steps halve down to one 1 KiB block) but `leave` bytes."""
    path = os.path.join(mnt, "filler")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        off, step = 0, 1 << 20
        while step >= 1024:
            try:
                os.posix_fallocate(fd, off, step)
                off += step
            except OSError as e:
                assert e.errno == errno.ENOSPC, e
                os.ftruncate(fd, off)
                step //= 2
        os.ftruncate(fd, off - leave)
        os.fsync(fd)  # commits the transaction: blocks freed by the truncations are free again
    finally:
        os.close(fd)
    return path


@pytest.mark.parametrize("o_direct", [True, False], ids=["restart-o_direct", "restart-buffered"])
def test_capacity_far_above_a_small_disk_keeps_storing_and_restarts(small_disk, tier_config, o_direct):
    path = os.path.join(small_disk, "ssd")
    t = SSDTier(tier_config(ssd_path=path, ssd_capacity_gb=1.0), BIG)  # 1 GiB on 48 MiB, default 1 GiB grow step
    seeds: dict[str, int] = {}
    try:
        disk_slots = (DISK_MB << 20) // t.slot_size
        for i in range(2 * disk_slots):  # twice what the whole disk could hold
            assert put(t, f"a{i}", payload(i, BIG)), f"store {i} failed: {t.stats}"
            seeds[f"a{i}"] = i
        assert t.max_slots < disk_slots and len(t) == t.max_slots  # the budget is what the disk holds...
        assert t.stats.evictions == 2 * disk_slots - len(t)  # ...and stores evict within it
        assert t.stats.journal_write_errors == 0 and t.stats.dropped_no_space == 0
        files_match_their_slots(t.io.files)
        reserve = t.io.journal.reserve_bytes(t.io.files.allocated_slots())
        assert free_bytes(path) >= reserve - (1 << 20), (free_bytes(path), reserve)
        # The journal can still grow to the size it compacts at, and compact (its rewrite needs room beside it).
        noop = FreeRecord(1 << 40, 1)  # a slot beyond the capacity: replay ignores it
        target = (4 * len(t) + journal_mod.COMPACT_SLACK) * 176  # bytes of COMMIT records at the threshold
        for _ in range(target // len(encode_record(noop)) // 1000 + 1):
            t.io.journal.append([noop] * 1000, sync=False)
        t.io.journal.append([noop], sync=True)
        assert os.path.getsize(t.io.journal.path) >= target
        t.io.compact(t.index.live_records())
        assert t.io.records_written == len(t)
        for k in t.keys():
            assert np.array_equal(get(t, k), payload(seeds[k], BIG)), k
    finally:
        t.close()
    kept = set(t.keys())
    t = SSDTier(tier_config(ssd_path=path, ssd_capacity_gb=1.0, o_direct=o_direct), BIG)
    try:
        assert set(t.keys()) == kept
        for i in range(40):
            assert put(t, f"b{i}", payload(1000 + i, BIG)), f"store {i} after the restart failed: {t.stats}"
            seeds[f"b{i}"] = 1000 + i
        for k in t.keys():
            assert np.array_equal(get(t, k), payload(seeds[k], BIG)), k
        files_match_their_slots(t.io.files)
        t.index.check_invariants()
    finally:
        t.close()


def test_restart_on_a_disk_another_file_filled(small_disk, tier_config, monkeypatch, caplog):
    from kvtier.storage_backends.lmcache.mp_config import check_o_direct

    monkeypatch.setattr(tier_writes, "DISK_FULL_RETRY_S", 0.0)
    path = os.path.join(small_disk, "ssd")
    cfg = tier_config(ssd_path=path, ssd_capacity_gb=1.0)
    t = SSDTier(cfg, BIG)
    for i in range(10):
        assert put(t, f"a{i}", payload(i, BIG))
    t.close()
    os.mkdir(os.path.join(path, "empty"), 0o700)  # another tier's directory, no file in it yet
    filler = fill_disk(small_disk)  # not one block free: the lock's pid note, the probe and the journal must cope
    assert free_bytes(small_disk) < 4096
    try:
        with caplog.at_level(logging.WARNING, logger="kvtier"):
            t = SSDTier(cfg, BIG)  # the O_DIRECT probe cannot write: it reads a slot file instead
            assert not any("O_DIRECT" in r.getMessage() for r in caplog.records)
            assert check_o_direct(t.directory) is None
            other = SSDTier(cfg, BIG, subdir="empty")  # nothing to read there: it cannot tell, says why, starts
            other.close()
            untold = [r.getMessage() for r in caplog.records if "cannot check" in r.getMessage()]
            assert len(untold) == 1 and "ENOSPC" in untold[0] and "refuses" not in untold[0], untold
            assert "ENOSPC" in check_o_direct(os.path.join(path, "empty"))
        for i in range(10):
            assert np.array_equal(get(t, f"a{i}"), payload(i, BIG))
    finally:
        os.unlink(filler)
    try:  # room again: stores go on (the journal first, then growth)
        for i in range(30):
            assert put(t, f"b{i}", payload(100 + i, BIG)), f"store {i} failed: {t.stats}"
        for k in t.keys():
            seed = int(k[1:]) + (100 if k[0] == "b" else 0)
            assert np.array_equal(get(t, k), payload(seed, BIG)), k
        files_match_their_slots(t.io.files)
        t.index.check_invariants()
    finally:
        t.close()


# ---------------------------------------------------------------------------------------------- fast: growth
def test_growth_stays_clear_of_the_journal_reserve(tmp_path, monkeypatch):
    keep, ss = 1 << 20, 8192
    asked: list[int] = []
    files = SlotFiles(str(tmp_path), ss, slots_per_file=1000, grow_step_slots=100, o_direct=False,
                      keep_free=lambda slots: asked.append(slots) or keep)
    real = os.posix_fallocate
    calls = []
    monkeypatch.setattr(os, "posix_fallocate", lambda fd, off, n: (calls.append(n), real(fd, off, n))[1])
    try:
        fake_statvfs(monkeypatch, keep + 10 * ss + 100)
        files.ensure(0)  # a step of 100 slots shrinks to the 10 that fit beside the reserve
        assert files.allocated_slots() == 10 and calls == [10 * ss] and asked
        fake_statvfs(monkeypatch, keep + ss - 1)
        with pytest.raises(OSError) as e:  # not even one slot: nothing is allocated, no fallocate is tried
            files.ensure(10)
        assert e.value.errno == errno.ENOSPC and "kept for the journal" in str(e.value)
        assert len(calls) == 1 and files.allocated_slots() == 10
        fake_statvfs(monkeypatch, keep + ss)
        files.ensure(10)
        assert files.allocated_slots() == 11
        files_match_their_slots(files)
    finally:
        files.close()


def test_a_failed_grow_is_cut_back_to_the_slots_in_use(tmp_path, monkeypatch):
    ss = 8192
    files = SlotFiles(str(tmp_path), ss, slots_per_file=1000, grow_step_slots=8, o_direct=False)
    try:
        files.ensure(0)
        real = os.posix_fallocate

        def ext4_full(fd, off, n):  # what ext4 does on a full disk: it keeps the blocks it got, then fails
            real(fd, off, n // 2 + ss // 3)
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(os, "posix_fallocate", ext4_full)
        with pytest.raises(OSError):
            files.ensure(8)
        assert files.allocated_slots() == 8
        files_match_their_slots(files)

        def step_too_large(fd, off, n):  # the step does not fit, one slot does
            if n > ss:
                ext4_full(fd, off, n)
            real(fd, off, n)

        monkeypatch.setattr(os, "posix_fallocate", step_too_large)
        files.ensure(8)  # only the slot asked for
        assert files.allocated_slots() == 9
        files_match_their_slots(files)
    finally:
        files.close()


def test_a_slot_file_left_longer_than_its_slots_is_cut_at_start(tmp_path):
    ss = 8192
    path = tmp_path / "slots-8k-0000.dat"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    os.posix_fallocate(fd, 0, 3 * ss + 3000)  # 3.37 slots: an older version's failed grow
    os.close(fd)
    files = SlotFiles(str(tmp_path), ss, slots_per_file=1000, grow_step_slots=8, o_direct=False)
    try:
        assert files.allocated_slots() == 3
        files_match_their_slots(files)
    finally:
        files.close()


def test_zeroing_prepared_slots_stays_clear_of_the_journal_reserve(tmp_path, monkeypatch):
    from kvtier.storage_backends.ssd import slot_files

    ss, keep = 64 << 10, 1 << 20
    per_piece = slot_files.ZERO_PIECE // ss
    files = SlotFiles(str(tmp_path), ss, slots_per_file=1000, grow_step_slots=8, o_direct=False,
                      keep_free=lambda slots: keep)
    try:
        fake_statvfs(monkeypatch, [keep + slot_files.ZERO_PIECE, keep + slot_files.ZERO_PIECE - 1])
        job = files.begin_preparation(limit=3 * per_piece, step_slots=3 * per_piece)
        with pytest.raises(OSError) as e:  # the first piece fits, the second would take the journal's room
            files.zero_fill(job, lambda: True)
        assert e.value.errno == errno.ENOSPC
        assert files.allocated_slots() == per_piece  # the slots zeroed are kept, the claim has ended
        files_match_their_slots(files)
        fake_statvfs(monkeypatch, 1 << 40)
        real = os.pwritev

        def half_then_full(fd, bufs, off):  # a write that meets a full disk halfway through a piece
            real(fd, [bufs[0][:len(bufs[0]) // 2 + 3 * 4096]], off)
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(os, "pwritev", half_then_full)
        job = files.begin_preparation(limit=3 * per_piece, step_slots=per_piece)
        with pytest.raises(OSError):
            files.zero_fill(job, lambda: True)
        assert files.allocated_slots() == per_piece
        files_match_their_slots(files)
    finally:
        files.close()


def test_a_tier_stays_within_what_is_free_beside_its_journal(tier_config, monkeypatch):
    t = SSDTier(tier_config(ssd_capacity_gb=capacity_gb(100), grow_step_mb=1), CHUNK)
    try:
        assert t.io.files.keep_free(100) == t.io.journal.reserve_bytes(100) >= journal_mod.MIN_RESERVE_BYTES
        disk = t.io.journal.reserve_bytes(3) + 3 * t.slot_size + 10  # what the files and the journal may use
        fake_statvfs(monkeypatch, lambda: disk - t.io.files.allocated_slots() * t.slot_size)
        for i in range(10):
            assert put(t, f"k{i}", payload(i, CHUNK)), i
        assert t.io.files.allocated_slots() == 3 and t.max_slots == 3 and len(t) == 3
        assert t.stats.evictions == 7
        for i in range(7, 10):
            assert np.array_equal(get(t, f"k{i}"), payload(i, CHUNK))
        t.index.check_invariants()
    finally:
        t.close()


def test_the_journal_reserve_covers_a_compaction_at_the_tiers_threshold(tmp_path):
    assert journal_mod.COMPACT_SLACK == tier_writes.COMPACT_SLACK
    j = Journal(str(tmp_path / "journal.log"))
    slots = 1000
    threshold = journal_mod.COMPACT_PER_CHUNK * slots + tier_writes.COMPACT_SLACK  # records when the tier compacts
    lmcache_key = "meta-llama/Llama-3.1-8B-Instruct@1@0@" + "ab" * 32 + "@bfloat16"
    rec = CommitRecord(1, 1, lmcache_key, 1 << 22, (2, 32, 256, 1024), "torch.bfloat16", "KV_2LTD", 1 << 22, {})
    assert j.reserve_bytes(slots) >= 2 * threshold * len(encode_record(rec))
    assert j.reserve_bytes(0) >= journal_mod.MIN_RESERVE_BYTES
    long = CommitRecord(2, 2, "k" * 3000, 1 << 22, (2, 32, 256, 1024), "torch.bfloat16", "KV_2LTD", 1 << 22, {})
    j.append([long], sync=False)  # larger records than the guess: the reserve follows them
    assert j.reserve_bytes(slots) >= 2 * threshold * len(encode_record(long))
    j.close()
    j = Journal(str(tmp_path / "journal.log"))
    try:
        j.load()  # ...and a restart learns them from the file
        assert j.reserve_bytes(slots) >= 2 * threshold * len(encode_record(long))
    finally:
        j.close()


# ---------------------------------------------------------------------------------------------- fast: the budget
def test_a_hole_the_disk_has_no_room_for_is_set_aside_and_stores_go_on(tier_config, monkeypatch):
    """A slot below the highest one that is not on disk (a file cut short) and cannot be grown: stores must evict
    by the policy instead of failing on that slot forever, and the hole is used again once the disk has room."""
    cfg = tier_config(ssd_capacity_gb=capacity_gb(8), file_size_gb=capacity_gb(4), grow_step_mb=1)
    t = SSDTier(cfg, CHUNK)
    for i in range(8):
        assert put(t, f"k{i}", payload(i, CHUNK))
    t.close()
    assert t.io.files.slots_per_file == 4
    os.truncate(t.io.files.path(0), 2 * SLOT)  # slots 2 and 3 (file 0) are gone, 4..7 (file 1) are not
    t = SSDTier(cfg, CHUNK)
    try:
        assert sorted(t.keys()) == ["k0", "k1", "k4", "k5", "k6", "k7"]
        real = os.posix_fallocate
        monkeypatch.setattr(os, "posix_fallocate", no_room)
        for i in range(4):
            assert put(t, f"n{i}", payload(100 + i, CHUNK)), f"store {i} failed: {t.stats}"
        assert t.stats.evictions == 4  # by the policy (LRU: the oldest), within the slots on disk
        assert sorted(t.keys()) == ["k6", "k7", "n0", "n1", "n2", "n3"]
        t.index.check_invariants()
        monkeypatch.setattr(os, "posix_fallocate", real)
        monkeypatch.setattr(tier_writes, "DISK_FULL_RETRY_S", 0.0)
        for i in range(2):
            assert put(t, f"m{i}", payload(200 + i, CHUNK))
        assert len(t) == 8 and t.io.files.allocated_slots() == 8  # the holes were grown and used
        for k in t.keys():
            seed = {"k": 0, "n": 100, "m": 200}[k[0]] + int(k[1:])
            assert np.array_equal(get(t, k), payload(seed, CHUNK)), k
        t.index.check_invariants()
    finally:
        t.close()


def test_the_grow_episode_clears_when_a_grow_succeeds_again(tier_config, monkeypatch, caplog):
    t = SSDTier(tier_config(ssd_capacity_gb=capacity_gb(10), grow_step_mb=1), CHUNK)
    try:
        real = os.posix_fallocate
        fail = {"n": 1}

        def fallocate(fd, off, n):
            if fail["n"]:
                fail["n"] -= 1
                raise OSError(errno.EIO, "Input/output error")
            return real(fd, off, n)

        monkeypatch.setattr(os, "posix_fallocate", fallocate)
        with caplog.at_level(logging.INFO, logger="kvtier"):
            assert not put(t, "a", payload(1, CHUNK))
            assert t.io.episodes.active("grow")
            assert put(t, "b", payload(2, CHUNK))
        assert not t.io.episodes.active("grow")
        msgs = [r.getMessage() for r in caplog.records]
        assert sum("cannot grow" in m for m in msgs) == 1 and sum("grow again" in m for m in msgs) == 1, msgs
    finally:
        t.close()


# ---------------------------------------------------------------------------------------------- fast: O_DIRECT probe
def test_the_o_direct_probe_needs_no_free_space(tier_config, tmp_path, monkeypatch, caplog):
    from kvtier.storage_backends.lmcache.mp_config import check_o_direct

    cfg = tier_config()
    t = SSDTier(cfg, CHUNK)
    assert put(t, "k", payload(1, CHUNK))
    t.close()
    empty = tmp_path / "empty"
    empty.mkdir(mode=0o700)
    real = os.pwritev
    monkeypatch.setattr(os, "pwritev", no_room)  # the disk is full: the probe's write fails
    assert probe_o_direct(t.directory) is None  # a slot file read with O_DIRECT proves it instead
    untold = probe_o_direct(str(empty))
    assert "ENOSPC" in untold and "cannot tell" in untold
    assert not os.path.lexists(empty / ".o_direct_probe")
    assert "ENOSPC" in check_o_direct(str(empty))  # the MP adapter's check: a warning, not a ConfigError
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvtier"):
        t = SSDTier(cfg, CHUNK)
        t.close()
        assert not caplog.records
        fresh = SSDTier(tier_config(ssd_path=str(tmp_path / "fresh")), CHUNK)
        fresh.close()
    assert len(caplog.records) == 1 and "ENOSPC" in caplog.records[0].getMessage()
    assert "refuses" not in caplog.records[0].getMessage()

    def refuse(*_a):
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(os, "pwritev", refuse)  # a real refusal is still one
    with pytest.raises(ConfigError, match="refuses O_DIRECT"):
        check_o_direct(str(empty))
    with pytest.raises(ConfigError, match="refuses O_DIRECT"):
        SSDTier(cfg, CHUNK)
    monkeypatch.setattr(os, "pwritev", real)
    t = SSDTier(cfg, CHUNK)
    try:
        assert np.array_equal(get(t, "k"), payload(1, CHUNK))
    finally:
        t.close()


# ---------------------------------------------------------------------------------------------- fast: check-config
def test_check_config_warns_when_the_capacity_is_more_than_the_disk_has_free(lmcache_yaml, tmp_path, monkeypatch):
    import json

    from kvtier.cli.check_config import check

    yaml = lmcache_yaml()  # 0.05 GiB
    assert "warning" not in check(yaml)
    fake_statvfs(monkeypatch, 10 << 20)
    out = check(yaml)
    assert out.startswith("OK: ") and "warning: kvtier.ssd_capacity_gb=0.05 GiB is more than the 10.0 MiB free" in out
    assert "stay within what is free" in out
    spec = json.load(open(os.path.join(os.path.dirname(__file__), "..", "configs", "lmcache-mp-l2-kvtier.json")))
    spec["adapter_params"]["ssd_path"] = str(tmp_path / "mp")
    path = tmp_path / "l2.json"
    path.write_text(json.dumps(spec))
    out = check(str(path))
    assert out.startswith("OK: ") and "warning: adapter_params.ssd_capacity_gb=100 GiB is more than the 10.0 MiB" in out
