"""Reliability II (issue 28): the SSD tier under the cases an outside tester found after the first round.

A journal record whose generation would exhaust the counter, a key that is not valid UTF-8, episode logging that
must start and clear every time, `remove()` of a chunk whose write is still queued, and a failed journal append that
must cost only the chunks being stored. Each test fails without its fix (checked by reverting it).
"""

from __future__ import annotations

import errno
import logging
import os
import random
import threading

import pytest

from kvtier.storage_backends.ssd import tier_writes
from kvtier.storage_backends.ssd.slot_format import MAX_GENERATION
from kvtier.storage_backends.ssd.tier import SSDTier
from kvtier.testing.ssd import fail_journal_writes, frame, hold_writer, record_spans
from kvtier.testing.waiting import wait_until

pytestmark = pytest.mark.compat

CHUNK = 2 * 4096 + 100
SLOT = 4096 + 3 * 4096


def capacity_gb(slots: int) -> float:
    return (slots * SLOT + 1) / (1 << 30)


def messages(caplog, text: str) -> int:
    return sum(text in r.getMessage() for r in caplog.records)


# ------------------------------------------------------------------------------ a generation near 2^62 on disk
@pytest.mark.parametrize("kind", ["commit", "free"])
def test_record_with_an_exhausting_generation_is_skipped_and_stores_go_on(tier_config, ssd, caplog, kind):
    cfg = tier_config(ssd_capacity_gb=capacity_gb(6), o_direct=False)
    t = SSDTier(cfg, CHUNK)
    data = {k: ssd.payload(i, CHUNK) for i, k in enumerate("ab")}
    for k, v in data.items():
        assert ssd.put(t, k, v)
    journal = t.io.journal.path
    t.close()
    huge = MAX_GENERATION - 2  # decodes (below MAX_GENERATION): CRC-valid and in the record's own range
    rec = (["C", 4, huge, "evil", CHUNK, [CHUNK], "torch.uint8", "KV_2LTD", 1 << 20, {}] if kind == "commit"
           else ["F", 5, huge])
    with open(journal, "ab") as f:
        f.write(frame(rec))
    for restart in range(2):  # the record must not keep the tier from storing, now or after another restart
        with caplog.at_level(logging.WARNING, logger="kvtier"):
            caplog.clear()
            t = SSDTier(cfg, CHUNK)
        try:
            assert "evil" not in t.keys()
            for k, v in data.items():
                assert (ssd.get(t, k) == v).all()
            assert ssd.fill_fresh(t, f"r{restart}-", 4) == 4, "stores failed after the crafted record"
            assert t.index._gen < MAX_GENERATION >> 1
            t.index.check_invariants()
            if restart == 0:
                assert messages(caplog, "1 record(s) out of range") == 1
                assert t.stats.journal_records_dropped == 1
        finally:
            t.close()


# ------------------------------------------------------------------------------ a key that is not valid UTF-8
def test_lone_surrogate_key_is_a_counted_drop_not_an_exception(tier_config, ssd, caplog):
    t = SSDTier(tier_config(ssd_capacity_gb=capacity_gb(4), o_direct=False), CHUNK)
    try:
        done: list[bool] = []
        bad, good = "chunk-\ud800", ssd.payload(7, CHUNK)
        with caplog.at_level(logging.WARNING, logger="kvtier"):
            assert t.submit_put(bad, ssd.meta(CHUNK), memoryview(ssd.payload(1, CHUNK)), done.append) is False
            verdicts = t.submit_puts([(bad + "x", ssd.meta(CHUNK), memoryview(good), done.append),
                                      ("fine", ssd.meta(CHUNK), memoryview(good), done.append)])
        assert verdicts == [False, True]
        assert t.flush(10) and done == [True]
        assert t.stats.dropped_invalid == 2 and t.stats.dropped_too_large == 0
        assert messages(caplog, "invalid key") == 1  # once per episode
        assert not t.contains(bad) and not t.remove(bad) and ssd.get(t, bad) is None
        assert (ssd.get(t, "fine") == good).all()
    finally:
        t.close()


