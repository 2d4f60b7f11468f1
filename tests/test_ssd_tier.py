"""The SSD tier core on a real file system: round trips, restart, corruption, capacity, concurrency, faults."""

from __future__ import annotations

import errno
import os
import random
import threading
import time

import numpy as np
import pytest

pytestmark = pytest.mark.compat

from kvtier.storage_backends.base import ChunkTier
from kvtier.storage_backends.config import ConfigError
from kvtier.storage_backends.ssd.tier import ChunkMeta, DirectoryInUse, SSDTier
from kvtier.testing import ssd as ssd_testing

CHUNK = 3 * 4096 + 100  # deliberately not a multiple of the 4 KiB block


def payload(seed: int, n: int = CHUNK) -> np.ndarray:
    return ssd_testing.payload(seed, n)


def meta(n: int = CHUNK, fmt: str = "KV_2LTD") -> ChunkMeta:
    return ssd_testing.meta(n, fmt)


put, get = ssd_testing.put, ssd_testing.get


@pytest.fixture
def tier(tier_config):
    t = SSDTier(tier_config(io_block_mb=1), CHUNK)
    yield t
    t.close()


@pytest.mark.parametrize("o_direct", [True, False])
@pytest.mark.parametrize("n", [1, 4096, CHUNK, (1 << 20) * 2 + 17])
def test_round_trip_bit_exact(tier_config, o_direct, n):
    t = SSDTier(tier_config(o_direct=o_direct, io_block_mb=1), max(n, CHUNK))
    try:
        data = payload(n)
        assert put(t, "k", data)
        assert np.array_equal(get(t, "k"), data)
        assert t.stats.hits == 1 and t.stats.committed == 1
    finally:
        t.close()


def test_slot_files_grow_in_steps_not_to_capacity(tier_config):
    cfg = tier_config(ssd_capacity_gb=1.0, grow_step_mb=1)
    t = SSDTier(cfg, CHUNK)
    try:
        assert put(t, "a", payload(1))
        files = [f for f in os.listdir(t.directory) if f.endswith(".dat")]
        size = sum(os.path.getsize(os.path.join(t.directory, f)) for f in files)
        assert len(files) == 1 and 0 < size <= (1 << 20) + t.slot_size  # one step, not 1 GiB
        assert os.stat(cfg.ssd_path).st_mode & 0o777 == 0o700
    finally:
        t.close()


def test_restart_finds_committed_chunks(tier_config):
    cfg = tier_config()
    t = SSDTier(cfg, CHUNK)
    for i in range(5):
        assert put(t, f"k{i}", payload(i))
    t.remove("k2")
    t.close()
    t2 = SSDTier(cfg, CHUNK)
    try:
        assert sorted(t2.keys()) == ["k0", "k1", "k3", "k4"]
        for i in (0, 1, 3, 4):
            assert np.array_equal(get(t2, f"k{i}"), payload(i))
        assert get(t2, "k2") is None
    finally:
        t2.close()


def test_second_process_on_same_directory_is_refused(tier, tier_config):
    with pytest.raises(DirectoryInUse, match="in use"):
        SSDTier(tier_config(io_block_mb=1), CHUNK)


def _slot_data_offset(tier: SSDTier, key: str) -> tuple[str, int]:
    e = tier.entry(key)
    path, base = tier.io.files.locate_path(e.slot)
    return path, base


def test_flipped_byte_is_a_miss_and_frees_the_slot(tier):
    assert put(tier, "k", payload(7))
    path, base = _slot_data_offset(tier, "k")
    with open(path, "r+b") as f:
        f.seek(base + 4096 + 5000)
        b = f.read(1)
        f.seek(base + 4096 + 5000)
        f.write(bytes([b[0] ^ 0x01]))
    assert get(tier, "k") is None
    assert tier.stats.corrupt == 1 and not tier.contains("k") and len(tier) == 0
    assert put(tier, "k", payload(8)) and np.array_equal(get(tier, "k"), payload(8))


