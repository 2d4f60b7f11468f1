"""The SSD tier under the faults an outside tester found: each test reproduces one defect and fails without its fix.

Duplicate stores under back-pressure, damaged and crafted journal records, planted symbolic links and unsafe
directories, a full disk, failures inside the writer, a reader leaked by a device read, a slot holding another key.
After each fault the tier must still hold its full capacity of fresh chunks (`check_invariants` + `fill_fresh`).
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import threading

import numpy as np
import pytest

from kvtier.storage_backends.config import ConfigError
from kvtier.storage_backends.ssd.slot_format import HEADER_SIZE, SlotHeader, encode_header, segments
from kvtier.storage_backends.ssd.tier import SSDTier
from kvtier.testing.ssd import fail_journal_writes, frame, hold_writer, record_spans
from kvtier.testing.waiting import wait_until

pytestmark = pytest.mark.compat

CHUNK = 2 * 4096 + 100


def slot_bytes(chunk: int = CHUNK) -> int:
    return HEADER_SIZE + -(-chunk // 4096) * 4096


def capacity_gb(slots: int, chunk: int = CHUNK) -> float:
    return (slots * slot_bytes(chunk) + 1) / (1 << 30)


def threads_waiting_for_room(monkeypatch, tier) -> set[threading.Thread]:
    """The threads that have waited on the write queue's condition (a store waiting for in-flight room, or the
    writer waiting for work), recorded while they still hold its lock: once a store is in the set, the writer
    cannot give room back before that store waits, so its wake-up is never missed."""
    seen: set[threading.Thread] = set()
    cond = tier.queue._cond
    real = cond.wait

    def wait(timeout=None):
        seen.add(threading.current_thread())
        return real(timeout)

    monkeypatch.setattr(cond, "wait", wait)
    return seen


def raw_commit(slot, gen, key, nbytes=CHUNK, seg=1 << 20, shape=None) -> bytes:
    """A CRC-valid journal COMMIT record with any field values (bypassing the record type's own checks)."""
    return frame(["C", slot, gen, key, nbytes, list(shape or [nbytes]), "torch.uint8", "KV_2LTD", seg, {}])


# ---------------------------------------------------------------------------------------------------- defect 1
def test_same_key_from_two_threads_under_backpressure_is_stored_once(tier_config, ssd, monkeypatch):
    n = 1 << 20
    t = SSDTier(tier_config(max_inflight_write_mb=1, backpressure_timeout_s=20, ssd_capacity_gb=capacity_gb(4, n),
                            io_block_mb=1), n)
    try:
        gate = hold_writer(monkeypatch, t)
        waiting = threads_waiting_for_room(monkeypatch, t)
        assert t.submit_put("filler", ssd.meta(n), memoryview(ssd.payload(1, n)), lambda ok: None)
        data = ssd.payload(2, n)
        results: list[bool] = []
        threads = [threading.Thread(target=lambda: results.append(
            t.submit_put("k", ssd.meta(n), memoryview(data), lambda ok: None))) for _ in range(2)]
        for th in threads:
            th.start()
        wait_until(lambda: waiting >= set(threads), 30, "both stores of k to wait for in-flight room")
        gate.set()
        for th in threads:
            th.join(30)
        assert sorted(results) == [False, True]
        assert t.flush(30) and sorted(t.keys()) == ["filler", "k"] and t.stats.duplicate_puts == 1
        t.index.check_invariants()
        assert ssd.fill_fresh(t, "fresh", 4) == 4 and len(t) == 4
        t.index.check_invariants()
    finally:
        t.close()


def test_a_key_committed_twice_frees_the_older_slot(tier_config, ssd):
    """Defence in depth: even if two writes of one key reach the index, the first slot is not leaked."""
    from kvtier.storage_backends.ssd.index import ChunkMeta

    t = SSDTier(tier_config(ssd_capacity_gb=capacity_gb(3)), CHUNK)
    try:
        m = ChunkMeta(CHUNK, (CHUNK,), "torch.uint8", "KV_2LTD")
        r1, r2 = t.index.reserve(), t.index.reserve()
        t.index.commit("k", r1, m, t.seg)
        t.index.commit("k", r2, m, t.seg)
        assert t.entry("k").slot == r2.slot and len(t) == 1
        t.index.check_invariants()
        assert ssd.fill_fresh(t, "fresh", 3) == 3
    finally:
        t.close()


# ---------------------------------------------------------------------------------------------------- defect 2
def test_one_flipped_journal_byte_costs_only_its_own_chunk(tier_config, ssd):
    cfg = tier_config(ssd_capacity_gb=capacity_gb(16))
    t = SSDTier(cfg, CHUNK)
    for i in range(10):
        assert ssd.put(t, f"k{i}", ssd.payload(i, CHUNK))
    jpath = t.io.journal.path
    t.close()
    spans = record_spans(open(jpath, "rb").read())
    assert len(spans) == 10
    lo, hi = spans[2]
    with open(jpath, "r+b") as f:
        f.seek(lo + 8 + (hi - lo - 8) // 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x10]))
    for _ in range(2):  # and again: the repair is durable, nothing else is lost later
        t = SSDTier(cfg, CHUNK)
        try:
            assert sorted(t.keys()) == sorted(f"k{i}" for i in range(10) if i != 2)
            for i in range(10):
                got = ssd.get(t, f"k{i}")
                assert (got is None) if i == 2 else np.array_equal(got, ssd.payload(i, CHUNK))
            t.index.check_invariants()
        finally:
            t.close()
    assert len(record_spans(open(jpath, "rb").read())) >= 9  # valid records were never cut off


def test_a_torn_append_in_the_middle_keeps_the_records_after_it(tier_config, ssd):
    """A failed append (ENOSPC half-way) leaves a partial record; records appended later must survive it."""
    cfg = tier_config(ssd_capacity_gb=capacity_gb(16))
    t = SSDTier(cfg, CHUNK)
    for i in range(3):
        assert ssd.put(t, f"a{i}", ssd.payload(i, CHUNK))
    with open(t.io.journal.path, "ab") as f:
        f.write(raw_commit(9, 999, "torn")[:20])  # a partial record
    for i in range(3):
        assert ssd.put(t, f"b{i}", ssd.payload(10 + i, CHUNK))
    t.close()
    t = SSDTier(cfg, CHUNK)
    try:
        assert sorted(t.keys()) == ["a0", "a1", "a2", "b0", "b1", "b2"]
        assert all(np.array_equal(ssd.get(t, f"b{i}"), ssd.payload(10 + i, CHUNK)) for i in range(3))
    finally:
        t.close()


# ---------------------------------------------------------------------------------------------------- defect 3
@pytest.mark.parametrize("crafted", [
    dict(slot=0, gen=50, key="zero-seg", seg=0),
    dict(slot=-1, gen=50, key="negative-slot"),
    dict(slot=1, gen=50, key="huge", nbytes=1 << 40),
    dict(slot=10_000, gen=50, key="beyond-capacity"),
    dict(slot=0, gen=50, key="steals-slot-0"),  # names k0's slot with another key: k0's chunk is its cost
    dict(slot=2, gen=0, key="gen-zero"),
    dict(slot=3, gen=51, key="odd-seg", seg=12345),
    dict(slot=3, gen=52, key="negative-dim", shape=[-1]),
])
def test_crafted_journal_records_are_range_checked(tier_config, ssd, crafted):
    cfg = tier_config(ssd_capacity_gb=capacity_gb(8))
    t = SSDTier(cfg, CHUNK)
    for i in range(4):
        assert ssd.put(t, f"k{i}", ssd.payload(i, CHUNK))
    jpath, directory = t.io.journal.path, t.directory
    t.close()
    with open(jpath, "ab") as f:
        f.write(raw_commit(**crafted))
    t = SSDTier(cfg, CHUNK)
    try:
        assert ssd.get(t, crafted["key"]) is None
        stolen = crafted["key"] == "steals-slot-0"
        for i in range(4):
            got = ssd.get(t, f"k{i}")
            assert (got is None) if (stolen and i == 0) else np.array_equal(got, ssd.payload(i, CHUNK))
        assert not any("--" in name for name in os.listdir(directory))  # no file for a negative slot
        t.index.check_invariants()
        assert ssd.fill_fresh(t, "fresh", 8) == 8 and len(t) == 8
    finally:
        t.close()


# ---------------------------------------------------------------------------------------------------- defect 4
def test_ssd_path_that_is_a_symlink_is_refused(tier_config, tmp_path):
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(real)
    with pytest.raises(ConfigError, match="symbolic link"):
        SSDTier(tier_config(ssd_path=str(tmp_path / "link")), CHUNK)
    assert os.listdir(real) == []


def test_group_or_world_writable_ssd_path_is_refused(tier_config, tmp_path):
    d = tmp_path / "open"
    d.mkdir()
    os.chmod(d, 0o777)
    with pytest.raises(ConfigError, match="writable by other users.*chmod 700"):
        SSDTier(tier_config(ssd_path=str(d)), CHUNK)
    os.chmod(d, 0o770)
    with pytest.raises(ConfigError, match="writable by other users"):
        SSDTier(tier_config(ssd_path=str(d)), CHUNK)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a directory to another user")
def test_ssd_path_owned_by_another_user_is_refused(tier_config, tmp_path):
    d = tmp_path / "theirs"
    d.mkdir(mode=0o700)
    os.chown(d, 4242, 4242)
    with pytest.raises(ConfigError, match="owned by uid 4242"):
        SSDTier(tier_config(ssd_path=str(d)), CHUNK)


def test_created_directories_are_private(tier_config, tmp_path):
    base = tmp_path / "a"
    t = SSDTier(tier_config(ssd_path=str(base / "b" / "c")), CHUNK, subdir="worker0-of-1")
    t.close()
    for d in (base, base / "b", base / "b" / "c", base / "b" / "c" / "worker0-of-1"):
        assert stat.S_IMODE(os.stat(d).st_mode) == 0o700, d


@pytest.mark.parametrize("name", ["lock", "journal", "slots", "subdir"])
def test_planted_symlinks_are_never_written_through(tier_config, ssd, tmp_path, name):
    cfg = tier_config(ssd_capacity_gb=capacity_gb(4))
    t = SSDTier(cfg, CHUNK, subdir="w")
    assert ssd.put(t, "k", ssd.payload(1, CHUNK))
    directory, jpath = t.directory, t.io.journal.path
    slot_file = t.io.files.path(0)
    t.close()
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious" * 1000)
    target = {"lock": os.path.join(directory, "lock"), "journal": jpath, "slots": slot_file,
              "subdir": directory}[name]
    if name == "subdir":
        os.rename(directory, str(tmp_path / "moved"))
        os.symlink(tmp_path / "moved", directory)
    else:
        os.unlink(target)
        os.symlink(victim, target)
    with pytest.raises(ConfigError, match="symbolic link|not a regular file"):
        SSDTier(cfg, CHUNK, subdir="w")
    assert victim.read_bytes() == b"precious" * 1000


def test_planted_probe_and_compaction_links_are_removed_not_followed(tier_config, ssd, tmp_path):
    cfg = tier_config(ssd_capacity_gb=capacity_gb(4))
    t = SSDTier(cfg, CHUNK)
    directory, jpath = t.directory, t.io.journal.path
    t.close()
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious" * 1000)
    os.symlink(victim, os.path.join(directory, ".o_direct_probe"))
    os.symlink(victim, jpath + ".tmp")
    t = SSDTier(cfg, CHUNK)
    try:
        assert ssd.put(t, "k", ssd.payload(1, CHUNK))
        t.io.compact(t.index.live_records())
        assert np.array_equal(ssd.get(t, "k"), ssd.payload(1, CHUNK))
    finally:
        t.close()
    assert victim.read_bytes() == b"precious" * 1000


# ---------------------------------------------------------------------------------------------------- defect 5
def test_full_disk_never_raises_from_remove_or_get(tier_config, ssd, monkeypatch):
    t = SSDTier(tier_config(ssd_capacity_gb=capacity_gb(3)), CHUNK)
    try:
        for k in "abc":
            assert ssd.put(t, k, ssd.payload(ord(k), CHUNK))
        path, base = t.io.files.locate_path(t.entry("c").slot)
        with open(path, "r+b") as f:  # corrupt c's data
            f.seek(base + HEADER_SIZE + 10)
            f.write(b"\xff\xff")
        state = fail_journal_writes(monkeypatch, t)
        assert t.remove("a") is True  # its FREE record cannot be written
        assert ssd.get(t, "c") is None and t.stats.corrupt == 1
        assert np.array_equal(ssd.get(t, "b"), ssd.payload(ord("b"), CHUNK))
        state["on"] = False  # space is back: the freed slots are usable without a restart
        assert ssd.fill_fresh(t, "fresh", 2) == 2 and len(t) == 3
        t.index.check_invariants()
    finally:
        t.close()


def test_failed_journal_appends_drop_chunks_counted_and_logged_once(tier_config, ssd, monkeypatch, caplog):
    t = SSDTier(tier_config(ssd_capacity_gb=capacity_gb(4)), CHUNK)
    try:
        state = fail_journal_writes(monkeypatch, t)
        with caplog.at_level(logging.INFO, logger="kvtier"):
            for i in range(10):
                assert not ssd.put(t, f"k{i}", ssd.payload(i, CHUNK))
            assert len(t) == 0 and t.stats.dropped_io_error == 10 and t.stats.committed == 0
            state["on"] = False
            assert ssd.fill_fresh(t, "fresh", 4) == 4  # no slot leaked by the failed commits
        errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
        assert len(errors) == 1 and "journal append failed" in errors[0].getMessage()
        assert sum("succeed again" in r.getMessage() for r in caplog.records) == 1
        t.index.check_invariants()
    finally:
        t.close()


def test_disk_full_freezes_then_capacity_comes_back_without_restart(tier_config, ssd, monkeypatch, caplog):
    import kvtier.storage_backends.ssd.tier_writes as mod

    monkeypatch.setattr(mod, "DISK_FULL_RETRY_S", 0.0)
    t = SSDTier(tier_config(ssd_capacity_gb=capacity_gb(100), grow_step_mb=1), CHUNK)
    try:
        step = t.io.files.grow_step_slots
        assert step < 100
        real = os.posix_fallocate
        full = {"on": False}

        def fallocate(fd, off, n):
            if full["on"]:
                raise OSError(errno.ENOSPC, "No space left on device")
            return real(fd, off, n)

        monkeypatch.setattr(os, "posix_fallocate", fallocate)
        with caplog.at_level(logging.INFO, logger="kvtier"):
            assert ssd.fill_fresh(t, "a", step) == step
            full["on"] = True
            assert ssd.fill_fresh(t, "b", step + 5) == step + 5  # evicts within the allocated slots
            assert len(t) == step and t.max_slots == step
            full["on"] = False  # space freed elsewhere: the tier grows again on its own
            assert ssd.fill_fresh(t, "c", 100) == 100
            assert len(t) == 100 and t.max_slots == 100
        assert sum("disk full" in r.getMessage() for r in caplog.records) == 1
        assert sum("has room again" in r.getMessage() for r in caplog.records) == 1
        t.index.check_invariants()
    finally:
        t.close()


# ---------------------------------------------------------------------------------------------------- defect 6
def test_a_failing_chunk_never_fails_its_batch(tier_config, ssd, monkeypatch):
    import kvtier.storage_backends.ssd.slot_io as io_mod

    t = SSDTier(tier_config(ssd_capacity_gb=capacity_gb(8)), CHUNK)
    try:
        real_encode = io_mod.encode_header

        def encode(h, out):
            if h.key == "bad":
                raise ValueError("slot header too large")
            return real_encode(h, out)

        monkeypatch.setattr(io_mod, "encode_header", encode)
        gate = hold_writer(monkeypatch, t)
        done: dict[str, bool] = {}
        for k in ["a", "bad", "b", "c"]:
            assert t.submit_put(k, ssd.meta(CHUNK), memoryview(ssd.payload(ord(k[0]), CHUNK)),
                                lambda ok, k=k: done.__setitem__(k, ok))
        gate.set()
        assert t.flush(30)
        assert done == {"a": True, "bad": False, "b": True, "c": True}
        assert t.stats.dropped_too_large == 1 and sorted(t.keys()) == ["a", "b", "c"]
        t.index.check_invariants()
        assert ssd.fill_fresh(t, "fresh", 5) == 5
    finally:
        t.close()


def test_a_key_too_long_for_the_header_is_refused_at_submit(tier_config, ssd):
    t = SSDTier(tier_config(), CHUNK)
    try:
        assert not t.submit_put("x" * 5000, ssd.meta(CHUNK), memoryview(ssd.payload(1, CHUNK)), lambda ok: None)
        assert t.stats.dropped_too_large == 1
        assert ssd.put(t, "ok", ssd.payload(2, CHUNK))
    finally:
        t.close()


def test_fdatasync_failure_fails_only_that_batch_and_leaks_nothing(tier_config, ssd, monkeypatch):
    t = SSDTier(tier_config(ssd_capacity_gb=capacity_gb(4)), CHUNK)
    try:
        real = os.fdatasync
        fails = {"n": 1}

        def fdatasync(fd):
            if fails["n"]:
                fails["n"] -= 1
                raise OSError(errno.EIO, "Input/output error")
            return real(fd)

        monkeypatch.setattr(os, "fdatasync", fdatasync)
        assert not ssd.put(t, "lost", ssd.payload(1, CHUNK))
        assert not t.contains("lost") and t.stats.dropped_io_error == 1
        assert ssd.fill_fresh(t, "fresh", 4) == 4
        t.index.check_invariants()
    finally:
        t.close()


def test_writer_bug_fails_the_batch_without_leaking_slots(tier_config, ssd, monkeypatch):
    t = SSDTier(tier_config(ssd_capacity_gb=capacity_gb(4)), CHUNK)
    try:
        real = t.io.commit
        monkeypatch.setattr(t.io, "commit", lambda recs: (_ for _ in ()).throw(RuntimeError("bug")))
        assert not ssd.put(t, "x", ssd.payload(1, CHUNK))
        monkeypatch.setattr(t.io, "commit", real)
        assert ssd.fill_fresh(t, "fresh", 4) == 4
        t.index.check_invariants()
    finally:
        t.close()


# ---------------------------------------------------------------------------------------------------- defect 7
class _HostKvikio:
    """Stands in for kvikio's CuFile reads on a machine without a GPU: reads the file into the tensor's memory."""

    def pread(self, path, buf, nbytes, offset):
        fd = os.open(path, os.O_RDONLY)
        try:
            data = os.pread(fd, nbytes, offset)
        finally:
            os.close(fd)
        buf.numpy()[:len(data)] = np.frombuffer(data, dtype=np.uint8)
        if len(data) != nbytes:
            raise EOFError("short read")

    def close(self):
        pass


def test_device_reads_never_leak_a_reader(tier_config, ssd):
    torch = pytest.importorskip("torch")
    t = SSDTier(tier_config(ssd_capacity_gb=capacity_gb(2), o_direct=False), CHUNK)
    try:
        assert ssd.put(t, "k", ssd.payload(3, CHUNK))
        assert t.read_into_device("k", torch.zeros(CHUNK, dtype=torch.uint8)) is False  # no kvikio: a miss
        t.io._kvikio = _HostKvikio()
        assert t.read_into_device("k", torch.zeros(10, dtype=torch.uint8)) is False  # too small: a miss
        dest = torch.zeros(CHUNK, dtype=torch.uint8)
        assert t.read_into_device("k", dest) is True
        assert np.array_equal(dest.numpy(), ssd.payload(3, CHUNK))
        t.index.check_invariants()  # no reader left behind by the failed reads
        assert ssd.fill_fresh(t, "fresh", 2) == 2  # so k could be evicted
    finally:
        t.io._kvikio = None
        t.close()


# ---------------------------------------------------------------------------------------------------- key check
def test_slot_holding_another_key_with_the_same_generation_is_a_miss(tier_config, ssd):
    """Only the key check can catch this one: same generation, sizes and valid CRCs, another key."""
    t = SSDTier(tier_config(o_direct=False), CHUNK)
    try:
        data = ssd.payload(5, CHUNK)
        assert ssd.put(t, "a", data)
        e = t.entry("a")
        hdr = bytearray(HEADER_SIZE)
        from kvtier.storage_backends.ssd.slot_format import FORMAT_VERSION, checksum

        crcs = tuple(checksum(memoryview(data)[lo:hi]) for lo, hi in segments(CHUNK, t.seg))
        encode_header(SlotHeader(FORMAT_VERSION, "b", e.gen, CHUNK, (CHUNK,), "torch.uint8", "KV_2LTD", t.seg,
                                 crcs), memoryview(hdr))
        path, base = t.io.files.locate_path(e.slot)
        with open(path, "r+b") as f:
            f.seek(base)
            f.write(hdr)
        assert ssd.get(t, "a") is None and t.stats.corrupt == 1
    finally:
        t.close()
