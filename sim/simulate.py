"""`kvtier simulate`: the command line of the scheduling simulator (`add_arguments`, `run`; registered in
`kvtier.cli.main`). It reads a trace, chooses the time scale (`calibrate_time_scale`), replays it under each
scheduler asked for, one GPU (`kvtier.sim.engine`) or several replicas with a shared tier (`--replicas`,
`--remote*`: `kvtier.sim.remote`), and prints, writes and plots the results (`kvtier.sim.report`).
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path

from kvtier.scheduler_hooks.dual_queue_policy import (
    DUAL_QUEUE_MODIFIERS,
    SCHEDULER_NAMES,
    DualQueueConfig,
    make_scheduling_policy,
)
from kvtier.sim.base import SimConfig, SimRequest, SimResult, load_trace
from kvtier.sim.cost_model import DEFAULT_PROFILE, PROFILES
from kvtier.sim.engine import calibrate_time_scale, simulate
from kvtier.sim.remote import ROUTINGS, RemoteConfig, route, run_cluster
from kvtier.sim.report import plot, print_cluster_table, print_table

logger = logging.getLogger(__name__)

__all__ = ["add_arguments", "cluster_wanted", "policy_config", "remote_config", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of `kvtier simulate`."""
    parser.add_argument("trace", help="request trace (Mooncake JSONL)")
    parser.add_argument("--scheduler", default="dual-queue",
                        help=f"one of {', '.join(SCHEDULER_NAMES)} (dual-queue names may combine "
                             f"+{', +'.join(DUAL_QUEUE_MODIFIERS)}), a comma-separated list, or 'all'")
    parser.add_argument("--json", dest="json_out", help="write the results here (JSON)")
    parser.add_argument("--plot", help="write a PNG plot here (TTFT CDF, queueing over time)")
    parser.add_argument("--time-scale", type=float, default=None,
                        help="multiply arrival times by this (default: chosen so FCFS keeps the GPU --load busy)")
    parser.add_argument("--load", type=float, default=0.85,
                        help="target FCFS GPU busy fraction for the default scale")
    parser.add_argument("--eviction", default="lru",
                        help="host-tier eviction policy (any registered production name)")
    parser.add_argument("--profile", default=DEFAULT_PROFILE, choices=sorted(PROFILES), help="cost profile")
    parser.add_argument("--limit", type=int, default=None, help="use only the first N requests")
    parser.add_argument("--start-s", type=float, default=None, help="use only requests arriving at or after this "
                        "trace second")
    parser.add_argument("--end-s", type=float, default=None,
                        help="use only requests arriving before this trace second")
    parser.add_argument("--host-gb", type=float, default=None, help="override the host tier's capacity (GB)")
    parser.add_argument("--delay-hit-threshold", type=int, default=100, help="tokens (default 100)")
    parser.add_argument("--starvation-multiple", type=float, default=4.0, help="x mean wait (default 4)")
    parser.add_argument("--starvation-floor", type=float, default=2.0, help="seconds (default 2)")
    parser.add_argument("--mean-window", type=int, default=None,
                        help="dispatched requests the starvation bound's mean wait is taken over "
                             "(default: the policy's)")
    parser.add_argument("--starvation-lookahead", action="store_true",
                        help="with +hrrn: a request goes next only if every older ready request can still start "
                             "within the starvation bound (`starvation_lookahead`)")
    parser.add_argument("--recompute-gpu-weight", type=float, default=None,
                        help="load plan: weight of GPU seconds next to TTFT (default: the policy's)")
    parser.add_argument("--ssd-read-share", type=float, default=0.5,
                        help="share of the SSD reads get while write-back is queued (default 0.5)")
    parser.add_argument("--ssd-write-buffer-gb", type=float, default=2.0,
                        help="queued write-back before writes are dropped (default 2, production's default)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    _add_cluster_arguments(parser)


def _schedulers(arg: str) -> list[str]:
    names = list(SCHEDULER_NAMES) if arg == "all" else [s.strip() for s in arg.split(",") if s.strip()]
    for n in names:
        try:
            make_scheduling_policy(n)
        except ValueError as e:
            raise SystemExit(f"kvtier simulate: {e}") from None
    return names


def policy_config(args: argparse.Namespace) -> DualQueueConfig:
    """kvtier's policy knobs from the arguments (the rest are the policy's defaults)."""
    cfg = DualQueueConfig(delay_hit_threshold_tokens=args.delay_hit_threshold,
                          starvation_multiple=args.starvation_multiple, starvation_floor_s=args.starvation_floor)
    if getattr(args, "mean_window", None) is not None:
        cfg = replace(cfg, mean_window=args.mean_window)
    if getattr(args, "starvation_lookahead", False):
        cfg = replace(cfg, starvation_lookahead=True)
    if getattr(args, "recompute_gpu_weight", None) is not None:
        cfg = replace(cfg, load_plan=replace(cfg.load_plan, recompute_gpu_weight=args.recompute_gpu_weight))
    return cfg


def run(args: argparse.Namespace) -> int:
    """Run `kvtier simulate`; 1 when some run did not complete every request."""
    from kvtier.storage_backends.eviction import production_policy_names

    names = _schedulers(args.scheduler)
    if args.eviction not in production_policy_names():
        raise SystemExit(f"kvtier simulate: unknown eviction policy {args.eviction!r}; "
                         f"choose from {', '.join(production_policy_names())}")
    reqs = load_trace(args.trace, args.limit, args.start_s, args.end_s)
    if not reqs:
        raise SystemExit(f"kvtier simulate: no requests in {args.trace}")
    base = SimConfig(
        profile=args.profile,
        eviction=args.eviction,
        policy=policy_config(args),
        host_bytes=int(args.host_gb * 1e9) if args.host_gb is not None else None,
        ssd_read_share=args.ssd_read_share,
        ssd_write_buffer_bytes=int(args.ssd_write_buffer_gb * (1 << 30)),
        progress=not args.no_progress,
    )
    span = reqs[-1].arrival - reqs[0].arrival or 1.0
    t0 = time.perf_counter()
    auto_scale, work = calibrate_time_scale(reqs, base, load=args.load)
    scale = args.time_scale if args.time_scale is not None else auto_scale
    load_factor = work / (span * scale)
    print(f"trace {args.trace}: {len(reqs)} requests over {span:.0f} s; profile {args.profile}, "
          f"eviction {args.eviction}")
    print(f"time scale {scale:.3f} ({'given' if args.time_scale is not None else 'auto'}): "
          f"load factor {load_factor:.3f} (FCFS GPU work {work:.0f} s / scaled span {span * scale:.0f} s)"
          f"  [calibration {time.perf_counter() - t0:.1f} s]")
    if cluster_wanted(args):
        return _run_cluster(args, reqs, base, names, scale)
    results: list[SimResult] = []
    for n in names:
        res = simulate(reqs, replace(base, scheduler=n, time_scale=scale))
        res.load_factor = load_factor
        results.append(res)
    print_table(results)
    if args.json_out:
        payload = results[0].to_json() if len(results) == 1 else {
            "time_scale": scale, "load_factor": load_factor, "runs": [r.to_json() for r in results]}
        Path(args.json_out).write_text(json.dumps(payload, indent=2) + "\n")
        print(f"wrote {args.json_out}")
    if args.plot:
        plot(results, args.plot)
        print(f"wrote {args.plot}")
    incomplete = [r.scheduler for r in results if r.completed + r.rejected != r.requests]
    if incomplete:
        logger.error("not every request completed under %s", ", ".join(incomplete))
        return 1
    return 0


# ---------------------------------------------------------------------------------------------------------------------
# replicas and a tier shared by them (`--replicas`, `--remote*`)


def _add_cluster_arguments(parser: argparse.ArgumentParser) -> None:
    """Replicas and a tier shared by them (issue 13; `kvtier.sim.remote`)."""
    d = RemoteConfig()
    parser.add_argument("--replicas", type=int, default=1, help="engine replicas, each with its own GPU, host and SSD "
                        "tier (default 1); the default time scale is divided by this")
    parser.add_argument("--routing", default="round-robin", choices=ROUTINGS, help="how requests reach replicas")
    parser.add_argument("--remote", action="store_true", help="add a tier shared by all replicas (defaults below)")
    parser.add_argument("--remote-gbps", type=float, default=None,
                        help=f"shared tier's link, gigabits/s per direction (implies --remote; "
                             f"default {d.gbps:g}: 10GbE)")
    parser.add_argument("--remote-latency-ms", type=float, default=None,
                        help=f"shared tier's latency per operation (implies --remote; default {d.latency_ms:g})")
    parser.add_argument("--remote-gb", type=float, default=None,
                        help=f"shared tier's capacity, GB, LRU (implies --remote; default {d.capacity_gb:g})")
    parser.add_argument("--remote-write-queue-mb", type=int, default=None,
                        help=f"writes queued per replica before they are dropped, MiB (implies --remote; default "
                             f"{d.write_queue_mb}: production's kvtier.shared.max_queued_write_mb)")


def remote_config(args: argparse.Namespace) -> RemoteConfig | None:
    """The shared tier the arguments ask for (None: none)."""
    given = {k: v for k, v in (("gbps", args.remote_gbps), ("latency_ms", args.remote_latency_ms),
                               ("capacity_gb", args.remote_gb), ("write_queue_mb", args.remote_write_queue_mb))
             if v is not None}
    if not (args.remote or given):
        return None
    try:
        return RemoteConfig(**given)
    except ValueError as e:
        raise SystemExit(f"kvtier simulate: {e}") from None


def cluster_wanted(args: argparse.Namespace) -> bool:
    """Whether the command runs replicas or a shared tier (`--replicas` other than 1, or any `--remote*`)."""
    return getattr(args, "replicas", 1) != 1 or remote_config(args) is not None


def _run_cluster(args: argparse.Namespace, reqs: Sequence[SimRequest], base: SimConfig, names: Sequence[str],
                 scale: float) -> int:
    """`kvtier simulate` with --replicas / --remote: every scheduler on the cluster."""
    remote = remote_config(args)
    try:
        route([], args.replicas, args.routing)
    except ValueError as e:
        raise SystemExit(f"kvtier simulate: {e}") from None
    scale = scale if args.time_scale is not None else scale / args.replicas
    print(f"{args.replicas} replica(s), routing {args.routing}, shared tier: "
          f"{asdict(remote) if remote else 'none'}; time scale {scale:.3f}")
    results = []
    t0 = time.perf_counter()
    for n in names:
        results.append(run_cluster(reqs, replace(base, scheduler=n, time_scale=scale), args.replicas, args.routing,
                                   remote))
    print_cluster_table(results)
    print(f"  [{time.perf_counter() - t0:.1f} s]")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"time_scale": scale, "runs": [r.to_json() for r in results]},
                                                  indent=2) + "\n")
        print(f"wrote {args.json_out}")
    return 0 if all(r.completed + r.rejected == r.requests for r in results) else 1

