"""LMCache MP-mode L2 adapters on the same disk: kvtier's adapter vs LMCache's own `fs` and `fs_native`.

Every adapter is built by LMCache's own factory from its `--l2-adapter` JSON (as `lmcache server` does) and driven
through the L2 contract (submit a task, wait on its event fd, query the result) with real 4096-aligned L1 objects
of LMCache's `L1MemoryManager`, 32 MiB each (a 256-token Llama-3-8B chunk).

- Durable stores: a store batch counts when its data is on disk. kvtier's adapter reports completion after
  fdatasync + journal commit (`durable_writes`, its default); LMCache's `fs` and `fs_native` do not sync, so their
  batch time includes an fsync of every file the batch created (and of the directory).
- Cold loads: the page cache is dropped (`echo 3 > /proc/sys/vm/drop_caches`, needs root) before every timed load
  batch of every adapter.
- "kvtier prepared" (on unless --no-prepared): kvtier's adapter with `prepare_slots`; one untimed warm-up chunk
  opens its tier and timing starts once its slot files are zeroed (untimed), so its stores overwrite written blocks
  (what every store of a tier that has been full once does) instead of first-filling fallocated extents.
- Checksums on: kvtier verifies a CRC-32 per 32 MiB segment on every load (it always does); LMCache's adapters have
  none. The first batch each adapter loads is compared with the stored bytes outside the timing.
- Interleaved: the work is cut into batches of 8 chunks (256 MiB, one 2048-token request); every adapter stores
  (then loads) batch b before any moves on to b+1, in an order rotating by len(adapters)/batches per batch (printed
  for the first repeat), so each adapter's positions in a batch average alike and the disk's drift hits all alike.
  Reported: GB/s per batch (median, p10, p90) and the median over batches of kvtier's GB/s over the best
  LMCache adapter's (the one with the highest median) GB/s in the same batch (targets: loads >= 1.0x, durable
  stores >= 1.2x); also against the fastest LMCache adapter of each batch, and against each one.

    .venv/bin/python benchmarks/lmcache_mp_l2.py --dir /var/tmp [--gib 2] [--repeats 3]

`--dir` must be on a real disk (not tmpfs: O_DIRECT and page-cache effects); the run makes `mp-bench-*` there and
removes it at the end.
"""

from __future__ import annotations

import argparse
import os
import select
import shutil
import statistics
import sys
import tempfile
import time

os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
os.environ.setdefault("LMCACHE_LOG_LEVEL", "ERROR")
os.environ.setdefault("LMCACHE_DISABLE_BANNER", "1")

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

from kvtier.testing.host_memory import drop_page_cache  # noqa: E402

CHUNK_SHAPE = torch.Size([2, 32, 256, 1024])  # Llama-3-8B, 256 tokens: K/V x layers x tokens x kv heads*dim
CHUNK_BYTES = CHUNK_SHAPE.numel() * 2  # bf16: 32 MiB
PER_BATCH = 8
KVTIER = "kvtier"
PREPARED = "kvtier prepared"


def fs_type(path: str) -> str:
    best, kind = "", "?"
    with open("/proc/mounts") as f:
        for line in f:
            dev, mnt, typ = line.split()[:3]
            if path.startswith(mnt) and len(mnt) > len(best):
                best, kind = mnt, typ
    return kind


def adapter_specs(root: str, cap_gb: float, kvtier_params: dict | None = None,
                  prepared: bool = False) -> dict[str, dict]:
    from kvtier.launch.lmcache_server import kvtier_adapter_spec

    mine = {KVTIER: kvtier_adapter_spec(os.path.join(root, "kvtier"), cap_gb, **(kvtier_params or {}))}
    if prepared:  # one warm-up chunk opens its tier; timing starts once its slot files are prepared (untimed)
        mine[PREPARED] = kvtier_adapter_spec(os.path.join(root, "kvtier-prepared"), cap_gb + 33 / 1024,
                                             **{**(kvtier_params or {}), "prepare_slots": True})
    return {
        **mine,
        "fs": {"type": "fs", "base_path": os.path.join(root, "fs")},
        "fs O_DIRECT": {"type": "fs", "base_path": os.path.join(root, "fs-odirect"), "use_odirect": True},
        "fs_native": {"type": "fs_native", "base_path": os.path.join(root, "fs-native")},
        "fs_native O_DIRECT": {"type": "fs_native", "base_path": os.path.join(root, "fs-native-odirect"),
                               "use_odirect": True},
    }


def build(spec: dict):
    import argparse as _ap
    import json

    from lmcache.v1.distributed.l2_adapters import create_l2_adapter
    from lmcache.v1.distributed.l2_adapters.config import parse_args_to_l2_adapters_config

    for key in ("base_path",):
        if key in spec:
            os.makedirs(spec[key], exist_ok=True)
    [cfg] = parse_args_to_l2_adapters_config(_ap.Namespace(l2_adapter=[json.dumps(spec)])).adapters
    return create_l2_adapter(cfg)


