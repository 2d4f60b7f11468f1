"""`kvtier demo`: the LMCache-level demo. Replays a multi-turn conversation slice through a real LMCacheEngine, twice.

Run 1 is LMCache with its host tier only; run 2 adds kvtier's SSD tier through `storage_plugins: [kvtier]`.
Each request of the Mooncake conversation trace (one id per 512-token prompt block; a follow-up turn repeats its
history's ids) becomes token ids, scaled down (`--block-tokens`) to fit a laptop. For every request the demo looks
its prefix up, retrieves what the tiers hold, checks every retrieved byte against the KV it expects (never wrong
KV), "computes" the rest and stores the whole prompt. It prints hits per tier, bytes and throughput, and the ratio
of the two runs.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field

import torch

from kvtier.cli.engine_args import add_engine_arguments

logger = logging.getLogger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_engine_arguments(p, block_tokens=32, host_mb=48, ssd_mb=1024)
    p.add_argument("--requests", type=int, default=None, help="replay only the first N requests")
    p.add_argument("--ssd-path", default=None, help="SSD tier directory (default: a temporary one)")


@dataclass
class RunResult:
    name: str
    requests: int = 0
    prompt_tokens: int = 0
    hit_tokens: dict[str, int] = field(default_factory=lambda: {"host": 0, "ssd": 0})
    retrieve_s: float = 0.0
    store_s: float = 0.0
    bytes_retrieved: int = 0
    wrong_kv: int = 0
    wall_s: float = 0.0


def _chunk_kv(prefix_digest: bytes, shape, chunk: int) -> torch.Tensor:
    """The KV a model would compute for a chunk: a deterministic function of the whole prefix up to it."""
    g = torch.Generator().manual_seed(int.from_bytes(prefix_digest[:8], "little") & ((1 << 63) - 1))
    return torch.randn(2, shape.num_layers, chunk, shape.hidden, generator=g).to(shape.dtype)


def _replay(name: str, yaml_text: str, requests, shape, block_tokens: int, chunk: int) -> RunResult:
    from tqdm import tqdm

    from kvtier.launch.lmcache_engine import build_engine, destroy_engine
    from kvtier.storage_backends.lmcache.backend import load_lmcache_config
    from kvtier.storage_backends.lmcache.engine_access import kvtier_plugin

    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        f.write(yaml_text)
    engine = build_engine(load_lmcache_config(f.name), shape)
    os.unlink(f.name)
    plugin = kvtier_plugin(engine)
    res = RunResult(name)
    per_token = 2 * shape.num_layers * shape.hidden * torch.empty((), dtype=shape.dtype).element_size()
    t_start = time.perf_counter()
    try:
        for req in tqdm(requests, desc=f"{name:>18}", unit="req", leave=True):
            # Token ids: block id b -> block_tokens distinct ids; equal ids = equal prefix blocks.
            ids = torch.tensor([b * block_tokens + i for b in req.hash_ids for i in range(block_tokens)])
            n = min(len(ids), req.input_length * block_tokens // 512) // chunk * chunk
            ids = ids[:n]
            if n == 0:
                continue
            digests, h = [], hashlib.sha256()
            for c in range(n // chunk):
                h.update(ids[c * chunk:(c + 1) * chunk].numpy().tobytes())
                digests.append(h.copy().digest())
            # Which tier holds which part of the prefix (LMCache checks its tiers in order: host, then kvtier).
            keys = [k for _, _, k in engine.token_database.process_tokens(tokens=ids)]
            _, mapping = engine.storage_manager.batched_contains(keys)
            host_hit = len(mapping.get("LocalCPUBackend", [])) * chunk
            ssd_hit = sum(len(v) for k, v in mapping.items() if k != "LocalCPUBackend") * chunk
            kv = torch.zeros(2, shape.num_layers, n, shape.hidden, dtype=shape.dtype)
            t0 = time.perf_counter()
            got = int(engine.retrieve(ids, kvcaches=kv).sum()) if host_hit + ssd_hit else 0
            res.retrieve_s += time.perf_counter() - t0
            res.bytes_retrieved += got * per_token
            for c in range(got // chunk):  # every retrieved byte must be the KV of that exact prefix
                if not torch.equal(kv[:, :, c * chunk:(c + 1) * chunk].view(torch.int16),
                                   _chunk_kv(digests[c], shape, chunk).view(torch.int16)):
                    res.wrong_kv += 1
            served_host = min(got, host_hit)
            res.hit_tokens["host"] += served_host
            res.hit_tokens["ssd"] += got - served_host
            for c in range(got // chunk, n // chunk):  # "prefill" the rest
                kv[:, :, c * chunk:(c + 1) * chunk] = _chunk_kv(digests[c], shape, chunk)
            t0 = time.perf_counter()
            engine.store(ids, kvcaches=kv)
            res.store_s += time.perf_counter() - t0
            res.requests += 1
            res.prompt_tokens += n
        if plugin is not None:
            plugin.flush(120)
    finally:
        res.wall_s = time.perf_counter() - t_start
        destroy_engine(engine)
    return res


def run(args: argparse.Namespace) -> int:
    logging.getLogger("lmcache").setLevel(logging.WARNING)
    os.environ.setdefault("LMCACHE_LOG_LEVEL", "ERROR")  # LMCache logs every host-pool eviction retry
    from kvtier.launch.lmcache_engine import ModelShape
    from kvtier.replay.traces import input_error, read_mooncake

    chunk = args.block_tokens
    shape = ModelShape("kvtier-demo/llama-mini", num_layers=4, num_kv_heads=4, head_dim=64, dtype=torch.bfloat16)
    try:
        requests = read_mooncake(args.trace, limit=args.requests)
    except (OSError, ValueError) as e:  # the trace cannot be read: say which line, no traceback
        print(f"--trace: {input_error(e)}")
        return 2
    ssd_dir = args.ssd_path or tempfile.mkdtemp(prefix="kvtier-demo-")
    if args.ssd_path is None:
        ssd_dir = os.path.join(ssd_dir, "ssd")
    base = (f"chunk_size: {chunk}\nlocal_cpu: true\nmax_local_cpu_size: {args.host_mb / 1024:.6f}\n"
            "pre_caching_hash_algorithm: sha256_cbor\nsave_unfull_chunk: false\n")
    with_ssd = base + (
        'storage_plugins: ["kvtier"]\nextra_config:\n'
        "  storage_plugin.kvtier.module_path: kvtier.storage_backends\n"
        "  storage_plugin.kvtier.class_name: KVTierBackend\n"
        f"  kvtier.ssd_path: {ssd_dir}\n  kvtier.ssd_capacity_gb: {args.ssd_mb / 1024:.6f}\n")
    chunk_kib = shape.chunk_bytes(chunk) / 1024
    print(f"kvtier demo: {len(requests)} requests of {args.trace}\n"
          f"  model KV: {shape.num_layers} layers x {shape.num_kv_heads} KV heads x {shape.head_dim} dims, "
          f"{chunk}-token chunks of {chunk_kib:.0f} KiB; host tier {args.host_mb:g} MiB, SSD tier {args.ssd_mb:g} "
          f"MiB at {ssd_dir}")
    results = [
        _replay("LMCache host only", base, requests, shape, args.block_tokens, chunk),
        _replay("LMCache + kvtier", with_ssd, requests, shape, args.block_tokens, chunk),
    ]
    _report(results)
    if args.ssd_path is None:
        shutil.rmtree(os.path.dirname(ssd_dir), ignore_errors=True)
    return 1 if any(r.wrong_kv for r in results) else 0


def _report(results: list[RunResult]) -> None:
    print()
    head = (f"{'run':<20}{'prompt tok':>11}{'host hits':>11}{'SSD hits':>10}{'hit rate':>9}"
            f"{'load GB/s':>10}{'retrieve s':>11}{'store s':>9}{'wall s':>8}{'wrong KV':>9}")
    print(head)
    print("-" * len(head))
    for r in results:
        hits = r.hit_tokens["host"] + r.hit_tokens["ssd"]
        gbps = r.bytes_retrieved / r.retrieve_s / 1e9 if r.retrieve_s else 0.0
        print(f"{r.name:<20}{r.prompt_tokens:>11}{r.hit_tokens['host']:>11}{r.hit_tokens['ssd']:>10}"
              f"{hits / max(1, r.prompt_tokens):>9.1%}{gbps:>10.2f}{r.retrieve_s:>11.2f}{r.store_s:>9.2f}"
              f"{r.wall_s:>8.1f}{r.wrong_kv:>9}")
    a, b = results
    ha = a.hit_tokens["host"] + a.hit_tokens["ssd"]
    hb = b.hit_tokens["host"] + b.hit_tokens["ssd"]
    print(f"\nkvtier serves {hb / max(1, ha):.2f}x the cached prompt tokens of LMCache's host tier alone "
          f"({hb} vs {ha}); {b.hit_tokens['ssd']} of them came from the SSD tier. Tokens not served are prefilled.")
