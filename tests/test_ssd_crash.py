"""A process killed (SIGKILL) in the middle of writes loses no committed chunk and leaves no readable torn slot."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np

from kvtier.storage_backends.config import parse_kvtier_config
from kvtier.storage_backends.ssd.tier import SSDTier

CHUNK = 256 * 1024 + 512

WRITER = textwrap.dedent("""
    import os, sys, numpy as np
    from kvtier.storage_backends.config import parse_kvtier_config
    from kvtier.storage_backends.ssd.tier import ChunkMeta, SSDTier
    cfg = parse_kvtier_config({"kvtier.ssd_path": sys.argv[1], "kvtier.ssd_capacity_gb": 0.02,
                               "kvtier.io_block_mb": 1})
    t = SSDTier(cfg, %d)
    def done(key):
        # one write(2) per line: completions come from several writer threads, print() would interleave them
        return lambda ok: ok and os.write(1, f"committed {key}\\n".encode())
    i = 0
    while True:
        data = np.random.default_rng(i).integers(0, 256, %d, dtype=np.uint8)
        t.submit_put(f"k{i}", ChunkMeta(%d, (%d,), "torch.uint8", "KV_2LTD"), memoryview(data), done(f"k{i}"))
        i += 1
""") % (CHUNK, CHUNK, CHUNK, CHUNK)


def test_sigkill_during_writes(tmp_path):
    ssd = str(tmp_path / "ssd")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    for round_ in range(3):
        proc = subprocess.Popen([sys.executable, "-c", WRITER, ssd], stdout=subprocess.PIPE, text=True, env=env)
        committed = []
        deadline = time.time() + 60
        while len(committed) < 20 + 15 * round_ and time.time() < deadline:
            line = proc.stdout.readline()
            if line.startswith("committed") and len(line.split()) == 2:
                committed.append(line.split()[1])
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        # Only whole lines: the kill can cut the last print short (that chunk is committed, its key unknown).
        committed += [ln.split()[1] for ln in proc.stdout.read().splitlines(keepends=True)
                      if ln.startswith("committed") and ln.endswith("\n") and len(ln.split()) == 2]
        assert len(committed) >= 20

        t = SSDTier(parse_kvtier_config({"kvtier.ssd_path": ssd, "kvtier.ssd_capacity_gb": 0.02,
                                         "kvtier.io_block_mb": 1}), CHUNK)
        try:
            present = set(t.keys())
            # Capacity is 0.02 GiB (~79 slots): committed chunks may have been evicted by later ones, but the
            # most recent committed ones must all be there.
            assert set(committed[-20:]) <= present
            bufs = {}

            def alloc(k, m):
                bufs[k] = np.empty(m.nbytes, dtype=np.uint8)
                return memoryview(bufs[k]), k

            keys = sorted(present)
            got = t.read_batch(keys, alloc, lambda h: None)
            for key, handle in zip(keys, got):
                assert handle == key, f"committed chunk {key} unreadable"
                want = np.random.default_rng(int(key[1:])).integers(0, 256, CHUNK, dtype=np.uint8)
                assert np.array_equal(bufs[key], want)
            assert t.stats.corrupt == 0
        finally:
            t.close()
