"""Chunk get/put through the shared tier (a real Redis on 127.0.0.1) vs kvtier's local SSD tier, as ratios.

One real LMCache engine built from the shipped `configs/lmcache-kvtier-redis.yaml` (paths, port and sizes edited),
kvtier's `SharedTier` over its remote backend. Per round (interleaved, so drift hits both alike):
- put: `SharedTier.submit_writes` + `flush` of N host-tier chunks (Redis SET over the loopback) vs the SSD tier's
  durable write-through of the same chunks (`KVTierBackend` store + flush);
- get: `SharedTier.read` of the N chunks into the host tier vs the SSD tier's `read` (page cache warm: the file
  was just written; the loopback Redis is also the best case of a network store).
Reported: GB/s medians over rounds and the median of per-round ratios (shared / SSD). Then the third baseline,
recompute, from the project's cost model (`kvtier.sim.cost_model`, profile `--profile`, default Llama-3-8B on
one H100: MODELLED, not measured on this machine, which has no GPU): the time to prefill one chunk of that model
after `c` cached tokens (its marginal share of a longer prefill), against the time to read the same chunk's KV bytes at
the measured shared-tier and SSD-tier
get bandwidths (both are bandwidth-bound, so the measured GB/s carry over to that model's chunk size), as ratios
(load / recompute: below 1 loading wins), and the store bandwidth at which loading and recomputing break even.
For recompute measured on real prefills (the demo model on vLLM CPU) see `kvtier demo-shared` / `demo-vllm`.

    .venv/bin/python benchmarks/shared_tier.py [--chunks 16] [--rounds 5] [--dir /var/tmp] [--profile NAME]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

PORT = 16351


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chunks", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dir", default="/var/tmp")
    ap.add_argument("--profile", default="llama3-8b-h100", help="cost-model profile of the recompute baseline")
    ap.add_argument("--contexts", default="0,8192,32768",
                    help="cached tokens before the recomputed chunk (attention grows with the context)")
    ap.add_argument("--port", type=int, default=PORT, help="port of the benchmark's redis-server")
    args = ap.parse_args()

    from kvtier.configs import path as config_path
    from kvtier.launch.lmcache_engine import ModelShape, build_engine, destroy_engine
    from kvtier.launch.redis_server import RedisServer
    from kvtier.storage_backends.lmcache.backend import load_lmcache_config
    from kvtier.storage_backends.lmcache.engine_access import kvtier_plugin
    from kvtier.storage_backends.shared.config import SharedTierOptions
    from kvtier.storage_backends.shared.tier import attach_shared_tier

    shape = ModelShape("bench/llama-like", num_layers=8, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)
    chunk = 256
    cbytes = shape.chunk_bytes(chunk)
    with tempfile.TemporaryDirectory(prefix="kvtier-shared-bench-", dir=args.dir) as work:
        w = Path(work)
        text = Path(config_path("lmcache-kvtier-redis.yaml")).read_text()
        host_gb = 3 * args.chunks * cbytes / (1 << 30)
        text = (text.replace("/var/cache/kvtier", str(w / "ssd")).replace("redis://127.0.0.1:6379",
                                                                           f"redis://127.0.0.1:{args.port}")
                .replace("max_local_cpu_size: 5 ", f"max_local_cpu_size: {host_gb:.3f} ")
                .replace("kvtier.ssd_capacity_gb: 100", f"kvtier.ssd_capacity_gb: {4 * host_gb:.3f}"))
        (w / "lmcache.yaml").write_text(text)
        with RedisServer(args.port, w / "redis") as redis:
            engine = build_engine(load_lmcache_config(str(w / "lmcache.yaml")), shape)
            ssd = kvtier_plugin(engine)
            shared = attach_shared_tier(engine, lambda meta: True, "bench", SharedTierOptions(timeout_s=30.0))
            host = engine.storage_manager.storage_backends["LocalCPUBackend"]
            res: dict[str, list[float]] = {k: [] for k in ("shared_put", "ssd_put", "shared_get", "ssd_get")}
            try:
                for r in range(args.rounds):
                    n_tok = args.chunks * chunk
                    tokens = torch.arange(n_tok) + r * 10_000_000
                    kv = torch.randn(2, shape.num_layers, n_tok, shape.hidden).to(shape.dtype)
                    t0 = time.perf_counter()
                    engine.store(tokens, kvcaches=kv)
                    assert ssd.flush(120)
                    res["ssd_put"].append(time.perf_counter() - t0)  # includes the host copy
                    keys = [k for _, _, k in engine.token_database.process_tokens(tokens=tokens)]
                    t0 = time.perf_counter()
                    assert shared.submit_writes(keys) == len(keys) and shared.flush(120)
                    res["shared_put"].append(time.perf_counter() - t0)
                    t0 = time.perf_counter()
                    objs = ssd.read(keys)
                    res["ssd_get"].append(time.perf_counter() - t0)
                    assert all(o is not None for o in objs)
                    for o in objs:
                        o.ref_count_down()
                    t0 = time.perf_counter()
                    objs = shared.read(keys)
                    res["shared_get"].append(time.perf_counter() - t0)
                    assert all(o is not None for o in objs), shared.as_dict()
                    for o in objs:
                        o.ref_count_down()
                    host.clear()
                    redis.client().flushall()
                    shared._known.clear()  # measure real writes every round
            finally:
                shared.close()
                destroy_engine(engine)
    gb = args.chunks * cbytes / 1e9
    print(f"{args.chunks} chunks of {cbytes / 2**20:.0f} MiB ({gb:.2f} GB) per round, {args.rounds} rounds, "
          f"Redis on the loopback, SSD dir {args.dir}")
    for k, v in res.items():
        print(f"  {k:11s} median {gb / statistics.median(v):6.2f} GB/s  ({statistics.median(v) * 1e3:.0f} ms)")
    for op in ("put", "get"):
        ratio = statistics.median(s / d for s, d in zip(res[f"shared_{op}"], res[f"ssd_{op}"]))
        print(f"  {op}: shared tier takes {ratio:.2f}x the local SSD tier's time (median of per-round ratios)")
    recompute_baseline(args.profile, [int(c) for c in args.contexts.split(",")], chunk,
                       {t: gb / statistics.median(res[f"{t}_get"]) for t in ("shared", "ssd")})


def recompute_baseline(profile: str, contexts: list[int], chunk: int, get_gbps: dict[str, float]) -> None:
    """Print load / recompute ratios for one chunk of the cost model's model (recompute modelled, loads measured)."""
    from kvtier.sim.cost_model import get_profile

    prof = get_profile(profile)
    cbytes = prof.kv_bytes_per_token * chunk
    print(f"recompute baseline (MODELLED by kvtier's cost model, profile {profile}; no GPU here): one {chunk}-token "
          f"chunk = {cbytes / 2**20:.0f} MiB of KV; its load times use the gets' measured GB/s above")
    for c in contexts:
        rec = prof.prefill_time(chunk, c) - prof.prefill_overhead_s  # the chunk's share of a longer prefill
        parts = [f"{t} get {cbytes / (g * 1e9) * 1e3:6.1f} ms = {cbytes / (g * 1e9) / rec:5.2f}x"
                 for t, g in get_gbps.items()]
        print(f"  after {c:>6} cached tokens: recompute {rec * 1e3:6.2f} ms; {'; '.join(parts)} the recompute "
              f"time; break-even store bandwidth {cbytes / rec / 1e9:5.2f} GB/s")


if __name__ == "__main__":
    main()