def test_slots_written_with_zlib_crc_still_verify(tier_config, monkeypatch):
    """The data checksum is ISA-L's CRC-32, the same value as zlib's: caches written before the switch (or by
    a build using zlib) read back bit-exact, and a different CRC would be caught here as a miss."""
    import zlib

    from kvtier.storage_backends.ssd import slot_io as ssd_io
    from kvtier.storage_backends.ssd.slot_format import checksum

    for n in (1, 4095, 4096, CHUNK, 1 << 20):
        buf = memoryview(payload(n))
        assert checksum(buf) == zlib.crc32(buf) and checksum(buf[3:]) == zlib.crc32(buf[3:])
    cfg = tier_config(io_block_mb=1)
    with monkeypatch.context() as m:
        m.setattr(ssd_io, "checksum", zlib.crc32)
        t = SSDTier(cfg, CHUNK)
        assert put(t, "old", payload(11))
        t.close()
    t = SSDTier(cfg, CHUNK)
    try:
        assert np.array_equal(get(t, "old"), payload(11)) and t.stats.corrupt == 0
    finally:
        t.close()


def test_truncated_slot_is_a_miss(tier):
    assert put(tier, "k", payload(3))
    path, base = _slot_data_offset(tier, "k")
    os.truncate(path, base + 4096 + 100)
    assert get(tier, "k") is None
    assert tier.stats.corrupt == 1


def test_slot_holding_another_key_is_a_miss(tier):
    assert put(tier, "a", payload(1)) and put(tier, "b", payload(2))
    ea, eb = tier.entry("a"), tier.entry("b")
    ea.slot, eb.slot = eb.slot, ea.slot  # index points each key at the other's slot
    assert get(tier, "a") is None and get(tier, "b") is None
    assert tier.stats.corrupt == 2


def test_layout_mismatch_is_a_miss(tier_config):
    t = SSDTier(tier_config(), CHUNK, layout_ok=lambda m: m.fmt == "KV_2LTD")
    try:
        assert put(t, "page_first", payload(1), fmt="KV_T2D")
        assert put(t, "ok", payload(2))
        assert not t.contains("page_first") and t.stats.layout_mismatch == 1
        assert get(t, "page_first") is None and np.array_equal(get(t, "ok"), payload(2))
    finally:
        t.close()


def test_lru_capacity_eviction_and_pins(tier_config):
    from kvtier.storage_backends.ssd.slot_format import HEADER_SIZE

    slot = HEADER_SIZE + 4 * 4096
    t = SSDTier(tier_config(ssd_capacity_gb=3 * slot / (1 << 30)), CHUNK)
    try:
        assert t.max_slots == 3
        for k in "abc":
            assert put(t, k, payload(ord(k)))
        assert get(t, "a") is not None  # a is now most recent: LRU order b, c, a
        assert t.pin("b")
        assert put(t, "d", payload(4))  # evicts c (b is pinned)
        assert sorted(t.keys()) == ["a", "b", "d"] and t.stats.evictions == 1
        t.unpin("b")
        assert put(t, "e", payload(5))  # evicts b now
        assert sorted(t.keys()) == ["a", "d", "e"] and t.used_bytes() <= 3 * slot
    finally:
        t.close()


def test_capacity_smaller_than_one_chunk(tier_config):
    with pytest.raises(ConfigError, match="smaller than one chunk"):
        SSDTier(tier_config(ssd_capacity_gb=1e-6), CHUNK)


def test_expired_pin_does_not_block_eviction(tier_config):
    from kvtier.storage_backends.ssd.slot_format import HEADER_SIZE

    t = SSDTier(tier_config(ssd_capacity_gb=(HEADER_SIZE + 4 * 4096) / (1 << 30), pin_timeout_s=0.0), CHUNK)
    try:
        assert put(t, "a", payload(1)) and t.pin("a")
        assert put(t, "b", payload(2)) and t.keys() == ["b"] and t.stats.pins_expired == 1
    finally:
        t.close()


def test_concurrent_puts_and_gets(tier_config):
    t = SSDTier(tier_config(ssd_capacity_gb=0.05, io_threads=4), CHUNK)
    errors = []

    def worker(wid: int):
        rng = random.Random(wid)
        for _i in range(30):
            key = f"w{wid}-{rng.randrange(8)}"
            if rng.random() < 0.5:
                t.submit_put(key, meta(), memoryview(payload(hash(key) % 1000)), lambda ok: None)
            else:
                got = get(t, key)
                if got is not None and not np.array_equal(got, payload(hash(key) % 1000)):
                    errors.append(key)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(6)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert t.flush(30)
    assert errors == []
    for key in t.keys():
        assert np.array_equal(get(t, key), payload(hash(key) % 1000))
    t.close()