# ------------------------------------------------------------------------------ episodes start and clear each time
def test_backpressure_episodes_are_logged_each_time(tier_config, ssd, monkeypatch, caplog):
    t = SSDTier(tier_config(ssd_capacity_gb=0.05, o_direct=False, max_inflight_write_mb=1,
                            backpressure_timeout_s=0.05), 1 << 20)
    big = ssd.payload(3, 1 << 20)
    try:
        with caplog.at_level(logging.INFO, logger="kvtier"):
            for episode in range(2):
                with pytest.MonkeyPatch.context() as held:
                    gate = hold_writer(held, t)
                    assert t.submit_put(f"fill{episode}", ssd.meta(1 << 20), memoryview(big), lambda ok: None)
                    assert not t.submit_put(f"late{episode}", ssd.meta(1 << 20), memoryview(big), lambda ok: None)
                    gate.set()
                    assert t.flush(20)
                assert ssd.put(t, f"after{episode}", big)  # queued without waiting: the episode is over
        assert t.stats.dropped_backpressure == 2
        assert messages(caplog, "cannot keep up") == 2
        assert messages(caplog, "keep up again") == 2
    finally:
        t.close()


def test_too_large_episodes_are_logged_each_time(tier_config, ssd, caplog):
    t = SSDTier(tier_config(ssd_capacity_gb=capacity_gb(8), o_direct=False), CHUNK)
    try:
        with caplog.at_level(logging.INFO, logger="kvtier"):
            for i in range(2):
                for j in range(3):  # three in a row: one message
                    assert not ssd.put(t, f"big{i}-{j}", ssd.payload(i, 4 * CHUNK))
                assert ssd.put(t, f"ok{i}", ssd.payload(i, CHUNK))
        assert t.stats.dropped_too_large == 6
        assert messages(caplog, "larger than a") == 2
        assert messages(caplog, "fit their slots again") == 2
    finally:
        t.close()


def test_drops_because_every_slot_is_pinned_are_logged_once_and_cleared(tier_config, ssd, caplog):
    t = SSDTier(tier_config(ssd_capacity_gb=capacity_gb(2), o_direct=False), CHUNK)
    try:
        for k in "ab":
            assert ssd.put(t, k, ssd.payload(ord(k), CHUNK)) and t.pin(k)
        with caplog.at_level(logging.INFO, logger="kvtier"):
            assert not ssd.put(t, "c", ssd.payload(3, CHUNK))
            assert not ssd.put(t, "d", ssd.payload(4, CHUNK))
            assert t.unpin("a")
            assert ssd.put(t, "e", ssd.payload(5, CHUNK))
        assert t.stats.dropped_no_space == 2
        assert messages(caplog, "every slot is pinned") == 1
        assert messages(caplog, "slots are free for new chunks again") == 1
        t.index.check_invariants()
    finally:
        t.close()


def test_compaction_failure_episode_clears(tier_config, ssd, monkeypatch, caplog):
    monkeypatch.setattr(tier_writes, "COMPACT_SLACK", 4)
    t = SSDTier(tier_config(ssd_capacity_gb=capacity_gb(2), o_direct=False), CHUNK)
    try:
        real = t.io.compact
        failing = {"on": True}

        def compact(live):
            if failing["on"]:
                raise OSError(errno.EIO, "Input/output error (injected)")
            return real(live)

        monkeypatch.setattr(t.io, "compact", compact)
        with caplog.at_level(logging.INFO, logger="kvtier"):
            for i in range(12):  # evictions: the journal outgrows 4 records per live chunk + 4
                assert ssd.put(t, f"k{i}", ssd.payload(i, CHUNK))
            failing["on"] = False
            assert ssd.put(t, "last", ssd.payload(99, CHUNK))
            # the writer compacts after the batch's completion: wait for it
            wait_until(lambda: messages(caplog, "compaction succeeds again") == 1, 10, "the clearing message")
        assert messages(caplog, "compaction failed") == 1
        assert t.io.records_written == len(t)  # the snapshot is in place
    finally:
        t.close()


