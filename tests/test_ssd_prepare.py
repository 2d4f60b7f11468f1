"""`kvtier.prepare_slots`: slot files zeroed up to the capacity while the tier is idle, never under a chunk.

The preparer writes zeros past a file's allocated extent in claimed steps; a writer that needs a slot of that file
waits for the step to end, and the preparer stops between requests as soon as a read or a write arrives. These
tests slow the zero writes down so that the writers really meet a claimed step.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time

import numpy as np
import pytest

from kvtier.storage_backends.ssd import slot_files, tier_prepare
from kvtier.storage_backends.ssd.posix_io import align_up
from kvtier.storage_backends.ssd.slot_format import HEADER_SIZE
from kvtier.storage_backends.ssd.tier import SSDTier
from kvtier.testing import ssd as ssd_testing
from kvtier.testing.waiting import wait_until

pytestmark = pytest.mark.compat

CHUNK = 3 * 4096 + 100
#: PREPARE_IDLE_S in these tests (`quick_preparer`): the idle time after which a preparer starts zeroing
IDLE_S = 0.02
#: a window in which something must NOT happen: 15 x IDLE_S, so a preparer that exists would have begun zeroing
NOTHING_HAPPENS_S = 15 * IDLE_S
put, get = ssd_testing.put, ssd_testing.get


@pytest.fixture(autouse=True)
def quick_preparer(monkeypatch):
    monkeypatch.setattr(tier_prepare, "PREPARE_IDLE_S", IDLE_S)
    monkeypatch.setattr(slot_files, "ZERO_PIECE", 4096)  # many requests per slot: many chances to yield


def slow_zero_writes(monkeypatch, delay: float, calls: list[int] | None = None, fail_after: int | None = None):
    """Zero writes of the preparer (only they go through slot_files.pwrite_full) take `delay` s each."""
    real = slot_files.pwrite_full

    def slow(fd, buf, off):
        if calls is not None:
            calls.append(off)
        if fail_after is not None and calls is not None and len(calls) > fail_after:
            raise OSError(errno.ENOSPC, "No space left on device (injected)")
        time.sleep(delay)
        real(fd, buf, off)

    monkeypatch.setattr(slot_files, "pwrite_full", slow)


def count_busy_answers(monkeypatch) -> list[float]:
    """The times (monotonic) of the preparer's idle checks (`SSDTier._idle`) that answered "busy": stop zeroing,
    or wait."""
    real = SSDTier._idle
    busy: list[float] = []

    def idle(self) -> bool:
        ok = real(self)
        if not ok:
            busy.append(time.monotonic())
        return ok

    monkeypatch.setattr(SSDTier, "_idle", idle)
    return busy


SLOT = HEADER_SIZE + align_up(CHUNK)


def capacity(slots: int) -> float:
    return (slots * SLOT + 1) / (1 << 30)


def test_prepared_files_hold_zeros_to_capacity_and_writes_then_never_fallocate(tier_config, monkeypatch):
    n = 24
    cfg = tier_config(ssd_capacity_gb=capacity(n), file_size_gb=capacity(10), grow_step_mb=1, prepare_slots=True)
    t = SSDTier(cfg, CHUNK)
    try:
        assert t.wait_prepared(30)
        sizes = sorted(os.path.getsize(t.io.files.path(i)) for i in range(3))
        assert sizes == [4 * t.slot_size, 10 * t.slot_size, 10 * t.slot_size]  # each file's share, not more
        for i in range(3):
            with open(t.io.files.path(i), "rb") as f:
                assert not any(f.read())  # zeros, every byte
        grown = []
        real = os.posix_fallocate
        monkeypatch.setattr(os, "posix_fallocate", lambda *a: grown.append(a) or real(*a))
        data = {f"k{i}": ssd_testing.payload(i, CHUNK) for i in range(n)}
        for k, v in data.items():
            assert put(t, k, v)
        assert grown == []  # every chunk went into a prepared slot
        for k, v in data.items():
            assert np.array_equal(get(t, k), v)
    finally:
        t.close()
    t = SSDTier(cfg, CHUNK)  # prepared once per directory: a restart finds the files whole and writes no zeros
    try:
        assert t.wait_prepared(30)
        assert t.io.files.allocated_slots() == n
        for k, v in data.items():
            assert np.array_equal(get(t, k), v)
    finally:
        t.close()


def test_without_prepare_slots_nothing_is_zeroed(tier_config):
    t = SSDTier(tier_config(ssd_capacity_gb=capacity(24), grow_step_mb=1), CHUNK)
    try:
        time.sleep(NOTHING_HAPPENS_S)  # a negative: no zeros within the window (there is no event to wait for)
        assert t.io.files.allocated_slots() == 0 and not t.wait_prepared(0.01)
    finally:
        t.close()


def test_writers_meeting_the_preparer_never_lose_a_chunk(tier_config, monkeypatch):
    """Stores arrive while zeros are being written into the slots they need: every committed chunk reads back
    bit-exact (now and after a restart), and the preparation still completes once the stores stop."""
    calls: list[int] = []
    slow_zero_writes(monkeypatch, 0.002, calls)
    n = 40
    cfg = tier_config(ssd_capacity_gb=capacity(n), file_size_gb=capacity(16), grow_step_mb=1, prepare_slots=True)
    t = SSDTier(cfg, CHUNK)
    data = {}
    try:
        rng = np.random.default_rng(7)
        for i in range(n):
            if i % 4 == 0:
                time.sleep(float(rng.uniform(0.03, 0.08)))  # idle long enough for the preparer to claim a step
            k = f"k{i}"
            data[k] = ssd_testing.payload(100 + i, CHUNK)
            assert put(t, k, data[k])
        assert calls, "the preparer never ran between the stores"
        assert t.stats.committed == n
        for k, v in data.items():
            assert np.array_equal(get(t, k), v), k
        assert t.wait_prepared(60)
    finally:
        t.close()
    t = SSDTier(cfg, CHUNK)
    try:
        for k, v in data.items():
            assert np.array_equal(get(t, k), v), k
    finally:
        t.close()


def test_a_store_waits_for_the_zero_request_on_its_way_into_its_slot(tier_config, monkeypatch):
    """The preparer is held inside its first zero request, over the very slot the next store takes; the store
    must wait for it (without the wait, its chunk is committed and then zeroed: lost)."""
    entered, go = threading.Event(), threading.Event()
    real = slot_files.pwrite_full

    def held(fd, buf, off):
        if not entered.is_set():
            entered.set()
            go.wait(10)
        real(fd, buf, off)

    monkeypatch.setattr(slot_files, "pwrite_full", held)
    cfg = tier_config(ssd_capacity_gb=capacity(20), grow_step_mb=1, prepare_slots=True)
    t = SSDTier(cfg, CHUNK)
    try:
        assert entered.wait(10)
        grow = t.io.files._grow  # the slot files' growth condition: a writer waits on it for a claimed range
        store_waits, real_wait = threading.Event(), grow.wait
        monkeypatch.setattr(grow, "wait", lambda timeout=None: (store_waits.set(), real_wait(timeout))[1])
        data = ssd_testing.payload(5, CHUNK)
        done = []
        store = threading.Thread(target=lambda: done.append(put(t, "k", data)))
        store.start()
        assert store_waits.wait(10), "the store's writer never waited for the zeros held over its slot"
        go.set()
        store.join(10)
        assert done == [True]
        assert np.array_equal(get(t, "k"), data)
        assert t.wait_prepared(30)
        assert np.array_equal(get(t, "k"), data)
    finally:
        go.set()
        t.close()


def test_preparer_yields_to_a_read_in_progress(tier_config, monkeypatch):
    calls: list[int] = []
    slow_zero_writes(monkeypatch, 0.001, calls)
    cfg = tier_config(ssd_capacity_gb=capacity(200), grow_step_mb=1, prepare_slots=False)
    t = SSDTier(cfg, CHUNK)
    assert put(t, "a", ssd_testing.payload(1, CHUNK))
    t.close()
    busy = count_busy_answers(monkeypatch)
    t = SSDTier(tier_config(ssd_capacity_gb=capacity(200), grow_step_mb=1, prepare_slots=True), CHUNK)
    try:
        holding, release = threading.Event(), threading.Event()
        got = []

        def alloc(key, m):
            holding.set()
            release.wait(10)  # the read stays in progress until released
            return memoryview(bytearray(m.nbytes)), key

        reader = threading.Thread(target=lambda: got.append(t.read_batch(["a"], alloc, lambda h: None)))
        before = wait_until(lambda: len(calls), 10, "the preparer's first zero write")  # the read meets a step
        reader.start()
        assert holding.wait(5)
        n0, since = len(calls), time.monotonic() + IDLE_S  # from `since` on, only the held read keeps the tier busy
        assert not t.prepared_event.is_set()  # the read began while zeros were still being written
        # the preparer was told twice (after `since`) to wait for the read: it has stopped its step by then
        wait_until(lambda: sum(at >= since for at in busy) >= 2, 10, "the preparer to wait for the held read")
        assert len(calls) - n0 <= 1  # at most the request already on its way when the read began
        release.set()
        reader.join(10)
        assert got == [["a"]]
        assert t.wait_prepared(60) and len(calls) > n0 >= before
    finally:
        release.set()
        t.close()


def test_full_disk_while_preparing_is_logged_once_and_the_tier_grows_as_without_it(tier_config, monkeypatch, caplog):
    calls: list[int] = []
    slow_zero_writes(monkeypatch, 0.0, calls, fail_after=20)
    cfg = tier_config(ssd_capacity_gb=capacity(20), grow_step_mb=1, prepare_slots=True)
    with caplog.at_level(logging.WARNING, logger="kvtier"):
        t = SSDTier(cfg, CHUNK)
        try:
            wait_until(lambda: len(calls) > 20, 10, "the injected ENOSPC (zero write 21)")
            assert t._preparer is not None
            t._preparer.join(10)  # it ends on the error
            assert not t._preparer.is_alive() and not t.wait_prepared(0)
            data = {f"k{i}": ssd_testing.payload(i, CHUNK) for i in range(20)}
            for k, v in data.items():
                assert put(t, k, v)
            for k, v in data.items():
                assert np.array_equal(get(t, k), v)
        finally:
            t.close()
    lines = [r for r in caplog.records if "preparing slot files" in r.getMessage()]
    assert len(lines) == 1 and "No space left" in lines[0].getMessage()


def test_close_stops_a_preparation_in_progress(tier_config, monkeypatch):
    calls: list[int] = []
    slow_zero_writes(monkeypatch, 0.005, calls)
    t = SSDTier(tier_config(ssd_capacity_gb=capacity(200), grow_step_mb=1, prepare_slots=True), CHUNK)
    wait_until(lambda: calls, 10, "the preparer's first zero write")
    t.close()
    done = len(calls)
    pieces = 200 * SLOT // slot_files.ZERO_PIECE
    # close() has joined the preparer, the only caller of the zero writes: none can follow
    assert not t._preparer.is_alive() and 0 < done < pieces // 2


def test_unallocated_agrees_with_is_allocated_slot_by_slot(tmp_path):
    """The restart's one-shot check of many slots (numpy) against the per-slot rule, on random extents."""
    rng = np.random.default_rng(3)
    files = slot_files.SlotFiles(str(tmp_path), 8192, slots_per_file=7, grow_step_slots=1, o_direct=False)
    try:
        for trial in range(200):
            files._extent = {i: int(rng.integers(0, 8)) for i in range(int(rng.integers(0, 4)))}
            slots = [int(s) for s in rng.integers(-1 if trial % 50 == 0 else 0, 30, size=int(rng.integers(0, 6)))]
            want = {s for s in slots if s < 0 or not files.is_allocated(s)}
            assert files.unallocated(slots) == want, (files._extent, slots)
    finally:
        files.close()


def test_the_restart_leaves_the_garbage_collector_as_it_found_it(tier_config):
    import gc

    cfg = tier_config()
    SSDTier(cfg, CHUNK).close()
    assert gc.isenabled()
    SSDTier(cfg, CHUNK).close()
    assert gc.isenabled()
    gc.disable()
    try:
        SSDTier(cfg, CHUNK).close()
        assert not gc.isenabled()
    finally:
        gc.enable()
