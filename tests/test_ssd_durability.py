"""Durability of the SSD tier: the order of its durability calls, and a simulated power cut.

A spy on `os.pwritev / os.write / os.fsync / os.fdatasync` checks that a chunk is reported stored only after
data -> header -> fdatasync(slot file) -> COMMIT record -> fsync(journal). SIGKILL leaves the page cache intact,
so the power-cut test also rolls every file back to what its last completed fsync/fdatasync made durable (it
records the bytes each write overwrites) and checks that every chunk reported committed reads back bit-exact and
that nothing else is ever returned with wrong bytes.
"""

from __future__ import annotations

import os
import random
import threading

import numpy as np
import pytest

from kvtier.storage_backends.ssd.slot_format import HEADER_SIZE
from kvtier.storage_backends.ssd.tier import SSDTier

CHUNK = 5 * 4096 + 321


def _path(fd: int) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return f"fd{fd}"


class Spy:
    """Records durability-relevant calls as (op, path, offset) in call order (calls complete before recording)."""

    def __init__(self, monkeypatch) -> None:
        self.events: list[tuple[str, str, int]] = []
        self._lock = threading.Lock()
        real = {n: getattr(os, n) for n in ("pwritev", "write", "fsync", "fdatasync")}

        def rec(op, fd, off=-1):
            with self._lock:
                self.events.append((op, _path(fd), off))

        def pwritev(fd, bufs, off, *a):
            n = real["pwritev"](fd, bufs, off, *a)
            rec("pwrite", fd, off)
            return n

        def write(fd, data):
            n = real["write"](fd, data)
            rec("write", fd)
            return n

        def fsync(fd):
            real["fsync"](fd)
            rec("fsync", fd)

        def fdatasync(fd):
            real["fdatasync"](fd)
            rec("fdatasync", fd)

        for name, fn in (("pwritev", pwritev), ("write", write), ("fsync", fsync), ("fdatasync", fdatasync)):
            monkeypatch.setattr(os, name, fn)

    def mark(self, what: str) -> None:
        with self._lock:
            self.events.append((what, "", -1))

    def index(self, pred) -> list[int]:
        return [i for i, e in enumerate(self.events) if pred(e)]


@pytest.mark.compat
def test_a_chunk_is_reported_stored_only_after_data_header_sync_commit_fsync(tier_config, ssd, monkeypatch):
    t = SSDTier(tier_config(), CHUNK)
    try:
        spy = Spy(monkeypatch)
        done = []
        assert t.submit_put("k", ssd.meta(CHUNK), memoryview(ssd.payload(1, CHUNK)),
                            lambda ok: (done.append(ok), spy.mark("done")))
        assert t.flush(30) and done == [True]
        e = t.entry("k")
        slot_path, base = t.io.files.locate_path(e.slot)
        jpath = t.io.journal.path
        data = spy.index(lambda ev: ev[0] == "pwrite" and ev[1] == slot_path and ev[2] >= base + HEADER_SIZE)
        header = spy.index(lambda ev: ev[0] == "pwrite" and ev[1] == slot_path and ev[2] == base)
        dsync = spy.index(lambda ev: ev[0] == "fdatasync" and ev[1] == slot_path)
        jwrite = spy.index(lambda ev: ev[0] == "write" and ev[1] == jpath)
        jsync = spy.index(lambda ev: ev[0] == "fsync" and ev[1] == jpath)
        reported = spy.index(lambda ev: ev[0] == "done")
        assert data and header and dsync and jwrite and jsync and reported, spy.events
        assert max(data) < min(header) < min(dsync) < min(jwrite) < min(jsync) < reported[0], spy.events
        assert max(header) < min(dsync)  # the header (the slot's last write) is durable before the commit
    finally:
        t.close()


