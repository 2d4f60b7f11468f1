"""`kvtier simulate`: the command line of the scheduling simulator (`add_arguments`, `run`; registered in
`kvtier.cli.main`). It reads a trace, chooses the time scale (`calibrate_time_scale`), replays it under each
scheduler asked for, one GPU (`kvtier.sim.engine`) or several replicas with a shared tier (`--replicas`,
`--remote*`: `kvtier.sim.remote`), and prints, writes and plots the results (`kvtier.sim.report`).
`--kv-transfer-config FILE` runs the scheduler, its knobs, the host tier's eviction policy and size that a vLLM
`--kv-transfer-config` JSON (or an LMCache YAML) sets (`kvtier.replay.transfer_config`) instead of the flags.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from kvtier.replay.engine_model import format_differences
from kvtier.replay.traces import input_error
from kvtier.scheduler_hooks.dual_queue_policy import (
    DUAL_QUEUE_MODIFIERS,
    SCHEDULER_KEYS,
    SCHEDULER_NAMES,
    DualQueueConfig,
    make_scheduling_policy,
)
from kvtier.sim.base import SimConfig, SimRequest, SimResult, load_trace
from kvtier.sim.cost_model import DEFAULT_PROFILE, PROFILES
from kvtier.sim.engine import calibrate_time_scale, simulate
from kvtier.sim.remote import ROUTINGS, RemoteConfig, route, run_cluster
from kvtier.sim.report import plot, print_admission, print_cluster_table, print_table
from kvtier.storage_backends.admission.config import POLICIES as ADMISSION_POLICIES

logger = logging.getLogger(__name__)

__all__ = ["add_arguments", "cluster_wanted", "policy_config", "remote_config", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of `kvtier simulate`."""
    parser.add_argument("trace", help="request trace (Mooncake JSONL)")
    parser.add_argument("--scheduler", default=None,
                        help=f"one of {', '.join(SCHEDULER_NAMES)} (dual-queue names may combine "
                             f"+{', +'.join(DUAL_QUEUE_MODIFIERS)}), a comma-separated list, or 'all' "
                             f"(default {DEFAULT_SCHEDULER})")
    parser.add_argument("--kv-transfer-config", metavar="FILE", default=None,
                        help="run the scheduler, its kvtier.scheduler knobs, the host tier's cache_policy and "
                             "max_local_cpu_size that this vLLM --kv-transfer-config JSON (or LMCache YAML) sets; "
                             f"not with {', '.join(FILE_FLAGS.values())}")
    parser.add_argument("--json", dest="json_out", help="write the results here (JSON)")
    parser.add_argument("--plot", help="write a PNG plot here (TTFT CDF, queueing over time)")
    parser.add_argument("--time-scale", type=float, default=None,
                        help="multiply arrival times by this (default: chosen so FCFS keeps the GPU --load busy)")
    parser.add_argument("--load", type=float, default=0.85,
                        help="target FCFS GPU busy fraction for the default scale")
    parser.add_argument("--eviction", default=None,
                        help=f"host-tier eviction policy (any registered production name; default {DEFAULT_EVICTION})")
    parser.add_argument("--profile", default=DEFAULT_PROFILE, choices=sorted(PROFILES), help="cost profile")
    parser.add_argument("--limit", type=int, default=None, help="use only the first N requests")
    parser.add_argument("--start-s", type=float, default=None, help="use only requests arriving at or after this "
                        "trace second")
    parser.add_argument("--end-s", type=float, default=None,
                        help="use only requests arriving before this trace second")
    parser.add_argument("--host-gb", type=float, default=None, help="override the host tier's capacity (GB)")
    parser.add_argument("--delay-hit-threshold", type=int, default=None, help="tokens (default 100)")
    parser.add_argument("--starvation-multiple", type=float, default=None, help="x mean wait (default 4)")
    parser.add_argument("--starvation-floor", type=float, default=None, help="seconds (default 2)")
    parser.add_argument("--mean-window", type=int, default=None,
                        help="dispatched requests the starvation bound's mean wait is taken over "
                             "(default: the policy's)")
    parser.add_argument("--starvation-lookahead", action="store_true", default=None,
                        help="with +hrrn: a request goes next only if every older ready request can still start "
                             "within the starvation bound (`starvation_lookahead`)")
    parser.add_argument("--recompute-gpu-weight", type=float, default=None,
                        help="load plan: weight of GPU seconds next to TTFT (default: the policy's)")
    parser.add_argument("--ssd-read-share", type=float, default=0.5,
                        help="share of the SSD reads get while write-back is queued (default 0.5)")
    parser.add_argument("--ssd-write-buffer-gb", type=float, default=2.0,
                        help="queued write-back before writes are dropped (default 2, production's default)")
    parser.add_argument("--ssd-admission", default="all", choices=ADMISSION_POLICIES,
                        help="the SSD tier's write admission (kvtier.ssd_admission's policy; default all); prints "
                             "SSD bytes written, SSD hits and bytes written per hit")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    _add_cluster_arguments(parser)


DEFAULT_SCHEDULER = "dual-queue"
DEFAULT_EVICTION = "lru"
#: flags whose setting --kv-transfer-config's file makes (argument name -> flag)
FILE_FLAGS = {"scheduler": "--scheduler", "eviction": "--eviction", "host_gb": "--host-gb",
              "delay_hit_threshold": "--delay-hit-threshold", "starvation_multiple": "--starvation-multiple",
              "starvation_floor": "--starvation-floor", "mean_window": "--mean-window",
              "starvation_lookahead": "--starvation-lookahead", "recompute_gpu_weight": "--recompute-gpu-weight"}
