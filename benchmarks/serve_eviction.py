"""The host tier's eviction policies measured in the engine at serving scale: `vllm serve` with kvtier's connector,
one server per policy, driven by aiperf (issue 50).

    .venv/bin/python benchmarks/serve_eviction.py --aiperf /tmp/aiperf-venv/bin/aiperf [--rounds 3]
        [--policies lru,answer-length,adaptive] [--host-fractions 0.02,0.05,0.10] [--json out.json]

The workload is `benchmarks/serve_aiperf.py`'s `reuse` (the shipped Mooncake conversations, aiperf's
`mooncake_trace` loader at a fixed concurrency, a new `--random-seed` per round so no round finds another's KV).
For each host-tier size, one server per policy (the policy in both tiers: the host tier's `cache_policy:
KVTIER_<NAME>` and `kvtier.eviction_policy`), the same vLLM settings as serve_aiperf's `kvtier` server and a roomy
SSD tier of its own; the sizes are fractions of the run's unique chunks (every round's distinct whole-chunk prompt
prefixes, rounds times one round's), so a policy has to choose what to keep. Per round the servers of one size run
one after another in an order that rotates by one each round.

Printed per size and policy, min / median / max over rounds: host-tier and SSD-tier hit tokens (the connector's
/metrics deltas), follow-up-turn TTFT mean and p99; and, paired by round against `lru` (the shipped default):
host hit tokens minus LRU's and LRU's follow-up TTFT mean over the policy's (>1: faster than LRU).
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from serve_aiperf import (  # the sibling module (benchmarks/ is the script's sys.path[0])
    follow_ups,
    hf_cache,
    kvtier_hits,
    kvtier_server_args,
    kvtier_yaml,
    read_trace,
    run_aiperf,
    scale,
    summarize,
    vllm_server_args,
    write_jsonl,
)
from serve_report import spread

from kvtier.demo_data import path as data_path
from kvtier.launch.demo_model import KV_BYTES_PER_TOKEN, build
from kvtier.storage_backends.eviction import production_policy_names
from kvtier.storage_backends.lmcache.host_policy import lmcache_name
from kvtier.testing.serve_process import ServeProcess, free_port

PAGE, CHUNK = 32, 64
BASELINE = "lru"


def unique_chunks(rows: list[dict[str, Any]], block: int, chunk: int) -> int:
    """Distinct whole-chunk prompt prefixes of one round (a chunk is `chunk // block` trace blocks)."""
    per = max(1, chunk // block)
    return len({tuple(r["hash_ids"][:per * k]) for r in rows for k in range(1, len(r["hash_ids"]) // per + 1)})


def report(results: dict[str, dict[str, list[dict[str, float]]]], policies: list[str]) -> None:
    """Per size: each policy's spread over rounds, and its paired comparison with LRU."""
    for size, by in results.items():
        n = min(len(v) for v in by.values())
        print(f"\nhost tier {size}: min / median / max over {n} round(s)")
        head = f"{'policy':<15}{'host hit tok':>26}{'SSD hit tok':>26}{'follow mean ms':>24}{'follow p99 ms':>24}"
        print(head)
        print("-" * len(head))
        for pol in policies:
            runs = by[pol][:n]
            cells = []
            for k in ("kvtier_host", "kvtier_ssd", "ttft_follow_mean", "ttft_follow_p99"):
                lo, md, hi = spread([r[k] for r in runs])
                cells.append(f"{lo:.0f} / {md:.0f} / {hi:.0f}")
            print(f"{pol:<15}{cells[0]:>26}{cells[1]:>26}{cells[2]:>24}{cells[3]:>24}")
        if BASELINE not in by:
            continue
        base = by[BASELINE][:n]
        for pol in policies:
            if pol == BASELINE:
                continue
            runs = by[pol][:n]
            dhost = [r["kvtier_host"] - b["kvtier_host"] for r, b in zip(runs, base)]
            speed = [b["ttft_follow_mean"] / r["ttft_follow_mean"] for r, b in zip(runs, base)
                     if r["ttft_follow_mean"] > 0]
            lo, md, hi = spread(dhost)
            slo, smd, shi = spread(speed)
            verdict = ("ahead of LRU" if slo > 1 and lo > 0 else "behind LRU" if shi < 1 and hi < 0
                       else "within the spread")
            print(f"  {pol} vs {BASELINE}, paired by round: host hit tokens {lo:+.0f} / {md:+.0f} / {hi:+.0f}; "
                  f"follow-up mean TTFT {slo:.3f} / {smd:.3f} / {shi:.3f}x LRU's speed ({verdict})")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--aiperf", default=shutil.which("aiperf") or "aiperf", help="the aiperf command")
    p.add_argument("--trace", default=data_path("mooncake_conversation_sessions.jsonl"))
    p.add_argument("--requests", type=int, default=0, help="use only the first N requests of the trace (0: all)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--policies", default="lru,answer-length,adaptive", help="comma-separated production policies")
    p.add_argument("--host-fractions", default="0.02,0.05,0.10",
                   help="host-tier sizes as fractions of the run's unique chunks")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--block-tokens", type=int, default=32, help="tokens per 512-token trace block")
    p.add_argument("--max-prompt-tokens", type=int, default=1536, help="hold out longer (scaled) requests")
    p.add_argument("--max-answer-tokens", type=int, default=24)
    p.add_argument("--gpu-blocks", type=int, default=160, help="vLLM KV cache, in 32-token blocks")
    p.add_argument("--ssd-mb", type=float, default=1024, help="each server's SSD tier (roomy)")
    p.add_argument("--workdir", default=None, help="keep logs and aiperf artifacts here")
    p.add_argument("--port", type=int, default=18160, help="first port to try")
    p.add_argument("--timeout", type=float, default=1800, help="seconds one aiperf run may take")
    p.add_argument("--json", default=None, help="write all summaries here")
    args = p.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the servers (finally below) when killed
    policies = [x.strip() for x in args.policies.split(",") if x.strip()]
    unknown = [x for x in policies if x not in production_policy_names()]
    if unknown or not policies:
        print(f"--policies: choose from {', '.join(production_policy_names())}; got {args.policies!r}")
        return 2
    fractions = [float(x) for x in args.host_fractions.split(",") if x.strip()]
    if not shutil.which(args.aiperf) and not Path(args.aiperf).exists():
        print(f"aiperf not found ({args.aiperf}); see benchmarks/serve_aiperf.py for its own environment")
        return 2

    own = args.workdir is None
    work = Path(tempfile.mkdtemp(prefix="kvtier-eviction-bench-") if own else args.workdir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    rows, held = scale(read_trace(args.trace)[:args.requests or None], args.block_tokens, args.max_prompt_tokens,
                       args.max_answer_tokens)
    follow = follow_ups(rows)
    trace = work / "reuse.jsonl"
    write_jsonl(trace, rows)
    model = Path(build(str(work / "model")))
    hf_home = work / "hf"
    hf_cache(model, hf_home)
    vllm_args = vllm_server_args(args, PAGE)
    per_round = unique_chunks(rows, args.block_tokens, CHUNK)
    run_chunks = per_round * args.rounds
    chunk_mb = CHUNK * KV_BYTES_PER_TOKEN / 2**20
    print(f"eviction benchmark: {len(rows)} requests of {args.trace} ({held} held out), {sum(follow)} follow-up "
          f"turns, concurrency {args.concurrency}, {args.rounds} round(s); {per_round} unique chunks a round, "
          f"{run_chunks} in the run ({run_chunks * chunk_mb:.0f} MiB); policies {', '.join(policies)}")
    results: dict[str, dict[str, list[dict[str, float]]]] = {}
    for frac in fractions:
        host_mb = frac * run_chunks * chunk_mb
        size = f"{frac:.0%} ({host_mb:.1f} MiB, {frac * run_chunks:.0f} chunks)"
        print(f"\n== host tier {size}", flush=True)
        results[size] = {pol: [] for pol in policies}
        servers: dict[str, ServeProcess] = {}
        try:
            for pol in policies:
                name = f"{pol}-{frac:g}"
                yaml = kvtier_yaml(work / f"{name}.yaml", CHUNK, host_mb, str(work / f"ssd-{name}"), args.ssd_mb,
                                   lmcache_lines=f"cache_policy: {lmcache_name(pol)}\n",
                                   kvtier_lines=f"  kvtier.eviction_policy: {pol}\n")
                servers[pol] = ServeProcess(name, work, model, free_port(args.port), vllm_args,
                                            kvtier_server_args(yaml))
            deadline = time.monotonic() + 900
            for s in servers.values():
                s.wait_ready(deadline)
            for rnd in range(args.rounds):
                k = rnd % len(policies)
                for pol in policies[k:] + policies[:k]:
                    srv = servers[pol]
                    t0 = time.monotonic()
                    before = srv.metrics()
                    res = summarize(run_aiperf(args.aiperf, srv, trace, work / f"r{rnd}-{srv.name}", args,
                                               1000 + rnd, hf_home), follow)
                    res.update(kvtier_hits(before, srv.metrics()))
                    results[size][pol].append(res)
                    print(f"  round {rnd + 1} {pol:<14}: {res['requests']:.0f} requests ({res['errors']:.0f} errors), "
                          f"host hits {res['kvtier_host']:.0f}, SSD hits {res['kvtier_ssd']:.0f} tokens, follow-up "
                          f"TTFT mean {res['ttft_follow_mean']:.0f} ms, p99 {res['ttft_follow_p99']:.0f} ms "
                          f"[{time.monotonic() - t0:.0f} s]", flush=True)
        finally:
            for s in servers.values():
                s.stop()
    report(results, policies)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "held_out": held, "unique_chunks_per_round":
                                               per_round, "results": results}, indent=1))
    if own:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
