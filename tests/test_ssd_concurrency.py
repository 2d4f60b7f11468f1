"""Concurrency: threads mixing put/get/contains/pin/unpin/remove on shared and private keys under back-pressure
and eviction. Nothing read is ever wrong, and afterwards the tier still holds its full capacity of fresh chunks
(no slot, pin or reader leaked)."""

from __future__ import annotations

import random
import threading
import time
import zlib

import numpy as np
import pytest

from kvtier.storage_backends.ssd.slot_format import HEADER_SIZE
from kvtier.storage_backends.ssd.tier import SSDTier

pytestmark = pytest.mark.compat

CHUNK = 300 * 1024 + 100
SLOTS = 12


def content(key: str, ssd) -> np.ndarray:
    return ssd.payload(zlib.crc32(key.encode()), CHUNK)


def test_mixed_operations_leave_full_capacity_usable(tier_config, ssd, monkeypatch):
    slot = HEADER_SIZE + -(-CHUNK // 4096) * 4096
    t = SSDTier(tier_config(ssd_capacity_gb=(SLOTS * slot + 1) / (1 << 30), max_inflight_write_mb=1,
                            backpressure_timeout_s=0.05, io_block_mb=1, io_threads=3), CHUNK)
    real_write = t.io.write
    monkeypatch.setattr(t.io, "write", lambda items: (time.sleep(0.005), real_write(items))[1])  # a slow disk
    errors: list[str] = []
    counts = {"put": 0, "get": 0, "hit": 0, "remove": 0, "pin": 0}
    lock = threading.Lock()

    def worker(wid: int) -> None:
        rng = random.Random(wid)
        for _ in range(150):
            key = f"shared{rng.randrange(10)}" if rng.random() < 0.6 else f"own{wid}-{rng.randrange(8)}"
            op = rng.random()
            try:
                if op < 0.4:
                    t.submit_put(key, ssd.meta(CHUNK), memoryview(content(key, ssd)), lambda ok: None)
                    name = "put"
                elif op < 0.75:
                    got = ssd.get(t, key)
                    if got is not None and not np.array_equal(got, content(key, ssd)):
                        errors.append(f"wrong bytes for {key}")
                    name = "hit" if got is not None else "get"
                elif op < 0.85:
                    t.remove(key)
                    name = "remove"
                else:
                    if t.contains(key, pin=True):
                        got = ssd.get(t, key)  # pinned: not evictable, but a reader may still drop it if bad
                        if got is not None and not np.array_equal(got, content(key, ssd)):
                            errors.append(f"wrong bytes for pinned {key}")
                        t.unpin(key)
                    name = "pin"
                with lock:
                    counts[name] += 1
            except Exception as e:  # noqa: BLE001
                errors.append(f"{type(e).__name__}: {e}")

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(8)]
    try:
        for th in threads:
            th.start()
        for th in threads:
            th.join(120)
        assert not any(th.is_alive() for th in threads)
        assert t.flush(60)
        assert errors == []
        assert counts["hit"] > 0 and counts["remove"] > 0 and t.stats.evictions > 0  # the mix really happened
        assert t.stats.dropped_backpressure > 0 and t.stats.duplicate_puts > 0
        t.index.check_invariants()
        assert not any(t.is_pinned(k) for k in t.keys())
        for key in t.keys():
            assert np.array_equal(ssd.get(t, key), content(key, ssd))
        assert ssd.fill_fresh(t, "fresh", SLOTS) == SLOTS and len(t) == SLOTS == t.max_slots
        t.index.check_invariants()
    finally:
        t.close()