# ------------------------------------------------------------------------------ remove() of a queued write
def test_remove_cancels_a_queued_write(tier_config, ssd, monkeypatch):
    cfg = tier_config(ssd_capacity_gb=capacity_gb(4), o_direct=False)
    t = SSDTier(cfg, CHUNK)
    try:
        gate = hold_writer(monkeypatch, t)
        done: list[bool] = []
        assert t.submit_put("k", ssd.meta(CHUNK), memoryview(ssd.payload(1, CHUNK)), done.append)
        assert t.exists_in_put_tasks("k")
        assert t.remove("k") is True
        assert not t.exists_in_put_tasks("k")
        again = ssd.payload(2, CHUNK)  # stored again after the remove: this copy, not the cancelled one
        assert t.submit_put("k2", ssd.meta(CHUNK), memoryview(again), done.append)
        assert t.submit_put("k3", ssd.meta(CHUNK), memoryview(again), done.append)
        assert t.remove("k3") and t.submit_put("k3", ssd.meta(CHUNK), memoryview(again), done.append)
        gate.set()
        assert t.flush(20)
        wait = t.queue._cond
        with wait:
            assert wait.wait_for(lambda: t.queue.inflight_bytes == 0, 20)
        assert sorted(done) == [False, False, True, True]
        assert not t.contains("k") and ssd.get(t, "k") is None
        assert (ssd.get(t, "k3") == again).all()
        assert t.stats.cancelled_puts == 2
        t.index.check_invariants()
    finally:
        t.close()
    t = SSDTier(cfg, CHUNK)
    try:
        assert sorted(t.keys()) == ["k2", "k3"]
    finally:
        t.close()


def test_remove_racing_the_writer_never_leaves_a_removed_chunk(tier_config, ssd):
    """Removes land before, during and after the writer commits: once remove() returned, the key is gone."""
    t = SSDTier(tier_config(ssd_capacity_gb=capacity_gb(64), o_direct=False), CHUNK)
    rng = random.Random(28)
    data = ssd.payload(5, CHUNK)
    try:
        for i in range(300):
            assert t.submit_put(f"k{i}", ssd.meta(CHUNK), memoryview(data), lambda ok: None)
            if rng.random() < 0.5:
                threading.Event().wait(rng.random() * 0.002)
            t.remove(f"k{i}")
        assert t.flush(30)
        assert t.keys() == []
        t.index.check_invariants()
        assert ssd.fill_fresh(t, "f", 64) == 64
    finally:
        t.close()


# ------------------------------------------------------------------------- a failed append costs no committed chunk
def test_failed_journal_append_costs_no_committed_chunk(tier_config, ssd, monkeypatch):
    cfg = tier_config(ssd_capacity_gb=capacity_gb(4), o_direct=False)
    t = SSDTier(cfg, CHUNK)
    data = {f"k{i}": ssd.payload(i, CHUNK) for i in range(4)}
    told: list[tuple[str, str]] = []
    try:
        for k, v in data.items():
            assert ssd.put(t, k, v)
        t.add_drop_listener(lambda key, n, why: told.append((key, why)))
        state = fail_journal_writes(monkeypatch, t)
        new = [ssd.payload(10 + i, CHUNK) for i in range(3)]
        done: list[bool] = []
        assert all(t.submit_puts([(f"n{i}", ssd.meta(CHUNK), memoryview(v), done.append)
                                  for i, v in enumerate(new)]))
        assert t.flush(20) and done == [False] * 3
        assert sorted(t.keys()) == sorted(data) and t.stats.evictions == 0 and told == []
        for k, v in data.items():
            assert (ssd.get(t, k) == v).all()
        t.index.check_invariants()
        state["on"] = False
        assert ssd.put(t, "n0", new[0])  # the journal works again: exactly one chunk is evicted for it
        assert t.stats.evictions == 1 and len(told) == 1 and told[0][1] == "evicted"
        survivors = sorted(set(data) - {told[0][0]})
    finally:
        t.close()
    t = SSDTier(cfg, CHUNK)
    try:
        assert sorted(t.keys()) == sorted([*survivors, "n0"])
        assert (ssd.get(t, "n0") == new[0]).all()
        for k in survivors:
            assert (ssd.get(t, k) == data[k]).all()
    finally:
        t.close()