def test_backpressure_drops_are_counted_not_silent(tier_config, monkeypatch):
    t = SSDTier(tier_config(max_inflight_write_mb=1, backpressure_timeout_s=0.2), 1 << 20)
    gate = threading.Event()
    real = t._write_batch
    monkeypatch.setattr(t, "_write_batch", lambda batch: (gate.wait(10), real(batch))[1])
    data = payload(1, 1 << 20)
    assert t.submit_put("a", meta(1 << 20), memoryview(data), lambda ok: None)
    assert not t.submit_put("b", meta(1 << 20), memoryview(data), lambda ok: None)  # waits 0.2 s, then drops
    assert t.stats.dropped_backpressure == 1
    gate.set()
    assert t.flush(10) and t.keys() == ["a"]
    t.close()


def test_disk_full_keeps_serving_and_evicts_within_allocated_space(tier_config, monkeypatch, caplog):
    cfg = tier_config(ssd_capacity_gb=0.01, grow_step_mb=1)
    t = SSDTier(cfg, CHUNK)
    try:
        step = t.io.files.grow_step_slots
        real = os.posix_fallocate
        calls = []

        def fallocate(fd, off, n):
            calls.append(off)
            if len(calls) > 1:
                raise OSError(errno.ENOSPC, "No space left on device")
            return real(fd, off, n)

        monkeypatch.setattr(os, "posix_fallocate", fallocate)
        for i in range(step + 3):
            assert put(t, f"k{i}", payload(i))
        assert len(t) == step and t.max_slots == step
        assert t.stats.evictions == 3
        assert np.array_equal(get(t, f"k{step + 2}"), payload(step + 2))
        assert sum("disk full" in r.message for r in caplog.records) == 1
    finally:
        t.close()


def test_unwritable_or_bad_paths(tier_config, tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(ConfigError, match="not a directory|cannot create"):
        SSDTier(tier_config(ssd_path=str(f)), CHUNK)
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o500)
    if os.geteuid() == 0:
        # root ignores permission bits; a path under a regular file can never be created
        with pytest.raises(ConfigError, match="cannot create"):
            SSDTier(tier_config(ssd_path=str(f / "sub")), CHUNK)
    else:
        with pytest.raises(ConfigError, match="not writable"):
            SSDTier(tier_config(ssd_path=str(ro)), CHUNK)


def test_o_direct_refused_by_file_system_is_a_clear_error(tier_config, monkeypatch):
    import kvtier.storage_backends.ssd.tier as mod

    def refuse(directory):
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(mod, "probe_o_direct", refuse)
    with pytest.raises(ConfigError, match="refuses O_DIRECT.*o_direct: false"):
        SSDTier(tier_config(), CHUNK)
    t = SSDTier(tier_config(o_direct=False), CHUNK)  # the lock of the failed attempt was released
    assert put(t, "k", payload(1)) and np.array_equal(get(t, "k"), payload(1))
    t.close()


def test_journal_torn_tail_is_cut(tier_config):
    cfg = tier_config()
    t = SSDTier(cfg, CHUNK)
    for i in range(3):
        assert put(t, f"k{i}", payload(i))
    t.close()
    jpath = t.io.journal.path
    with open(jpath, "ab") as f:
        f.write(b"\x40\x00\x00\x00garbage")
    t2 = SSDTier(cfg, CHUNK)
    try:
        assert sorted(t2.keys()) == ["k0", "k1", "k2"]
    finally:
        t2.close()


def test_restart_drops_chunks_whose_slots_a_cut_file_no_longer_holds(tier_config):
    """A slot file cut short between runs (3 of 8 slots left): the restart indexes exactly the chunks whose slots
    still exist, never the others (they would be lookups that hit and reads that miss), and the cut slots are
    written again afterwards."""
    cfg = tier_config(ssd_capacity_gb=0.01, grow_step_mb=1)
    t = SSDTier(cfg, CHUNK)
    data = {f"k{i}": payload(i) for i in range(8)}
    for k, v in data.items():
        assert put(t, k, v)
    slots = {k: t.entry(k).slot for k in data}
    path = t.io.files.path(0)
    t.close()
    os.truncate(path, 3 * t.slot_size)
    t = SSDTier(cfg, CHUNK)
    try:
        kept = {k for k, s in slots.items() if s < 3}
        assert len(kept) == 3 and set(t.keys()) == kept
        for k in data:
            assert t.contains(k) == (k in kept)
        for k in kept:
            assert np.array_equal(get(t, k), data[k])
        for i in range(8, 13):
            assert put(t, f"k{i}", payload(i))
            assert np.array_equal(get(t, f"k{i}"), payload(i))
    finally:
        t.close()