#: `kvtier.scheduler` keys of the load plan's cost model: the simulated hardware is `--profile`'s, and the
#: simulator's planner knows its costs exactly (nothing calibrates them)
UNMODELLED_SCHEDULER_KEYS = ("ssd_read_gbps", "host_load_gbps", "prefill_us_per_token", "prefill_ns_per_token_pair",
                             "prefill_overhead_ms", "kv_bytes_per_token", "calibrate", "calibration_weight")


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
    cfg = DualQueueConfig()
    given = {"delay_hit_threshold_tokens": args.delay_hit_threshold, "starvation_multiple": args.starvation_multiple,
             "starvation_floor_s": args.starvation_floor, "mean_window": args.mean_window,
             "starvation_lookahead": args.starvation_lookahead}
    cfg = replace(cfg, **{k: v for k, v in given.items() if v is not None})
    if args.recompute_gpu_weight is not None:
        cfg = replace(cfg, load_plan=replace(cfg.load_plan, recompute_gpu_weight=args.recompute_gpu_weight))
    return cfg


@dataclass(frozen=True, slots=True)
class _Setup:
    """What the run simulates: from the flags, or from --kv-transfer-config's file."""

    schedulers: tuple[str, ...]
    eviction: str
    policy: DualQueueConfig
    host_bytes: int | None


def _setup(args: argparse.Namespace) -> _Setup:
    """The schedulers, policy knobs, host policy and size of this run; with --kv-transfer-config, the file's (a
    flag that would contradict it is an error naming both)."""
    from kvtier.storage_backends.eviction import production_policy_names

    if args.kv_transfer_config is None:
        eviction = args.eviction if args.eviction is not None else DEFAULT_EVICTION
        if eviction not in production_policy_names():
            raise SystemExit(f"kvtier simulate: unknown eviction policy {eviction!r}; "
                             f"choose from {', '.join(production_policy_names())}")
        return _Setup(tuple(_schedulers(args.scheduler if args.scheduler is not None else DEFAULT_SCHEDULER)), eviction,
                      policy_config(args), int(args.host_gb * 1e9) if args.host_gb is not None else None)
    path = args.kv_transfer_config
    clash = [flag for name, flag in FILE_FLAGS.items() if vars(args)[name] is not None]
    if clash:
        raise SystemExit(f"kvtier simulate: {' and '.join(clash)} contradict --kv-transfer-config {path}: the file "
                         "sets the scheduler, its knobs and the host tier's policy and size; give one or the other")
    from kvtier.replay.transfer_config import load_transfer_config, unmodelled
    from kvtier.storage_backends.config import ConfigError

    try:
        tc = load_transfer_config(path)
    except ConfigError as e:
        raise SystemExit(f"kvtier simulate: --kv-transfer-config {path}: {e}") from None
    keys = ", ".join(f"{k}: {json.dumps(v)}" for k, v in tc.scheduler_keys)
    print(f"--kv-transfer-config {path} (LMCache config {tc.lmcache_file}) in effect: scheduler "
          f"{tc.scheduler_name} ({keys or 'no kvtier.scheduler keys: the defaults'}), host tier "
          f"{tc.host_policy} (cache_policy {tc.cache_policy or 'unset: LMCache default LRU'}), "
          f"{tc.host_bytes / (1 << 30):g} GiB (max_local_cpu_size)")
    modelled = [f"kvtier.scheduler.{k}" for k in SCHEDULER_KEYS if k not in UNMODELLED_SCHEDULER_KEYS]
    modelled += ["cache_policy", "max_local_cpu_size"] + (["kvtier.eviction_policy"] if tc.ssd_policy == "lru" else [])
    ignored = unmodelled(tc, modelled)
    if ignored:
        logger.warning("kvtier simulate: %s sets keys the simulator does not model, ignored: %s (the simulated GPU, "
                       "SSD tier (LRU), block size and costs are --profile's and the trace's, and its load plan knows "
                       "those costs exactly; a shared tier is --remote*'s; transport keys have no counterpart)",
                       path, ", ".join(ignored))
    return _Setup((tc.scheduler_name,), tc.host_policy, tc.scheduler, tc.host_bytes)


def run(args: argparse.Namespace) -> int:
    """Run `kvtier simulate`; 1 when some run did not complete every request."""
    setup = _setup(args)
    names = setup.schedulers
    try:
        reqs = load_trace(args.trace, args.limit, args.start_s, args.end_s)
    except (OSError, ValueError) as e:
        raise SystemExit(f"kvtier simulate: {input_error(e)}") from None
    if not reqs:
        raise SystemExit(f"kvtier simulate: no requests in {args.trace}")
    base = SimConfig(
        profile=args.profile,
        eviction=setup.eviction,
        policy=setup.policy,
        host_bytes=setup.host_bytes,
        ssd_read_share=args.ssd_read_share,
        ssd_write_buffer_bytes=int(args.ssd_write_buffer_gb * (1 << 30)),
        progress=not args.no_progress,
        ssd_admission=args.ssd_admission,
    )
    span = reqs[-1].arrival - reqs[0].arrival or 1.0
    t0 = time.perf_counter()
    auto_scale, work = calibrate_time_scale(reqs, base, load=args.load)
    scale = args.time_scale if args.time_scale is not None else auto_scale
    load_factor = work / (span * scale)
    print(f"trace {args.trace}: {len(reqs)} requests over {span:.0f} s; profile {args.profile}, "
          f"eviction {setup.eviction}")
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
    if args.ssd_admission != "all":
        print_admission(results)
    print(format_differences("simulate"))
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

