"""Benchmark: how long a host-tier load takes when another thread wants the GIL (the engine loop).

    .venv/bin/python benchmarks/load_gil.py [--tokens 2048] [--chunk 64] [--page 32] [--repeats 15]

A load on kvtier's transfer thread is LMCache's `retrieve` (token hashing, storage look-ups) followed by kvtier's
page-first connector (`PageFirstGPUConnector.batched_to_gpu`: a transfer plan, then the scatter into vLLM's KV
tensors). Much of it is Python that calls many small torch operations, and each of those releases the GIL: when
another thread runs Python meanwhile (vLLM's engine loop, in the same process), the load waits for the GIL again
after each one, up to CPython's switch interval (5 ms). So what a load costs on a busy engine is roughly its
number of GIL hand-offs, not its bytes.

The benchmark builds a real LMCacheEngine (host tier only) with kvtier's page-first connector over vLLM-shaped
CPU KV tensors of the demo model's geometry (4 layers, 2 KV heads of 64, fp32, `CPU_ATTN` layout), stores a
`--tokens` history, then times the retrieve of the whole history into fresh blocks, `--repeats` times each:

- `quiet`: nothing else runs;
- `busy`: a second thread runs pure Python in a loop (a stand-in for the engine loop), as during a step.

`--switch-interval-ms 0.5` repeats it with a tenth of CPython's switch interval: a busy load that shrinks with it
was waiting for the GIL, not for memory or a lock. Printed per case: median / max of the whole retrieve and of the
connector part alone (ms), and the ratio busy /
quiet. Same process, interleaved, so a drifting machine hits both alike.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time

os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")

import torch  # noqa: E402

LAYERS, HEADS, HEAD_DIM = 4, 2, 64


def _engine(chunk: int, page: int, blocks: int, block_size: int):
    from lmcache.v1.cache_engine import LMCacheEngineBuilder
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.metadata import LMCacheMetadata

    from kvtier.kernels import KVLayoutKind, vllm_cache_shape
    from kvtier.storage_backends.lmcache.gpu_connector import PageFirstGPUConnector

    kind = KVLayoutKind.SPLIT_TOKEN_DIM
    caches = [torch.randn(vllm_cache_shape(kind, blocks, block_size, HEADS, HEAD_DIM)) for _ in range(LAYERS)]
    cfg = LMCacheEngineConfig.from_defaults(chunk_size=chunk, local_cpu=True, max_local_cpu_size=1.0,
                                            lmcache_instance_id="kvtier-load-gil")
    md = LMCacheMetadata(model_name="kvtier-bench", world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
                         kv_dtype=torch.float32, kv_shape=(LAYERS, 2, chunk, HEADS, HEAD_DIM), chunk_size=chunk)
    conn = PageFirstGPUConnector.from_metadata(md, kind, page)
    engine = LMCacheEngineBuilder.get_or_create("kvtier-load-gil", cfg, md, conn, lambda *a: None, lambda *a: None)
    engine.post_init()
    return engine, conn, caches


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--page", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--switch-interval-ms", type=float, default=None,
                    help="CPython's GIL switch interval for the run (default: CPython's, 5 ms); if a busy load "
                         "shrinks with it, the load was waiting for the GIL")
    args = ap.parse_args()
    if args.switch_interval_ms is not None:
        sys.setswitchinterval(args.switch_interval_ms / 1000)
    block = args.page
    blocks = 2 * args.tokens // block + 1
    engine, conn, caches = _engine(args.chunk, args.page, blocks, block)
    tokens = torch.randint(1, 1000, (args.tokens,))
    src = torch.arange(args.tokens // block)  # the history lives in blocks 0.., loads go to the second half
    slots = (src[:, None] * block + torch.arange(block)).reshape(-1)
    engine.store(tokens, kvcaches=caches, slot_mapping=slots)
    dst = slots + (args.tokens // block) * block

    spent = [0.0]
    inner = conn.batched_to_gpu

    def timed(*a, **kw):
        t = time.perf_counter()
        try:
            return inner(*a, **kw)
        finally:
            spent[0] += time.perf_counter() - t

    conn.batched_to_gpu = timed
    stop = threading.Event()

    def spin() -> None:  # pure Python, never releases the GIL by itself: the engine loop's share of it
        x = 0
        while not stop.is_set():
            for i in range(1000):
                x += i

    res: dict[str, dict[str, list[float]]] = {c: {"load": [], "connector": []} for c in ("quiet", "busy")}
    for r in range(args.repeats):
        for case in (("quiet", "busy") if r % 2 == 0 else ("busy", "quiet")):
            th = None
            if case == "busy":
                stop.clear()
                th = threading.Thread(target=spin, daemon=True)
                th.start()
                time.sleep(0.01)
            spent[0] = 0.0
            t0 = time.perf_counter()
            got = engine.retrieve(tokens, kvcaches=caches, slot_mapping=dst)
            dt = time.perf_counter() - t0
            if th is not None:
                stop.set()
                th.join()
            assert bool(got.all()), "the history did not come back whole"
            res[case]["load"].append(1000 * dt)
            res[case]["connector"].append(1000 * spent[0])
    print(f"retrieve of {args.tokens} tokens ({args.tokens // args.chunk} chunks of {args.chunk}, {args.page}-token "
          f"pages), {args.repeats} repeats, switch interval {1000 * sys.getswitchinterval():.1f} ms")
    print(f"{'case':<8}{'load p50':>10}{'load max':>10}{'connector p50':>15}{'connector max':>15}   (ms)")
    for case, d in res.items():
        print(f"{case:<8}{statistics.median(d['load']):>10.2f}{max(d['load']):>10.2f}"
              f"{statistics.median(d['connector']):>15.2f}{max(d['connector']):>15.2f}")
    q, b = res["quiet"], res["busy"]
    print(f"busy / quiet (medians): load {statistics.median(b['load']) / statistics.median(q['load']):.1f}x, "
          f"connector {statistics.median(b['connector']) / statistics.median(q['connector']):.1f}x")
    from lmcache.v1.cache_engine import LMCacheEngineBuilder

    LMCacheEngineBuilder.destroy("kvtier-load-gil")
    return 0


if __name__ == "__main__":
    sys.exit(main())