def test_rebuild_of_many_slots(tier_config):
    """20k committed records rebuild into exactly 20k chunks (benchmarks/ssd_tier.py times 100k)."""
    from kvtier.storage_backends.ssd.journal import Journal
    from kvtier.storage_backends.ssd.slot_format import CommitRecord

    cfg = tier_config(ssd_capacity_gb=20_000 * (4096 * 2) / (1 << 30) + 0.001, o_direct=False)
    t = SSDTier(cfg, 4096)
    t.io.files.ensure(19_999, limit=20_000)  # the tier passes its capacity; without it a 1 GiB grow step
    jp = t.io.journal.path
    t.close()
    j = Journal(jp)
    j.append([CommitRecord(i, i + 1, f"key{i}", 10, (10,), "torch.uint8", "KV_2LTD", 1 << 20) for i in range(20_000)],
             sync=True)
    j.close()
    t2 = SSDTier(cfg, 4096)
    try:
        assert len(t2) == 20_000 and t2.entry("key19999").slot == 19_999
        t2.index.check_invariants()
    finally:
        t2.close()


def test_bad_destination_is_a_miss_and_leaves_the_chunk_readable(tier):
    assert put(tier, "k", payload(5))
    released = []
    res = tier.read_batch(["k"], lambda k, m: (memoryview(bytearray(10)), "small"), released.append)
    assert res == [None] and released == ["small"]
    assert np.array_equal(get(tier, "k"), payload(5))  # not dropped, not stuck with a reader
    assert tier.remove("k") and len(tier) == 0


def test_files_never_grow_past_the_capacity(tier_config):
    from kvtier.storage_backends.ssd.slot_format import HEADER_SIZE

    slot = HEADER_SIZE + 4 * 4096
    t = SSDTier(tier_config(ssd_capacity_gb=5 * slot / (1 << 30), grow_step_mb=1024), CHUNK)
    try:
        for i in range(7):
            assert put(t, f"k{i}", payload(i))
        size = sum(os.path.getsize(os.path.join(t.directory, f)) for f in os.listdir(t.directory)
                   if f.endswith(".dat"))
        assert size == 5 * slot and len(t) == 5  # a 1 GiB grow step is capped at the 5-slot capacity
    finally:
        t.close()


def test_read_piece_is_the_configured_size_capped_at_the_block(tier_config):
    """`read_piece_mb` sets the read request size, at most one block (`io_block_mb`); 8 MiB by default; small
    pieces of large blocks queue for at most 64 read threads."""
    sizes = {}
    for over in ({}, {"read_piece_mb": 2}, {"read_piece_mb": 64}):
        t = SSDTier(tier_config(io_block_mb=16, **over), CHUNK)
        try:
            sizes[over.get("read_piece_mb")] = t.io.read_piece
        finally:
            t.close()
    assert sizes == {None: 8 << 20, 2: 2 << 20, 64: 16 << 20}
    t = SSDTier(tier_config(io_block_mb=256, read_piece_mb=1), CHUNK)  # 1,024 pieces in flight would be threads
    try:
        assert t.io._rd._max_workers == 64
    finally:
        t.close()