def _wait(fd: int, timeout: float = 600.0) -> None:
    from lmcache.v1.platform import consume_fd

    p = select.poll()
    p.register(fd, select.POLLIN)
    if not p.poll(timeout * 1000):
        raise TimeoutError("adapter task did not complete")
    consume_fd(fd)


class Method:
    def __init__(self, name: str, spec: dict) -> None:
        self.name, self.spec = name, spec
        self.adapter = build(spec)
        self.dir = spec.get("base_path") or spec["adapter_params"]["ssd_path"]
        self.durable = name.startswith(KVTIER)

    def store(self, keys, objs) -> int:
        before = self._files() if not self.durable else set()
        tid = self.adapter.submit_store_task(keys, objs)
        done: dict = {}
        while tid not in done:
            _wait(self.adapter.get_store_event_fd())
            done.update(self.adapter.pop_completed_store_tasks())
        if not done[tid].is_successful():
            raise RuntimeError(f"{self.name}: store task failed")
        if not self.durable:  # counted when on disk: fsync what this batch created, and the directory
            for path in self._files() - before:
                fd = os.open(path, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
            fd = os.open(self.dir, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        return len(keys) * CHUNK_BYTES

    def load(self, keys, objs) -> int:
        from lmcache.v1.distributed.api import MemoryLayoutDesc

        a = self.adapter
        tid = a.submit_lookup_and_lock_task(keys, {0: MemoryLayoutDesc([CHUNK_SHAPE], [torch.bfloat16])})
        while (found := a.query_lookup_and_lock_result(tid)) is None:
            _wait(a.get_lookup_and_lock_event_fd())
        tid = a.submit_load_task(keys, objs)
        while (bm := a.query_load_result(tid)) is None:
            _wait(a.get_load_event_fd())
        a.submit_unlock(keys)
        got = sum(bm.test(i) for i in range(len(keys)))
        if got != len(keys) or sum(found.test(i) for i in range(len(keys))) != len(keys):
            raise RuntimeError(f"{self.name}: loaded {got} of {len(keys)} chunks")
        return got * CHUNK_BYTES

    def _files(self) -> set[str]:
        out = set()
        for base, _, names in os.walk(self.dir):
            out.update(os.path.join(base, n) for n in names)
        return out

    def close(self) -> None:
        self.adapter.close()


def one_repeat(r: int, root: str, n_batches: int, rows: dict[str, list[float]], l1, kvtier_params: dict,
               prepared: bool) -> None:
    from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey

    layout = MemoryLayoutDesc([CHUNK_SHAPE], [torch.bfloat16])
    _, src = l1.allocate(layout, PER_BATCH)
    _, dst = l1.allocate(layout, PER_BATCH)
    gen = torch.Generator().manual_seed(r)
    for o in src:
        o.raw_data.view(torch.uint8).copy_(torch.randint(0, 256, (o.get_size(),), dtype=torch.uint8, generator=gen))
    cap = n_batches * PER_BATCH * (CHUNK_BYTES + 4096) / (1 << 30) * 1.1 + 0.01
    specs = adapter_specs(os.path.join(root, f"r{r}"), cap, kvtier_params, prepared)
    methods = {name: Method(name, spec) for name, spec in specs.items()}
    order = list(methods)

    def keys_of(b: int, n: int = PER_BATCH) -> list:
        return [ObjectKey(chunk_hash=(r << 40 | b << 8 | i).to_bytes(16, "big"), model_name="bench/llama-3-8b",
                          kv_rank=ObjectKey.ComputeKVRank(1, 0, 1, 0)) for i in range(n)]

    try:
        if PREPARED in methods:
            t0 = time.perf_counter()
            methods[PREPARED].store(keys_of(255, 1), src[:1])  # batch 255: never a timed one
            assert methods[PREPARED].adapter._tier.wait_prepared(1800), "slot files not prepared"
            tqdm.write(f"  {PREPARED}: slot files prepared in {time.perf_counter() - t0:.1f} s (not timed)")
        for phase in ("store", "load"):
            for b in tqdm(range(n_batches), desc=f"repeat {r + 1}: {phase}", leave=False):
                # Rotate by len/n_batches per batch: over the run every adapter's positions average alike
                # (rotating by one per batch with fewer batches than adapters kept the last-listed ones late).
                k = (b * len(order)) // n_batches % len(order)
                batch_order = order[k:] + order[:k]
                if r == 0:
                    tqdm.write(f"  {phase} order, batch {b}: " + ", ".join(batch_order))
                for name in batch_order:
                    m = methods[name]
                    if phase == "load":
                        drop_page_cache()
                        for o in dst:
                            o.raw_data.zero_()
                    t0 = time.perf_counter()
                    n = m.store(keys_of(b), src) if phase == "store" else m.load(keys_of(b), dst)
                    rows.setdefault(f"{name} {phase}", []).append(n / (time.perf_counter() - t0) / 1e9)
                    if phase == "load" and b == 0 and not all(
                            torch.equal(x.raw_data, y.raw_data) for x, y in zip(src, dst)):
                        raise RuntimeError(f"{name}: loaded bytes differ from the stored ones")
    finally:
        for m in methods.values():
            m.close()
        l1.free(src + dst)
        shutil.rmtree(os.path.join(root, f"r{r}"), ignore_errors=True)


def paired(num: list[float], den: list[float]) -> float:
    return statistics.median(a / b for a, b in zip(num, den))


def best_of(rows: dict[str, list[float]], names: list[str]) -> list[float]:
    return [max(v) for v in zip(*(rows[n] for n in names))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="/var/tmp", help="directory on the disk to measure (a real disk, not tmpfs)")
    ap.add_argument("--gib", type=float, default=2.0, help="bytes stored and loaded per adapter and repeat")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--kvtier", action="append", default=[], metavar="KEY=VALUE",
                    help="an adapter_params key for kvtier's adapter, e.g. --kvtier o_direct=false (repeatable)")
    ap.add_argument("--prepared", action=argparse.BooleanOptionalAction, default=True,
                    help="also run kvtier's adapter with prepare_slots (slot files zeroed before the timed batches, "
                         "untimed); --no-prepared leaves it out")
    args = ap.parse_args()
    import json

    kvtier_params = {k: json.loads(v) for k, _, v in (p.partition("=") for p in args.kvtier)}
    kind = fs_type(os.path.abspath(args.dir))
    if kind in ("tmpfs", "ramfs", "overlay"):
        print(f"--dir {args.dir} is on {kind}, not a disk: choose a directory on the SSD", file=sys.stderr)
        return 2
    if not drop_page_cache():
        print("note: cannot drop the page cache (not root): loads are NOT cold", file=sys.stderr)
    from lmcache.v1.distributed.config import L1MemoryManagerConfig
    from lmcache.v1.distributed.memory_manager.l1_memory_manager import L1MemoryManager

    n_batches = max(1, int(args.gib * 1024 // 32 // PER_BATCH))
    root = tempfile.mkdtemp(prefix="mp-bench-", dir=args.dir)
    l1 = L1MemoryManager(L1MemoryManagerConfig(2 * PER_BATCH * CHUNK_BYTES + (64 << 20), False, align_bytes=4096,
                                               shm_name=""))
    print(f"{n_batches * PER_BATCH} chunks of 32 MiB per adapter and repeat ({n_batches} interleaved batches of "
          f"{PER_BATCH}), {args.repeats} repeats, in {root} ({kind}); cold loads, durable stores; kvtier "
          f"adapter_params {kvtier_params or 'defaults'}")
    rows: dict[str, list[float]] = {}
    try:
        for r in range(args.repeats):
            one_repeat(r, root, n_batches, rows, l1, kvtier_params, args.prepared)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"\n{'adapter (GB/s per batch)':<28}{'median':>8}{'p10':>7}{'p90':>7}")
    for k, v in rows.items():
        q = statistics.quantiles(v, n=10) if len(v) > 1 else v * 9
        print(f"{k:<28}{statistics.median(v):>8.2f}{q[0]:>7.2f}{q[-1]:>7.2f}")
    others = [n for n in adapter_specs(root, 1) if n != KVTIER]
    print("\nratios: median over batches of kvtier's GB/s / an LMCache adapter's GB/s in the same batch")
    for who in [w for w in (KVTIER, PREPARED) if f"{w} store" in rows]:
        for phase, target in (("load", 1.0), ("store", 1.2)):
            mine = rows[f"{who} {phase}"]
            best = max(others, key=lambda n: statistics.median(rows[f"{n} {phase}"]))
            med = paired(mine, rows[f"{best} {phase}"])
            print(f"  {phase:<5} {who} / the best LMCache adapter ({best}) = {med:5.2f}  (target >= {target}) "
                  f"{'PASS' if med >= target else 'miss'}")
            print(f"        {who} / the fastest LMCache adapter of each batch = "
                  f"{paired(mine, best_of(rows, [f'{n} {phase}' for n in others])):5.2f}  (stricter: max of 4 "
                  "noisy samples)")
            for n in others:
                print(f"        {who} / {n:<22} = {paired(mine, rows[f'{n} {phase}']):5.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
