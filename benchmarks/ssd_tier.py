"""SSD-tier benchmark: kvtier's plugin vs LMCache's LocalDiskBackend vs raw reads/writes of the same bytes.

All in one run on the same disk: durable writes (O_DIRECT or fsync'd), cold reads (page cache dropped between
writing and reading; needs root), GB/s medians over --repeats and ratios against the best raw read and against
LocalDiskBackend. Plus the index rebuild time of a tier holding 100k committed slots.

    .venv/bin/python benchmarks/ssd_tier.py --dir /path/on/the/ssd [--gib 2] [--chunk-mib 32]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
os.environ.setdefault("LMCACHE_LOG_LEVEL", "ERROR")

import torch  # noqa: E402

from kvtier.kernels.posix_io import aligned_buffer, open_file, pread_full, pwrite_full  # noqa: E402
from kvtier.storage_backends.engine_factory import (  # noqa: E402
    ModelShape,
    build_engine,
    destroy_engine,
    kvtier_backend,
    load_lmcache_config,
)

LLAMA3_8B = ModelShape("bench/llama-3-8b", num_layers=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)


def drop_caches() -> bool:
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


# ------------------------------------------------------------------------------------------------ raw baselines
def raw_write(path: str, total: int, block: int, streams: int, direct: bool) -> float:
    fd = open_file(path, o_direct=direct)
    os.ftruncate(fd, 0)
    buf = aligned_buffer(block)
    buf[:] = os.urandom(block)
    t0 = time.perf_counter()
    offsets = list(range(0, total, block))
    with ThreadPoolExecutor(streams) as ex:
        list(ex.map(lambda off: pwrite_full(fd, buf, off), offsets))
    if not direct:
        os.fsync(fd)
    os.fdatasync(fd)
    dt = time.perf_counter() - t0
    os.close(fd)
    return total / dt / 1e9


def raw_read(path: str, total: int, block: int, streams: int, direct: bool) -> float:
    drop_caches()
    fd = open_file(path, o_direct=direct, create=False)
    bufs = [aligned_buffer(block) for _ in range(streams)]
    offsets = list(range(0, total, block))
    t0 = time.perf_counter()
    with ThreadPoolExecutor(streams) as ex:
        list(ex.map(lambda i: [pread_full(fd, bufs[i], off) for off in offsets[i::streams]], range(streams)))
    dt = time.perf_counter() - t0
    os.close(fd)
    return total / dt / 1e9


# ------------------------------------------------------------------------------------------------ LMCache paths
def engine_yaml(tmp: str, name: str, chunk: int, host_gb: float, body: str) -> str:
    path = os.path.join(tmp, f"{name}.yaml")
    with open(path, "w") as f:
        f.write(f"chunk_size: {chunk}\nlocal_cpu: true\nmax_local_cpu_size: {host_gb}\n"
                f"pre_caching_hash_algorithm: sha256_cbor\n{body}")
    return path


def lmcache_round(yaml_path: str, shape: ModelShape, chunk: int, n_chunks: int, per_req: int, kv: torch.Tensor,
                  wait_written, backend_of) -> tuple[float, float]:
    """Store n_chunks through LMCacheEngine.store until durable, drop caches, then read them back through the
    backend's `batched_get_blocking` (what LMCache's retrieve calls). Returns (write GB/s, cold read GB/s), each
    counting only the chunks that reached the backend (LMCache skips a store when its host pool is full)."""
    engine = build_engine(load_lmcache_config(yaml_path), shape)
    try:
        host = engine.storage_manager.storage_backends["LocalCPUBackend"]
        backend = backend_of(engine)
        chunk_bytes = shape.chunk_bytes(chunk)
        reqs = [torch.arange(r * 10_000_000, r * 10_000_000 + per_req * chunk) for r in range(n_chunks // per_req)]
        t0 = time.perf_counter()
        for ids in reqs:
            engine.store(ids, kvcaches=kv)
        wait_written(engine)
        wdt = time.perf_counter() - t0
        keys = [[k for _, _, k in engine.token_database.process_tokens(tokens=ids)] for ids in reqs]
        stored = sum(backend.contains(k) for ks in keys for k in ks)  # a store LMCache skipped is not a write
        if stored != n_chunks:
            print(f"  WARNING: {stored} of {n_chunks} chunks reached the backend", file=sys.stderr)
        host.clear()
        drop_caches()
        got = 0
        t0 = time.perf_counter()
        for ks in keys:
            objs = backend.batched_get_blocking(ks)
            got += sum(o is not None for o in objs)
            for o in objs:
                if o is not None:
                    o.ref_count_down()
        rdt = time.perf_counter() - t0
        if got != stored:
            print(f"  WARNING: read {got} of {stored} stored chunks", file=sys.stderr)
        return stored * chunk_bytes / wdt / 1e9, got * chunk_bytes / rdt / 1e9
    finally:
        destroy_engine(engine)


def wait_kvtier(engine) -> None:
    assert kvtier_backend(engine).flush(600)


def local_disk(engine):
    return engine.storage_manager.storage_backends["LocalDiskBackend"]


def wait_local_disk(engine) -> None:
    disk = local_disk(engine)
    deadline = time.time() + 600
    while disk.disk_worker.put_tasks and time.time() < deadline:
        time.sleep(0.002)
    os.sync()  # durable: buffered files reach the disk


def rebuild_time(tmp: str, slots: int = 100_000) -> float:
    from kvtier.storage_backends.config import parse_kvtier_config
    from kvtier.storage_backends.journal import Journal
    from kvtier.storage_backends.slot_format import CommitRecord
    from kvtier.storage_backends.ssd_tier import SSDTier

    d = os.path.join(tmp, "rebuild")
    cfg = parse_kvtier_config({"kvtier.ssd_path": d, "kvtier.ssd_capacity_gb": slots * 8192 / (1 << 30) + 0.01,
                               "kvtier.file_size_gb": 64})
    t = SSDTier(cfg, 4096)
    t.files.ensure(slots - 1)
    jp = t.journal.path
    t.close()
    j = Journal(jp)
    j.append([CommitRecord(i, i + 1, f"bench/llama-3-8b@1@0@{i:064x}@bfloat16", 4096, (4096,), "torch.uint8",
                           "KV_2LTD", 4 << 20) for i in range(slots)], sync=True)
    j.close()
    t0 = time.perf_counter()
    t = SSDTier(cfg, 4096)
    dt = time.perf_counter() - t0
    assert len(t) == slots
    t.close()
    return dt


def paired_ratios(results: dict[str, list[float]]) -> None:
    """Ratios within each repeat (the methods of one round share the disk's state at that time), then their
    median: the disk's slow drift cancels, which a ratio of medians does not do."""
    n = min(len(v) for v in results.values())
    if "kvtier plugin read" not in results or n == 0:
        return
    raw_keys = [k for k in results if k.startswith("raw read")]
    plug = results["kvtier plugin read"]
    best = [max(results[k][i] for k in raw_keys) for i in range(n)]
    print(f"  paired, per repeat: plugin read / best raw read of that repeat = "
          f"{statistics.median(p / b for p, b in zip(plug, best)):.2f} "
          f"({', '.join(f'{p / b:.2f}' for p, b in zip(plug, best))})")
    for base in ("LocalDiskBackend", "LocalDiskBackend O_DIRECT"):
        if f"{base} read" in results:
            rs = [p / b for p, b in zip(plug, results[f"{base} read"])]
            print(f"  paired, per repeat: plugin read / {base} read = {statistics.median(rs):.2f} "
                  f"({', '.join(f'{r:.2f}' for r in rs)})")
    print(f"  disk ceiling seen (fastest read of any method, any repeat) = "
          f"{max(max(v) for k, v in results.items() if k.endswith('read') or 'read ' in k):.2f} GB/s")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default=None, help="directory on the disk to measure (default: a temp dir)")
    ap.add_argument("--gib", type=float, default=2.0, help="bytes written and read per method")
    ap.add_argument("--chunk-mib", type=int, default=32, help="chunk size (Llama-3-8B, 256 tokens = 32 MiB)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--io-threads", type=int, default=4)
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="kvtier-bench-", dir=args.dir)
    if not drop_caches():
        print("note: cannot drop the page cache (not root): reads are not cold", file=sys.stderr)
    shape = LLAMA3_8B
    chunk = args.chunk_mib * (1 << 20) // (shape.chunk_bytes(1))
    n_chunks = int(args.gib * 1024 // args.chunk_mib)
    per_req = min(8, n_chunks)
    n_chunks = n_chunks // per_req * per_req
    total = n_chunks * shape.chunk_bytes(chunk)
    host_gb = per_req * shape.chunk_bytes(chunk) * 3 / (1 << 30)
    kv = torch.randn(2, shape.num_layers, per_req * chunk, shape.hidden).to(shape.dtype)
    print(f"{n_chunks} chunks of {args.chunk_mib} MiB ({chunk} tokens of Llama-3-8B KV), {total / 1e9:.2f} GB per "
          f"method, {args.repeats} repeats, in {tmp}")

    results: dict[str, list[float]] = {}

    def rec(name: str, v: float) -> None:
        results.setdefault(name, []).append(v)

    raw = os.path.join(tmp, "raw.dat")
    for r in range(args.repeats):
        for streams in (1, 4):
            rec(f"raw write O_DIRECT x{streams}", raw_write(raw, total, 4 << 20, streams, True))
            rec(f"raw read O_DIRECT x{streams}", raw_read(raw, total, 4 << 20, streams, True))
            rec(f"raw read buffered x{streams}", raw_read(raw, total, 4 << 20, streams, False))
        rec("raw write buffered+fsync x4", raw_write(raw, total, 4 << 20, 4, False))
        os.unlink(raw)
        for name, body, wait, backend_of in (
            ("kvtier plugin", 'storage_plugins: ["kvtier"]\nextra_config:\n'
             "  storage_plugin.kvtier.module_path: kvtier.storage_backends\n"
             "  storage_plugin.kvtier.class_name: KVTierBackend\n"
             f"  kvtier.ssd_path: {tmp}/kvtier-{r}\n  kvtier.ssd_capacity_gb: {args.gib * 1.2 + 0.1}\n"
             f"  kvtier.io_threads: {args.io_threads}\n", wait_kvtier, kvtier_backend),
            ("LocalDiskBackend", f"local_disk: file://{tmp}/ld-{r}/\nmax_local_disk_size: {args.gib * 1.2 + 0.1}\n",
             wait_local_disk, local_disk),
            ("LocalDiskBackend O_DIRECT", f"local_disk: file://{tmp}/ldo-{r}/\n"
             f"max_local_disk_size: {args.gib * 1.2 + 0.1}\nextra_config:\n  use_odirect: true\n", wait_local_disk,
             local_disk),
        ):
            try:
                w, rd = lmcache_round(engine_yaml(tmp, f"{name}-{r}".replace(" ", "_"), chunk, host_gb, body), shape,
                                      chunk, n_chunks, per_req, kv, wait, backend_of)
                rec(f"{name} write", w)
                rec(f"{name} read", rd)
            except Exception as e:  # report, keep measuring the others
                print(f"  {name}: failed ({e})", file=sys.stderr)
        for d in os.listdir(tmp):
            if d.startswith(("kvtier-", "ld-", "ldo-")):
                shutil.rmtree(os.path.join(tmp, d), ignore_errors=True)

    med = {k: statistics.median(v) for k, v in results.items()}
    print(f"\n{'method':<32}{'median GB/s':>12}   all")
    for k, v in med.items():
        print(f"{k:<32}{v:>12.2f}   {', '.join(f'{x:.2f}' for x in results[k])}")
    best_raw_read = max(v for k, v in med.items() if k.startswith("raw read"))
    print("\nratios (medians):")
    paired_ratios(results)
    if "kvtier plugin read" in med:
        print(f"  plugin cold read / best raw read        = {med['kvtier plugin read'] / best_raw_read:.2f}  "
              "(target >= 0.9)")
        for base in ("LocalDiskBackend", "LocalDiskBackend O_DIRECT"):
            if f"{base} read" in med:
                print(f"  plugin cold read / {base + ' read':<26}= {med['kvtier plugin read'] / med[base + ' read']:.2f}"
                      "  (target >= 1.2)")
                print(f"  plugin durable write / {base + ' write':<22}= "
                      f"{med['kvtier plugin write'] / med[base + ' write']:.2f}  (target >= 1.5)")
    rb = rebuild_time(tmp)
    print(f"  index rebuild, 100k committed slots      = {rb:.2f} s  (target < 2 s)")
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