@pytest.mark.parametrize("pieces_per_chunk, in_flight", [(1, 4), (2, 8)])
def test_read_requests_in_flight(tier_config, monkeypatch, pieces_per_chunk, in_flight):
    """A batch's pieces are requested all at once, up to `io_threads` whole segments' pieces, twice that where a
    chunk is two or more full pieces (docs/results/2026-12-06-read-requests-in-flight.md): 2 I/O threads, 2 MiB
    segments of 1 MiB pieces, 8 chunks of 1 or 2 pieces each; every chunk still comes back bit-exact."""
    import kvtier.storage_backends.ssd.slot_io as slot_io

    P = 1 << 20
    n = pieces_per_chunk * P
    t = SSDTier(tier_config(o_direct=False, io_threads=2, io_block_mb=2, read_piece_mb=1, ssd_capacity_gb=0.05), n)
    try:
        data = {f"k{i}": payload(60 + i, n) for i in range(8)}
        for key, d in data.items():
            assert put(t, key, d)
        now = peak = 0
        lock = threading.Lock()

        def spied(read):
            def spy(*args):
                nonlocal now, peak
                with lock:
                    now += 1
                    peak = max(peak, now)
                time.sleep(0.2)  # long enough for every request the pool lets through to arrive
                try:
                    return read(*args)
                finally:
                    with lock:
                        now -= 1
            return spy

        monkeypatch.setattr(slot_io, "pread_full", spied(slot_io.pread_full))
        monkeypatch.setattr(slot_io, "preadv_full", spied(slot_io.preadv_full))
        bufs = {}

        def alloc(k, m):
            bufs[k] = np.zeros(m.nbytes, dtype=np.uint8)
            return memoryview(bufs[k]), k

        assert t.read_batch(list(data), alloc, lambda h: None) == list(data)
        assert peak == in_flight
        assert all(np.array_equal(bufs[k], d) for k, d in data.items())
    finally:
        t.close()


@pytest.mark.parametrize("o_direct", [True, False])
def test_segments_read_in_pieces_verify_every_piece(tier_config, o_direct):
    """Reads cut each segment into pieces (`read_piece_mb`) checked separately and combined into the segment's CRC:
    the chunk comes back bit-exact (also into an unaligned destination), and a byte flipped in any piece (the last,
    shorter piece of the last segment included) is a checksum miss, never data."""
    P = 1 << 20
    n = (4 * P) * 2 + P + (300 << 10) + 17  # 3 segments of 4 MiB; the last: a full piece, then 300 KiB + 17 bytes
    t = SSDTier(tier_config(o_direct=o_direct, io_block_mb=4, read_piece_mb=1, ssd_capacity_gb=0.1), n)
    try:
        assert t.io.read_piece == P
        for i, flip in enumerate([None, 1, P * 3 + 5, 4 * P + P + 9, n - 1]):
            key, data = f"k{i}", payload(40 + i, n)
            assert put(t, key, data)
            if flip is None:
                bufs = {}

                def alloc(k, m):  # a destination one byte off the page: through the bounce buffers
                    bufs[k] = np.zeros(m.nbytes + 1, dtype=np.uint8)
                    return memoryview(bufs[k])[1:], k

                assert t.read_batch([key], alloc, lambda h: None) == [key]
                assert np.array_equal(bufs[key][1:], data)
                assert np.array_equal(get(t, key), data)
                continue
            path, base = _slot_data_offset(t, key)
            with open(path, "r+b") as f:
                f.seek(base + 4096 + flip)
                b = f.read(1)
                f.seek(base + 4096 + flip)
                f.write(bytes([b[0] ^ 0x40]))
            assert get(t, key) is None, f"flip at {flip} not caught"
            assert not t.contains(key)
        assert t.stats.corrupt == 4 and t.stats.hits == 2
    finally:
        t.close()


def _as_chunk_tier(t: ChunkTier) -> ChunkTier:
    """Where the adapters take a tier: a type checker checks that an `SSDTier` is accepted here."""
    return t


def test_ssd_tier_is_the_chunk_tier_the_adapters_use(tier):
    """`SSDTier` fulfils `base.ChunkTier`: every member the contract names is there, each method with the same
    parameters (names, kinds, defaults), each property a value on a started tier."""
    import inspect

    from typing_extensions import get_protocol_members

    members = get_protocol_members(ChunkTier)
    assert {"read_batch", "submit_puts", "stats", "close", "__len__"} <= members
    assert isinstance(_as_chunk_tier(tier), ChunkTier)
    assert members <= set(dir(tier))
    for name in sorted(members):
        contract = inspect.getattr_static(ChunkTier, name)
        if isinstance(contract, property):
            assert not callable(inspect.getattr_static(tier, name)), name  # a value, not a method
            continue

        def params(fn):
            return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]

        assert params(contract) == params(inspect.getattr_static(SSDTier, name)), name