class PowerCut:
    """Lets the tier run, remembering per file the bytes each write overwrote since that file's last completed
    fsync/fdatasync; `cut()` stops all further I/O and rolls every file back to its last durable state."""

    def __init__(self, monkeypatch) -> None:
        self.undo: dict[str, list[tuple[int, bytes, int]]] = {}  # path -> [(offset, old bytes, old size)]
        self._lock = threading.Condition()
        self._inflight = 0
        self.dead = False
        self._real = {n: getattr(os, n) for n in ("pwritev", "write", "fsync", "fdatasync", "posix_fallocate")}
        r = self._real

        def pwritev(fd, bufs, off, *a):
            with self._io(fd) as path:
                self._remember(path, off, sum(len(b) for b in bufs))
                return r["pwritev"](fd, bufs, off, *a)

        def write(fd, data):
            with self._io(fd) as path:
                self._remember(path, os.fstat(fd).st_size, len(data))  # the journal is O_APPEND
                return r["write"](fd, data)

        def posix_fallocate(fd, off, n):
            with self._io(fd) as path:
                self._remember(path, off, 0)
                return r["posix_fallocate"](fd, off, n)

        def syncer(name):
            def sync(fd):
                with self._io(fd) as path:
                    with self._lock:
                        before = len(self.undo.get(path, []))
                    r[name](fd)
                    with self._lock:  # only what was written before the sync started is durable now
                        del self.undo.get(path, [])[:before]
            return sync

        for name, fn in (("pwritev", pwritev), ("write", write), ("posix_fallocate", posix_fallocate),
                         ("fsync", syncer("fsync")), ("fdatasync", syncer("fdatasync"))):
            monkeypatch.setattr(os, name, fn)

    def _io(self, fd):
        outer = self

        class _Ctx:
            def __enter__(self):
                with outer._lock:
                    if outer.dead:
                        raise OSError(5, "power is off")
                    outer._inflight += 1
                return _path(fd)

            def __exit__(self, *exc):
                with outer._lock:
                    outer._inflight -= 1
                    outer._lock.notify_all()
                return False

        return _Ctx()

    def _remember(self, path: str, off: int, n: int) -> None:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            f.seek(off)
            old = f.read(n)
        with self._lock:
            self.undo.setdefault(path, []).append((off, old, size))

    def cut(self) -> None:
        with self._lock:
            self.dead = True
            while self._inflight:
                self._lock.wait()
            undo, self.undo = self.undo, {}
        for path, entries in undo.items():
            if not os.path.isfile(path):
                continue
            with open(path, "r+b") as f:
                for off, old, size in reversed(entries):
                    f.seek(off)
                    f.write(old)
                    f.truncate(size)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_power_cut_loses_no_committed_chunk_and_returns_no_wrong_bytes(tier_config, ssd, monkeypatch, seed):
    rng = random.Random(seed)
    cfg = tier_config(ssd_capacity_gb=400 * (HEADER_SIZE + 6 * 4096) / (1 << 30))
    t = SSDTier(cfg, CHUNK)
    power = PowerCut(monkeypatch)
    committed: list[str] = []
    lock = threading.Lock()
    stop = threading.Event()
    cut_after = rng.randrange(5, 40)
    enough = threading.Event()

    def on_done(key):
        def done(ok):
            if ok:
                with lock:
                    committed.append(key)
                    if len(committed) >= cut_after:
                        enough.set()
        return done

    def writer(wid):
        i = 0
        while not stop.is_set() and i < 200:
            key = f"w{wid}-{i}"
            t.submit_put(key, ssd.meta(CHUNK), memoryview(ssd.payload(hash(key) % 100_000, CHUNK)), on_done(key))
            i += 1

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(3)]
    for th in threads:
        th.start()
    assert enough.wait(60)
    power.cut()
    with lock:
        durable = list(committed)  # every chunk reported stored before the cut
    stop.set()
    for th in threads:
        th.join(30)
    t.close()  # the dead tier's remaining writes all fail; nothing reaches the disk any more
    monkeypatch.undo()

    t2 = SSDTier(cfg, CHUNK)
    try:
        present = set(t2.keys())
        assert set(durable) <= present, sorted(set(durable) - present)
        for key in present:
            got = ssd.get(t2, key)
            want = ssd.payload(hash(key) % 100_000, CHUNK)
            if key in durable:
                assert got is not None and np.array_equal(got, want), key
            else:
                assert got is None or np.array_equal(got, want), key
        t2.index.check_invariants()
    finally:
        t2.close()


def test_journal_compaction_never_drops_a_commit_on_its_way_to_the_index(tier_config, ssd, monkeypatch):
    """A compaction snapshots the index and rewrites the journal. Run while a writer has appended a COMMIT but not
    yet indexed the chunk, it would drop that record: the chunk, reported stored, would be gone after a restart."""
    import kvtier.storage_backends.ssd.tier_writes as mod

    monkeypatch.setattr(mod, "COMPACT_SLACK", -10**9)  # compact whenever asked
    cfg = tier_config()
    t = SSDTier(cfg, CHUNK)
    try:
        for i in range(4):
            assert ssd.put(t, f"a{i}", ssd.payload(i, CHUNK))
        assert t.remove("a0")
        appended, go_on = threading.Event(), threading.Event()
        real_commit = t.io.commit

        def commit(recs):
            real_commit(recs)
            appended.set()
            go_on.wait(10)

        monkeypatch.setattr(t.io, "commit", commit)
        done = []
        assert t.submit_put("k", ssd.meta(CHUNK), memoryview(ssd.payload(9, CHUNK)), done.append)
        assert appended.wait(10)
        compaction = threading.Thread(target=t._maybe_compact)
        compaction.start()
        compaction.join(0.5)  # it must wait for the commit to reach the index, not run in between
        monkeypatch.setattr(mod, "COMPACT_SLACK", 10**9)  # no later compaction may repair the journal
        go_on.set()
        compaction.join(10)
        assert t.flush(10) and done == [True]
    finally:
        go_on.set()
        t.close()
    t2 = SSDTier(cfg, CHUNK)
    try:
        assert sorted(t2.keys()) == ["a1", "a2", "a3", "k"]
        assert np.array_equal(ssd.get(t2, "k"), ssd.payload(9, CHUNK))
    finally:
        t2.close()
