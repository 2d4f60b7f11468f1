"""Probe: what the SSD tier's read path costs over raw O_DIRECT reads of the very same slots into the same buffers.

One `SSDTier` (kvtier's defaults unless --kvtier KEY=VALUE) stores `--chunks` chunks of 32 MiB; then, with the page
cache dropped before each (needs root), the same chunks are read in batches of 8 (one LMCache request):
- `tier`: `SSDTier.read_batch` (header, pieces, CRC-32 of every byte, index bookkeeping), as the plugin reads;
- `tier, checksum not computed`: the same tier in a child process whose `ssd_io.checksum` returns a constant
  (written and verified as such: a measurement of the checksum's cost, never a mode of the tier);
- `raw`: four threads of one 32 MiB `preadv` per chunk at the slots' data offsets (what LocalDiskBackend's
  O_DIRECT read does, without the header and the checksum).
Every reader reads into the same huge-page destinations (see `dest_layout_probe.py`), so only the read path
differs. Rounds alternate the readers in a shuffled order; reported are medians and the ratios to `raw` per round.

    python benchmarks/read_path_probe.py --dir /var/tmp/probe [--rounds 5] [--kvtier io_threads=2 ...]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from kvtier.testing.host_memory import drop_page_cache, huge_page_buffer

MIB = 1 << 20
CHUNK = 32 * MIB
BATCH = 8


def child(args) -> int:
    """One process: build the tier, store, then time the readers; prints a JSON line of GB/s lists."""
    if args.no_checksum:
        import kvtier.storage_backends.ssd.slot_io as ssd_io

        ssd_io.checksum = lambda data: 0  # probe only: the cost of everything but the checksum
        ssd_io.combine_checksums = lambda parts: 0
    from kvtier.storage_backends.config import parse_kvtier_config
    from kvtier.storage_backends.ssd.index import ChunkMeta
    from kvtier.storage_backends.ssd.tier import SSDTier

    extra = {"kvtier.ssd_path": args.tier_dir, "kvtier.ssd_capacity_gb": args.chunks * 33 / 1024 + 0.1}
    for kv in args.kvtier:
        k, _, v = kv.partition("=")
        extra[f"kvtier.{k}"] = int(v) if v.isdigit() else v
    tier = SSDTier(parse_kvtier_config(extra), CHUNK)
    src = huge_page_buffer(CHUNK)
    np.frombuffer(src, dtype=np.uint8)[:] = np.random.default_rng(0).integers(0, 256, CHUNK, dtype=np.uint8)
    meta = ChunkMeta(CHUNK, (CHUNK,), "torch.uint8", "KV_2LTD")
    keys = [f"probe@1@0@{i:064x}@uint8" for i in range(args.chunks)]
    ok = tier.submit_puts([(k, meta, src, lambda stored: None) for k in keys])
    assert all(ok) and tier.flush(600)
    dests = {k: huge_page_buffer(CHUNK) for k in keys}
    entries = tier.index.begin_read(keys)
    where = [tier.io.files.locate_path(e.slot) for e in entries]
    tier.index.end_read(keys, entries, [None] * len(keys), [False] * len(keys))

    def tier_read() -> float:
        t0 = time.perf_counter()
        for b in range(0, len(keys), BATCH):
            out = tier.read_batch(keys[b:b + BATCH], lambda k, m: (dests[k], k), lambda h: None)
            assert all(o is not None for o in out), "a chunk did not read back"
        return len(keys) * CHUNK / (time.perf_counter() - t0) / 1e9

    def raw_read() -> float:
        fds = {p: os.open(p, os.O_RDONLY | os.O_DIRECT) for p, _ in where}

        def one(i: int) -> None:
            path, base = where[i]
            buf, off, done = dests[keys[i]], base + 4096, 0
            while done < CHUNK:
                done += os.preadv(fds[path], [buf[done:]], off + done)

        t0 = time.perf_counter()
        for b in range(0, len(keys), BATCH):
            with ThreadPoolExecutor(4) as ex:
                list(ex.map(one, range(b, min(b + BATCH, len(keys)))))
        dt = time.perf_counter() - t0
        for fd in fds.values():
            os.close(fd)
        return len(keys) * CHUNK / dt / 1e9

    res: dict[str, list[float]] = {"tier": [], "raw": []}
    for r in range(args.rounds):
        pair = [("tier", tier_read), ("raw", raw_read)]
        random.Random(r).shuffle(pair)
        for name, fn in pair:
            drop_page_cache()
            res[name].append(fn())
    tier.close()
    print(json.dumps(res))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", required=True, help="directory on the disk to probe (not tmpfs)")
    ap.add_argument("--chunks", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--kvtier", action="append", default=[], metavar="KEY=VALUE", help="a kvtier.* key (repeatable)")
    ap.add_argument("--no-checksum", action="store_true", help=argparse.SUPPRESS)  # the child's variant
    ap.add_argument("--tier-dir", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.tier_dir:
        return child(args)
    if os.geteuid() != 0:
        print("needs root (drops the page cache before every read)", file=sys.stderr)
        return 2
    rows = {}
    for variant in ("tier", "tier, checksum not computed"):
        d = os.path.join(args.dir, f"read-path-{os.getpid()}")
        cmd = [sys.executable, os.path.abspath(__file__), "--dir", args.dir, "--chunks", str(args.chunks), "--rounds",
               str(args.rounds), "--tier-dir", d, *(f"--kvtier={kv}" for kv in args.kvtier)]
        if variant != "tier":
            cmd.append("--no-checksum")
        try:
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        finally:
            shutil.rmtree(d, ignore_errors=True)
        rows[variant] = json.loads(out.strip().splitlines()[-1])
    print(f"{args.chunks} chunks of 32 MiB in batches of {BATCH}, {args.rounds} rounds, kvtier keys "
          f"{args.kvtier or 'default'}; GB/s median (per round), ratio = median of tier / raw of the same round")
    for variant, res in rows.items():
        ratio = statistics.median(a / b for a, b in zip(res["tier"], res["raw"]))
        print(f"  {variant:<30} {statistics.median(res['tier']):.2f} ({', '.join(f'{x:.2f}' for x in res['tier'])})"
              f"   raw {statistics.median(res['raw']):.2f}   ratio {ratio:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
