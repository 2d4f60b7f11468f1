"""Seeded corruption fuzzing of the SSD tier's files: a few hundred mutations of one committed directory.

Each mutation (bit flips in data, headers and the journal, zeroed pages, truncations, duplicated, moved and crafted
journal records) is applied to a fresh copy of the same directory; then a tier is started on it and every chunk is
read. Counted over all mutations and required to be zero: wrong bytes returned, exceptions escaping the tier,
untouched chunks lost (a chunk may only be lost when the mutation hit its slot, or the journal record that names it
or its slot). Every 25th mutation also fills the tier to capacity with fresh chunks (nothing leaked).
"""

from __future__ import annotations

import os
import random
import shutil

import msgspec
import numpy as np

from kvtier.storage_backends.config import parse_kvtier_config
from kvtier.storage_backends.ssd.slot_format import HEADER_SIZE
from kvtier.storage_backends.ssd.tier import SSDTier
from kvtier.testing.ssd import frame, record_spans

CHUNK = 3 * 4096 + 77
SLOTS = 40
MUTATIONS = 300


def _cfg(path):
    slot = HEADER_SIZE + -(-CHUNK // 4096) * 4096
    return parse_kvtier_config({"kvtier.ssd_path": path, "kvtier.ssd_capacity_gb": (SLOTS * slot + 1) / (1 << 30),
                                "kvtier.io_block_mb": 1, "kvtier.durable_writes": False})


def _decode(data: bytes, span):
    lo, hi = span
    return msgspec.msgpack.decode(data[lo + 8:hi])  # ["C", slot, gen, key, ...] or ["F", slot, gen]


def test_corruption_fuzz(tmp_path, ssd):
    base = str(tmp_path / "base")
    t = SSDTier(_cfg(base), CHUNK)
    expected: dict[str, np.ndarray] = {}
    for i in range(30):
        key = f"k{i}"
        expected[key] = ssd.payload(i, CHUNK)
        assert ssd.put(t, key, expected[key])
    known = dict(expected)  # a removed chunk whose FREE record is hit may come back: with its own bytes only
    for i in range(0, 30, 5):  # FREE records and reused slots
        assert t.remove(f"k{i}")
        del expected[f"k{i}"]
    for i in range(30, 36):
        key = f"k{i}"
        expected[key] = known[key] = ssd.payload(i, CHUNK)
        assert ssd.put(t, key, expected[key])
    slot_of = {k: t.entry(k).slot for k in expected}
    slot_size, jname = t.slot_size, os.path.basename(t.io.journal.path)
    sfile = os.path.basename(t.io.files.path(0))
    t.close()
    journal = open(os.path.join(base, jname), "rb").read()
    spans = record_spans(journal)
    owner = {s: k for k, s in slot_of.items()}

    def names(span) -> set[str]:
        """Chunks a journal record may cost: the key it names and the chunk in the slot it names."""
        rec = _decode(journal, span)
        out = {owner.get(rec[1], "")}
        if rec[0] == "C":
            out.add(rec[3])
        return out

    rng = random.Random(20261201)
    totals = {"wrong_bytes": 0, "exceptions": 0, "untouched_lost": 0, "lost": 0}
    work = str(tmp_path / "work")
    per_kind: dict[str, int] = {}
    for m in range(MUTATIONS):
        shutil.rmtree(work, ignore_errors=True)
        shutil.copytree(base, work)
        spath, jpath = os.path.join(work, sfile), os.path.join(work, jname)
        allowed: set[str] = set()
        kind = rng.choice(["data", "header", "journal", "journal", "zero_page", "truncate_slots",
                           "truncate_journal", "duplicate", "move", "craft"])
        if kind in ("data", "header", "zero_page"):
            key = rng.choice(sorted(expected))
            off = slot_of[key] * slot_size + (rng.randrange(HEADER_SIZE, HEADER_SIZE + CHUNK) if kind == "data"
                                              else rng.randrange(0, 64) if kind == "header"
                                              else rng.randrange(0, slot_size // 4096) * 4096)
            with open(spath, "r+b") as f:
                f.seek(off)
                old = f.read(4096 if kind == "zero_page" else 1)
                f.seek(off)
                f.write(bytes(len(old)) if kind == "zero_page" else bytes([old[0] ^ (1 << rng.randrange(8))]))
            allowed = {key}
        elif kind == "journal":
            off = rng.randrange(len(journal))
            data = bytearray(journal)
            data[off] ^= 1 << rng.randrange(8)
            open(jpath, "wb").write(bytes(data))
            allowed = set().union(*(names(s) for s in spans if s[0] <= off < s[1]))
        elif kind == "truncate_slots":
            cut = rng.randrange(os.path.getsize(spath))
            os.truncate(spath, cut)
            allowed = {k for k, s in slot_of.items() if (s + 1) * slot_size > cut}
        elif kind == "truncate_journal":
            cut = rng.randrange(len(journal))
            os.truncate(jpath, cut)
            allowed = set().union(set(), *(names(s) for s in spans if s[1] > cut))
        elif kind in ("duplicate", "move"):
            i = rng.randrange(len(spans))
            rec = journal[spans[i][0]:spans[i][1]]
            rest = journal if kind == "duplicate" else journal[:spans[i][0]] + journal[spans[i][1]:]
            at = rng.choice([s[0] for s in record_spans(rest)] + [len(rest)])
            open(jpath, "wb").write(rest[:at] + rec + rest[at:])
            if kind == "move":
                allowed = names(spans[i])
        else:  # a CRC-valid record with hostile field values
            slot = rng.choice([-5, 0, 1, rng.randrange(SLOTS), SLOTS + 3, 1 << 40])
            gen = rng.choice([0, 1, 10**6, (1 << 62) + 1])
            seg = rng.choice([0, 1 << 20, 12345, -4096])
            nbytes = rng.choice([0, CHUNK, 1 << 50, -1])
            key = rng.choice(["crafted", "k1", "k3"])
            rec = (["C", slot, gen, key, nbytes, [nbytes], "torch.uint8", "KV_2LTD", seg, {}]
                   if rng.random() < 0.8 else ["F", slot, gen])
            open(jpath, "ab").write(frame(rec))
            allowed = {key, owner.get(slot, "")}
        try:
            t = SSDTier(_cfg(work), CHUNK)
        except Exception as e:  # noqa: BLE001
            totals["exceptions"] += 1
            print(f"mutation {m} ({kind}): start raised {e!r}")
            continue
        try:
            for key in sorted(set(expected) | set(t.keys())):
                try:
                    got = ssd.get(t, key)
                except Exception as e:  # noqa: BLE001
                    totals["exceptions"] += 1
                    print(f"mutation {m} ({kind}): read of {key} raised {e!r}")
                    continue
                if got is not None and (key not in known or not np.array_equal(got, known[key])):
                    totals["wrong_bytes"] += 1
                    print(f"mutation {m} ({kind}): wrong bytes for {key}")
                if got is None and key in expected:
                    totals["lost"] += 1
                    per_kind[kind] = per_kind.get(kind, 0) + 1
                    if key not in allowed:
                        totals["untouched_lost"] += 1
                        print(f"mutation {m} ({kind}): lost untouched {key} (allowed {sorted(allowed)})")
            t.index.check_invariants()
            if m % 25 == 0:
                assert ssd.fill_fresh(t, f"fresh{m}-", SLOTS) == SLOTS and len(t) == SLOTS
        finally:
            t.close()
    print("corruption fuzz:", MUTATIONS, "mutations,", totals, "chunks lost by kind of mutation:", per_kind)
    assert totals["wrong_bytes"] == 0 and totals["exceptions"] == 0 and totals["untouched_lost"] == 0, totals
    assert totals["lost"] > 0  # the mutations did hit chunks: the checks above were exercised
