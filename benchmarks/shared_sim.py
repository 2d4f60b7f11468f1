"""Benchmark of the shared tier at cluster scale (issue 13), simulated: N replicas behind a round-robin router, each
with its own GPU queue, host tier and SSD tier, with and without one store shared by all (`kvtier.sim.remote`).

    .venv/bin/python benchmarks/shared_sim.py PATH/TO/mooncake_conversation_first30min.jsonl \\
        [--replicas 2,4] [--load 0.85] [--json OUT]

The trace is not shipped with kvtier: mooncake_conversation_first30min.jsonl is the first 30 minutes (timestamp
< 1,800,000 ms) of conversation_trace.jsonl in the public Mooncake repository
(https://github.com/kvcache-ai/Mooncake, folder FAST25-release/traces); see docs/development.md, 'Traces'.

Held out: the second 15 minutes of the trace (timestamp >= 900 s; cold tiers). Nothing is tuned here: kvtier's
scheduler and knobs are `benchmarks/scheduler_sim.py`'s `TUNED` (chosen on the first 15 minutes), the shared
tier's numbers are `RemoteConfig`'s documented defaults (10 Gbit/s, 0.5 ms, 64 GB, LRU; production's 256 MiB write
queue per replica), the same with a 4 GiB write queue, and a "fast store" (100 Gbit/s, 1 TB, 4 GiB queue) to show
what the write queue, the link and the capacity limit. Load:
arrival times scaled so that one GPU under `fcfs` would be `--load` busy with the whole trace, divided by N (each
replica gets that load under round-robin).

Rows per N: `recompute` (no tiers: vLLM's prefix cache only), `fcfs+prefetch` local and + shared tier (the fair
baselines a user would configure), kvtier local-only, kvtier + shared tier (default and fast store), and kvtier
local-only with `sticky` routing (conversation affinity) for reference. Printed: hits per tier (tokens), mean
queueing, P99 TTFT, completed, the store's traffic, and ratios of kvtier + shared tier against kvtier local-only and
against the best fair baseline (lowest of `recompute` and `fcfs+prefetch` with or without the shared tier).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace

from kvtier.benchmarks.scheduler_sim import SPLIT_S, TUNED, policy_config  # the scheduling benchmark's tuned knobs
from kvtier.sim.base import SimConfig, load_trace
from kvtier.sim.engine import calibrate_time_scale
from kvtier.sim.remote import ClusterResult, RemoteConfig, run_cluster

DEFAULT_STORE = RemoteConfig()
BIG_QUEUE_STORE = RemoteConfig(write_queue_mb=4096)
FAST_STORE = RemoteConfig(gbps=100.0, capacity_gb=1000.0, write_queue_mb=4096)


def rows(reqs, base: SimConfig, n: int, scale: float) -> dict[str, ClusterResult]:
    best = TUNED["scheduler"]
    pol = policy_config(TUNED)
    k = replace(base, scheduler=best, time_scale=scale, policy=pol)
    fp = replace(base, scheduler="fcfs+prefetch", time_scale=scale)
    plan = {
        "recompute": (replace(base, scheduler="recompute", time_scale=scale), "round-robin", None),
        "fcfs+prefetch local": (fp, "round-robin", None),
        "fcfs+prefetch + shared": (fp, "round-robin", DEFAULT_STORE),
        "kvtier local": (k, "round-robin", None),
        "kvtier + shared": (k, "round-robin", DEFAULT_STORE),
        "kvtier + shared, 4G queue": (k, "round-robin", BIG_QUEUE_STORE),
        "kvtier + fast shared": (k, "round-robin", FAST_STORE),
        "kvtier local, sticky": (k, "sticky", None),
    }
    out = {}
    for name, (cfg, routing, store) in plan.items():
        out[name] = run_cluster(reqs, cfg, n, routing, store)
    return out


def print_rows(runs: dict[str, ClusterResult]) -> None:
    print(f"  {'configuration':<27}{'done':>6}{'queue mean':>11}{'TTFT p99':>9}{'gpu':>7}{'host':>7}{'ssd':>7}"
          f"{'remote':>7}{'computed':>9}  (tokens: M)")
    for name, r in runs.items():
        h = r.hits
        print(f"  {name:<27}{r.completed:>6}{r.mean_queue_s:>11.2f}{r.p99_ttft_s:>9.2f}{h['gpu'] / 1e6:>7.2f}"
              f"{h['host'] / 1e6:>7.2f}{h['ssd'] / 1e6:>7.2f}{h['remote'] / 1e6:>7.2f}{h['computed'] / 1e6:>9.2f}")
    for name, r in runs.items():
        s = r.remote_stats
        if s:
            print(f"    {name}: store read {s['read_gb']:.0f} GB, wrote {s['written_gb']:.0f} GB, dropped "
                  f"{s['dropped_write_gb']:.0f} GB ({s['dropped_writes']} writes, full write queue), "
                  f"{s['evictions']} evictions; link busy: reads {s['read_link_util']:.0%}, writes "
                  f"{s['write_link_util']:.0%}")


def ratios(runs: dict[str, ClusterResult]) -> dict[str, float]:
    fair = [runs[x] for x in ("recompute", "fcfs+prefetch local", "fcfs+prefetch + shared")]
    bq = min(r.mean_queue_s for r in fair)
    bt = min(r.p99_ttft_s for r in fair)
    loc = runs["kvtier local"]
    out = {}
    for name in ("kvtier local", "kvtier + shared", "kvtier + shared, 4G queue", "kvtier + fast shared"):
        r = runs[name]
        out[f"{name} / best fair baseline: mean queue"] = r.mean_queue_s / bq
        out[f"{name} / best fair baseline: P99 TTFT"] = r.p99_ttft_s / bt
        if name != "kvtier local":
            out[f"{name} / kvtier local: mean queue"] = r.mean_queue_s / loc.mean_queue_s
            out[f"{name} / kvtier local: P99 TTFT"] = r.p99_ttft_s / loc.p99_ttft_s
            out[f"{name} / kvtier local: computed tokens"] = r.hits["computed"] / loc.hits["computed"]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace", help="Mooncake conversation trace (JSONL), at least 30 minutes, e.g. "
                    "mooncake_conversation_first30min.jsonl: the first 30 minutes of conversation_trace.jsonl "
                    "from https://github.com/kvcache-ai/Mooncake (FAST25-release/traces); "
                    "see docs/development.md")
    ap.add_argument("--replicas", default="2,4")
    ap.add_argument("--load", type=float, default=0.85)
    ap.add_argument("--profile", default="llama3-8b-h100")
    ap.add_argument("--json", dest="json_out")
    args = ap.parse_args(argv)
    held = load_trace(args.trace, start_s=SPLIT_S)
    if not held:
        raise SystemExit(f"{args.trace}: no requests at or after {SPLIT_S:.0f} s (need the 30-minute trace)")
    base = SimConfig(profile=args.profile)
    scale1, work = calibrate_time_scale(held, base, load=args.load)
    print(f"held out: {len(held)} requests (timestamp >= {SPLIT_S:.0f} s); one-GPU time scale {scale1:.3f} "
          f"(fcfs load {args.load}); kvtier = {TUNED}; shared tier {DEFAULT_STORE}, 4G queue {BIG_QUEUE_STORE}, "
          f"fast {FAST_STORE}")
    report = {"trace": args.trace, "load": args.load, "tuned": TUNED, "replicas": {}}
    ok = True
    for n in [int(x) for x in args.replicas.split(",")]:
        t0 = time.perf_counter()
        scale = scale1 / n
        runs = rows(held, base, n, scale)
        print(f"\n== {n} replicas, round-robin, time scale {scale:.3f} ({time.perf_counter() - t0:.0f} s)")
        print_rows(runs)
        rt = ratios(runs)
        for k, v in rt.items():
            print(f"  {k}: {v:.3f}x")
        done = {r.completed + r.rejected for r in runs.values()}
        ok &= done == {len(held)}
        print(f"  [{'PASS' if done == {len(held)} else 'FAIL'}] every configuration completed every request")
        report["replicas"][str(n)] = {"time_scale": scale, "ratios": rt,
                                      "runs": {k: v.to_json() for k, v in runs.items()}}
    if args.json_out:
        with open(args.json_out, "w") as fh:
            json.dump(report, fh, indent=2)
        print(f"wrote {args.json_out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
