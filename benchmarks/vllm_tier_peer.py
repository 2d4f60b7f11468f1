"""kvtier's secondary tier against vLLM's own `fs` tier, both under vLLM's `TieringOffloadingSpec` manager.

The baseline is the one a user of vLLM's offloading path picks today: `{"type": "fs", "root_dir": ...}` (O_DIRECT
where the filesystem allows it, 16 read and 16 write threads). Both tiers are driven by the same harness
(`kvtier.testing.vllm_tiering.TieringHarness`: vLLM's manager, its CPU primary tier, the scheduler's calls) with
the same chunks, in paired passes whose order alternates. Per pass and tier:

1. **durable store**: one request stores `--chunks` chunks into the primary tier; timed until every secondary-tier
   job has finished. kvtier's job ends when each chunk is fdatasync'ed and journalled (`durable_writes`, the
   default); `fs` writes without fsync, so its durable figure adds an `os.sync()` after its jobs end (what makes
   its files survive a power loss). Its raw figure (no sync) is printed too.
2. **restart**: the manager is shut down and a new one built over the same directory (a new engine); timed until
   it is built, and every chunk is looked up: chunks found.
3. **cold load**: the page cache is dropped (root), then one request loads every chunk (lookups, promotions
   into the primary tier, the copies out): timed; every chunk is compared with what was stored (a mismatch stops
   the run).

Once per run, **capacity**: a stream of 3x kvtier's capacity into both tiers (kvtier's `ssd_capacity_gb` is the
bound; `fs` has none by default): bytes on disk afterwards and chunks still loadable.

Ratios are fs / kvtier of seconds (> 1: kvtier faster), per pass, reported as min / median / max.

    python benchmarks/vllm_tier_peer.py --dir /var/tmp --chunks 96 --repeats 5

Needs vLLM (>= 0.32 with `vllm/v1/kv_offload/tiering`) and root for dropping the page cache.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from kvtier.testing.host_memory import drop_page_cache
from kvtier.testing.vllm_tiering import TieringHarness, fs_tier, kvtier_tier, offload_keys

TIERS = ("kvtier", "fs")


def disk_bytes(root: Path) -> int:
    return sum(p.stat().st_blocks * 512 for p in root.rglob("*") if p.is_file())


def tier_entry(kind: str, root: Path, capacity_bytes: int) -> dict:
    if kind == "kvtier":
        return kvtier_tier(str(root), capacity_bytes / (1 << 30))
    return fs_tier(str(root))


def one_pass(kind: str, root: Path, keys: list, chunks: list[np.ndarray], block: int, capacity: int) -> dict:
    entry = tier_entry(kind, root, capacity)
    n = len(keys)
    out: dict[str, float] = {}
    h = TieringHarness([entry], cpu_chunks=n, block_bytes=block)
    try:
        os.sync()
        t0 = time.perf_counter()
        stored = h.store(keys, chunks)
        h.settle(600)
        out["store_s"] = time.perf_counter() - t0
        t1 = time.perf_counter()
        os.sync()  # kvtier: nothing left to write; fs: its files reach the disk
        out["sync_s"] = time.perf_counter() - t1
        if len(stored) != n:
            raise SystemExit(f"{kind}: the primary tier took {len(stored)} of {n} chunks")
    finally:
        h.close()
    t0 = time.perf_counter()
    h = TieringHarness([entry], cpu_chunks=n, block_bytes=block)
    out["restart_s"] = time.perf_counter() - t0
    try:
        drop_page_cache()
        t0 = time.perf_counter()
        got = h.load(keys, timeout=600)
        out["load_s"] = time.perf_counter() - t0
    finally:
        h.close()
    out["found"] = sum(g is not None for g in got)
    bad = [i for i, (g, c) in enumerate(zip(got, chunks)) if g is not None and not np.array_equal(g, c)]
    if bad:
        raise SystemExit(f"{kind}: chunks {bad[:8]} came back with other bytes")
    return out


def capacity_stream(kind: str, root: Path, block: int, capacity_chunks: int, batch: int) -> dict:
    """3x the capacity in batches (each settled), then every chunk looked up and loaded in batches."""
    rng = np.random.default_rng(7)
    keys = offload_keys(f"stream-{kind}", 3 * capacity_chunks)
    entry = tier_entry(kind, root, capacity_chunks * block)
    h = TieringHarness([entry], cpu_chunks=batch, block_bytes=block)
    try:
        for i in range(0, len(keys), batch):
            part = keys[i:i + batch]
            h.store(part, [rng.integers(0, 256, block, dtype=np.uint8) for _ in part])
            h.settle(600)
    finally:
        h.close()
    h = TieringHarness([entry], cpu_chunks=batch, block_bytes=block)
    try:
        loadable = 0
        for i in range(0, len(keys), batch):
            loadable += sum(g is not None for g in h.load(keys[i:i + batch], timeout=600))
    finally:
        h.close()
    return {"stored": len(keys), "loadable": loadable, "disk_bytes": disk_bytes(root)}


def spread(xs: list[float]) -> str:
    return f"{min(xs):.2f} / {statistics.median(xs):.2f} / {max(xs):.2f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default="/var/tmp", help="directory on the disk to measure (a real disk, not tmpfs)")
    ap.add_argument("--chunks", type=int, default=96, help="chunks stored and loaded per tier and pass")
    ap.add_argument("--block-mib", type=float, default=2.0, help="bytes of one chunk (MiB)")
    ap.add_argument("--repeats", type=int, default=5, help="paired passes")
    ap.add_argument("--capacity-chunks", type=int, default=32, help="kvtier's capacity in the capacity stream")
    args = ap.parse_args()
    if not drop_page_cache():
        print("needs root: cold loads drop the page cache", file=sys.stderr)
        return 2
    block = int(args.block_mib * (1 << 20))
    work = Path(tempfile.mkdtemp(prefix="kvtier-peer-", dir=args.dir))
    rng = np.random.default_rng(1)
    try:
        for kind in TIERS:  # warm-up, not reported: imports, thread pools, the first files of a directory
            keys = offload_keys("warm-up", 8)
            one_pass(kind, work / f"warm-up-{kind}", keys, [rng.integers(0, 256, block, dtype=np.uint8)
                                                          for _ in keys], block, 32 * block)
        rows: dict[str, list[dict]] = {k: [] for k in TIERS}
        for p in tqdm(range(args.repeats), desc="paired passes", unit="pass"):
            keys = offload_keys(f"pass-{p}", args.chunks)
            chunks = [rng.integers(0, 256, block, dtype=np.uint8) for _ in keys]
            order = TIERS if p % 2 == 0 else TIERS[::-1]
            for kind in order:
                root = work / f"{kind}-{p}"
                rows[kind].append(one_pass(kind, root, keys, chunks, block, 4 * args.chunks * block))
                shutil.rmtree(root)
        mib = args.chunks * block / (1 << 20)
        print(f"\n{args.repeats} paired passes of {args.chunks} chunks of {args.block_mib:g} MiB ({mib:.0f} MiB) "
              f"in {args.dir}")
        for kind in TIERS:
            r = rows[kind]
            print(f"  {kind:7s} store {spread([x['store_s'] for x in r])} s (then os.sync "
                  f"{spread([x['sync_s'] for x in r])} s), restart {spread([x['restart_s'] for x in r])} s, "
                  f"cold load {spread([x['load_s'] for x in r])} s, found {[int(x['found']) for x in r]}")
        kv, fs = rows["kvtier"], rows["fs"]
        ratio = {
            "cold load (fs / kvtier)": [f["load_s"] / k["load_s"] for k, f in zip(kv, fs)],
            "durable store ((fs + os.sync) / kvtier)": [(f["store_s"] + f["sync_s"]) / k["store_s"]
                                                        for k, f in zip(kv, fs)],
            "store, fs not durable (fs / kvtier)": [f["store_s"] / k["store_s"] for k, f in zip(kv, fs)],
            "restart (fs / kvtier)": [f["restart_s"] / k["restart_s"] for k, f in zip(kv, fs)],
        }
        print("ratios per pass, min / median / max (> 1: kvtier faster)")
        for name, xs in ratio.items():
            print(f"  {name:42s} {spread(xs)}")
        cap = args.capacity_chunks
        print(f"capacity: a stream of {3 * cap} chunks, kvtier's capacity {cap} chunks ({cap * block >> 20} MiB)")
        for kind in TIERS:
            c = capacity_stream(kind, work / f"stream-{kind}", block, cap, max(1, cap // 4))
            print(f"  {kind:7s} {c['disk_bytes'] / (1 << 20):8.1f} MiB on disk, {c['loadable']} of {c['stored']} "
                  f"chunks loadable")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
