"""Helpers for tests and benchmarks of the SSD tier: deterministic payloads, blocking put/get, capacity checks,
the journal's record framing (to find, damage or craft records), and fault hooks (a held writer, failing journal
writes)."""

from __future__ import annotations

import errno
import os
import struct
import threading
import zlib

import msgspec
import numpy as np

from kvtier.storage_backends.ssd.index import ChunkMeta


def payload(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def meta(n: int, fmt: str = "KV_2LTD") -> ChunkMeta:
    return ChunkMeta(n, (n,), "torch.uint8", fmt)


def put(tier, key: str, data, fmt: str = "KV_2LTD") -> bool:
    """Store `data` under `key` and wait: True only if the chunk was committed."""
    done: list[bool] = []
    ok = tier.submit_put(key, meta(len(data), fmt), memoryview(data), done.append)
    assert tier.flush(30)
    return ok and done == [True]


def get(tier, key: str):
    """The chunk's bytes (a numpy array), or None for a miss."""
    bufs = {}

    def alloc(k, m):
        bufs[k] = np.zeros(m.nbytes, dtype=np.uint8)
        return memoryview(bufs[k]), k

    res = tier.read_batch([key], alloc, lambda h: None)[0]
    return None if res is None else bufs[key]


def fill_fresh(tier, prefix: str, n: int) -> int:
    """Store `n` new chunks and return how many committed: proves the tier's full capacity is usable."""
    return sum(put(tier, f"{prefix}{i}", payload(10_000 + i, tier.chunk_bytes)) for i in range(n))


def frame(obj) -> bytes:
    """A CRC-valid journal record around any msgpack value (bypassing the record types' own checks)."""
    p = msgspec.msgpack.encode(obj)
    return struct.pack("<II", len(p), zlib.crc32(p)) + p


def record_spans(data: bytes) -> list[tuple[int, int]]:
    """The `[start, end)` byte ranges of the framed records of an undamaged journal."""
    out, pos = [], 0
    while pos + 8 <= len(data):
        n, _ = struct.unpack_from("<II", data, pos)
        out.append((pos, pos + 8 + n))
        pos += 8 + n
    return out


def hold_writer(monkeypatch, tier) -> threading.Event:
    """Make the writers wait (after taking their next batch) until the returned event is set."""
    gate = threading.Event()
    real = tier._write_batch
    monkeypatch.setattr(tier, "_write_batch", lambda batch: (gate.wait(20), real(batch))[1])
    return gate


def fail_journal_writes(monkeypatch, tier, err: int = errno.ENOSPC) -> dict:
    """`err` from every write to the tier's journal while the returned `state["on"]` is true."""
    real = os.write
    state = {"on": True}

    def write(fd, data):
        if state["on"] and fd == tier.io.journal._fd:
            raise OSError(err, os.strerror(err))
        return real(fd, data)

    monkeypatch.setattr(os, "write", write)
    return state


def flip_a_byte_in_every_slot(ssd) -> int:
    """Flip one data byte in every committed slot the SSD tier holds (header intact: only the CRC can tell)."""
    from pathlib import Path

    n = 0
    for f in Path(ssd).rglob("slots-*.dat"):
        slot = int(f.name.split("-")[1].rstrip("k")) * 1024
        with open(f, "r+b") as fh:
            for base in range(0, f.stat().st_size - slot + 1, slot):
                fh.seek(base)
                if fh.read(8) != b"KVTSLOT1":
                    continue
                fh.seek(base + 4096 + 1000)
                b = fh.read(1)
                fh.seek(base + 4096 + 1000)
                fh.write(bytes([b[0] ^ 0x40]))
                n += 1
    return n