def test_journal_keeps_whole_records_after_failed_free_appends(tier_config, ssd, monkeypatch):
    """The FREE records journaled ahead of an overwrite are framed records like any other (a restart decodes
    the journal without a damaged range)."""
    cfg = tier_config(ssd_capacity_gb=capacity_gb(2), o_direct=False)
    t = SSDTier(cfg, CHUNK)
    try:
        for i in range(6):
            assert ssd.put(t, f"k{i}", ssd.payload(i, CHUNK))
        journal = t.io.journal.path
    finally:
        t.close()
    raw = open(journal, "rb").read()
    assert record_spans(raw)[-1][1] == len(raw)
    t = SSDTier(cfg, CHUNK)
    try:
        assert sorted(t.keys()) == ["k4", "k5"] and t.stats.journal_damaged_records == 0
    finally:
        t.close()


def test_an_append_cut_short_by_a_full_disk_leaves_whole_records(tier_config, ssd, monkeypatch, caplog):
    """ENOSPC half-way through an append: the journal is cut back to where it began, so the next start finds no
    damaged range (before, the partial record was reported as damage at every restart until compaction)."""
    cfg = tier_config(ssd_capacity_gb=capacity_gb(8), o_direct=False)
    t = SSDTier(cfg, CHUNK)
    real = os.write
    state = {"on": True}

    def half_write(fd, data):
        if state["on"] and fd == t.io.journal._fd:
            if state["on"] == "short":
                raise OSError(errno.ENOSPC, "No space left on device (injected)")
            state["on"] = "short"
            return real(fd, bytes(data[:len(data) // 2]))  # a short write, then ENOSPC
        return real(fd, data)

    try:
        assert ssd.put(t, "a", ssd.payload(1, CHUNK))
        monkeypatch.setattr(os, "write", half_write)
        assert not ssd.put(t, "torn", ssd.payload(2, CHUNK))
        state["on"] = False
        assert ssd.put(t, "b", ssd.payload(3, CHUNK))
    finally:
        t.close()
    raw = open(t.io.journal.path, "rb").read()
    assert record_spans(raw)[-1][1] == len(raw)
    with caplog.at_level(logging.WARNING, logger="kvtier"):
        t = SSDTier(cfg, CHUNK)
    try:
        assert sorted(t.keys()) == ["a", "b"] and t.stats.journal_damaged_records == 0
        assert messages(caplog, "damaged byte range") == 0
    finally:
        t.close()


def test_an_episode_ends_only_after_it_settled(monkeypatch, caplog):
    """A nearly full disk lets an operation through now and then: one outage must log one start and one clear,
    not one pair per lucky success (the soak's ENOSPC minute logged the journal episode twice before this)."""
    from kvtier.storage_backends.ssd import episodes

    monkeypatch.setattr(episodes, "SETTLE_S", 5.0)
    now = [100.0]
    log = episodes.EpisodeLog(logging.getLogger("kvtier.test.episodes"), clock=lambda: now[0])
    with caplog.at_level(logging.INFO, logger="kvtier"):
        for t in (100.0, 101.0, 103.0, 104.0):  # failures with successes between them, within the outage
            now[0] = t
            log.occurred("journal", logging.ERROR, "append failed")
            now[0] = t + 0.5
            log.cleared("journal", "appends succeed again")
        assert log.active("journal")
        now[0] = 108.9
        log.cleared("journal", "appends succeed again")  # 4.9 s after the last failure: not yet
        now[0] = 109.0
        log.cleared("journal", "appends succeed again")
        log.cleared("journal", "appends succeed again")
        now[0] = 200.0
        log.occurred("journal", logging.ERROR, "append failed")  # a new outage: a new episode
    assert messages(caplog, "append failed") == 2
    assert messages(caplog, "succeed again (4 occurrences)") == 1
    assert messages(caplog, "succeed again") == 1
