"""Benchmark of kvtier's scheduling (issue 14): simulated queueing and TTFT against fair baselines, delay-hit on a
shared-prefix workload, and the per-step decision cost.

    .venv/bin/python benchmarks/scheduler_sim.py PATH/TO/mooncake_conversation_first30min.jsonl \\
        [--loads 0.85,0.95] [--json OUT] [--plot OUT.png] [--tune]

The trace is not shipped with kvtier: mooncake_conversation_first30min.jsonl is the first 30 minutes (timestamp
< 1,800,000 ms) of conversation_trace.jsonl in the public Mooncake repository
(https://github.com/kvcache-ai/Mooncake, folder FAST25-release/traces); see docs/development.md, 'Traces'.

1. Rolling-origin folds (`kvtier.replay.folds.rolling_folds`): each fold simulates every request before its
   window's end in arrival order (tiers and queues warm up on the minutes before the window, as in production)
   and scores only the requests that arrive in the window: minutes [10, 15), [15, 20), [20, 25) and [25, 30). At
   each load (arrival times scaled so that `fcfs` keeps the GPU that busy over the fold's replay), under the
   baselines `fcfs`, `fcfs+prefetch`, `recompute` (no host or SSD tier) and kvtier's schedulers, SSD write-back
   charged. The figure reported is the WORST fold: every target must hold on every fold. The knobs below
   (`TUNED`: kvtier's scheduler, its starvation multiple, the load plan's GPU-time weight, HRRN's aging weight
   `hrrn_service_exponent`, the starvation lookahead and the window of dispatches the bound's mean wait is taken
   over) were chosen with `--tune` on the first 15 minutes of the trace (timestamp < 900,000 ms), so the fold
   [10, 15) overlaps their tuning (marked * in the output). Targets, against the best of `fcfs+prefetch` and
   `recompute` in the same fold: kvtier's best scheduler's mean queueing <= 0.6x, P99 TTFT <= 1.0x, nothing
   starves (its longest queueing time is no longer than the longest under the fair baselines, which serve
   strictly by arrival), completed counts equal.
2. Shared-prefix workload (`kvtier.sim.workloads`, seeded; task rate chosen so that `fcfs` keeps the GPU 85%
   busy, the 1 s fan-out window unscaled): delay-hit avoidance must cut recomputed tokens by >= 30% against the
   same dual-queue scheduler without it, on every reported seed (also reported: `+delay-hit+own-loads`, which
   also waits for a request's own issued read at an idle GPU instead of recomputing it, and `+eager-replan`, the
   idle-GPU re-plan's previous rule that ignores the GPU's load) (`--shared-prefix-seeds`, default 1,2,3; seed 0
   is the generator's tuning seed, on which its parameters and the re-plan's rule were set, and is not reported).
3. Decision cost: one scheduling step of `DualQueuePolicy` with 1,000 waiting requests (host-ready, SSD-preparing,
   loading, delay-hit-deferred and oversized ones), both ready orders: `order()` of the whole queue, the vLLM
   hook's step (every waiting request's hint refreshed with `update`, then `order()`), and the simulator's path (`pick`
   + `dispatched` + a new arrival's hint derivation with its load plan +
   `add` + `next_prefetch` + `prefetch_done`). Median over batches, in the thread's CPU time (wall time printed
   beside it: on a shared machine it also counts other processes). Target: <= 0.62 ms (Bidaw's figure).
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path

from kvtier.replay.folds import Fold, rolling_folds
from kvtier.scheduler_hooks.dual_queue_policy import (
    KVTIER_SCHEDULER_NAMES,
    OWN_LOADS_NAMES,
    DualQueueConfig,
    DualQueuePolicy,
    FCFSPolicy,
)
from kvtier.scheduler_hooks.hint_derivation import Residency, derive_tier_hint
from kvtier.scheduler_hooks.load_plan import PlanContext
from kvtier.scheduler_hooks.tier_hint import TierHint, TierState
from kvtier.sim.base import SimConfig, SimRequest, SimResult, load_trace, percentile
from kvtier.sim.engine import Simulator, calibrate_time_scale, simulate
from kvtier.sim.report import FAIR_BASELINES, plot, print_table

#: decision cost is timed in this thread's CPU time (the machine running the benchmark may be shared; wall time
#: then measures other processes too); `time_steps` also reports wall time
_clock = time.thread_time
SPLIT_S = 900.0  # `--tune` chooses the knobs on the first 15 minutes
FOLDS = rolling_folds()  # scored windows: minutes [10, 15), [15, 20), [20, 25), [25, 30)
BASELINES = ("fcfs", "fcfs+prefetch", "recompute")
#: chosen by `--tune` on the first 15 minutes (see `tune`): the scheduler and knobs reported as kvtier's best
TUNED = {"scheduler": "dual-queue+hrrn", "starvation_multiple": 8.0, "recompute_gpu_weight": 3.0,
         "hrrn_service_exponent": 1.5, "starvation_lookahead": True, "mean_window": 1024}
#: `hrrn_service_exponent` (HRRN's aging weight) and `starvation_lookahead` only vary for the `+hrrn` schedulers
TUNE_GRID = {"scheduler": ("dual-queue", "dual-queue+hrrn"), "starvation_multiple": (4.0, 6.0, 8.0),
             "recompute_gpu_weight": (0.0, 3.0, 1000.0), "hrrn_service_exponent": (1.0, 1.5),
             "starvation_lookahead": (False, True), "mean_window": (256, 1024)}
TARGET_QUEUE_RATIO = 0.6
TARGET_TTFT_RATIO = 1.0
TARGET_DELAY_HIT_CUT = 0.30
TARGET_STEP_MS = 0.62
#: the idle-GPU re-plan's previous rule (recompute whenever that is sooner for the request, whatever the load)
EAGER_NAMES = ("dual-queue+eager-replan", "dual-queue+delay-hit+eager-replan", "dual-queue+hrrn+eager-replan",
               "dual-queue+hrrn+delay-hit+eager-replan")


def policy_config(knobs: dict, **over) -> DualQueueConfig:
    """The policy of a TUNED-shaped dict of knobs (`over`: more DualQueueConfig fields)."""
    cfg = DualQueueConfig(starvation_multiple=knobs["starvation_multiple"],
                          hrrn_service_exponent=knobs["hrrn_service_exponent"],
                          starvation_lookahead=knobs["starvation_lookahead"], mean_window=knobs["mean_window"], **over)
    return replace(cfg, load_plan=replace(cfg.load_plan, recompute_gpu_weight=knobs["recompute_gpu_weight"]))


def checks(runs: dict[str, SimResult], best: str) -> dict[str, bool]:
    """The issue's targets for kvtier's scheduler `best` against the fair baselines of the same run."""
    fair = [runs[b] for b in FAIR_BASELINES]
    k = runs[best]
    bq = min(r.mean_queue_s for r in fair)
    bt = min(r.p99_ttft_s for r in fair)
    return {
        f"{best} mean queue <= {TARGET_QUEUE_RATIO}x best fair baseline": k.mean_queue_s <= TARGET_QUEUE_RATIO * bq,
        f"{best} P99 TTFT <= {TARGET_TTFT_RATIO}x best fair baseline": k.p99_ttft_s <= TARGET_TTFT_RATIO * bt,
        f"nothing starves: {best} max queue <= the fair baselines' (strict arrival order)":
            k.max_queue_s <= max(r.max_queue_s for r in fair),
        "completed counts equal (every scheduler)": len({(r.completed, r.rejected) for r in runs.values()}) == 1
                                                     and k.completed + k.rejected == k.requests,
    }


def windowed(res: SimResult, sim: Simulator, reqs: list[SimRequest], fold: Fold) -> SimResult:
    """`res` with its request figures (counts, queueing, TTFT) over the requests arriving in the fold's window
    only; the utilisation and SSD figures stay those of the whole replay."""
    ids = [r.rid for r in reqs if fold.score_from_s <= r.arrival < fold.score_until_s]
    arrival = {r.rid: r.arrival for r in reqs}
    ran = [i for i in ids if i in sim.queue]
    q = [sim.queue[i] for i in ran]
    tt = [sim.ttft[i] for i in ran if i in sim.ttft]
    return replace(
        res, requests=len(ids), completed=len(ran), rejected=len(ids) - len(ran),
        mean_queue_s=sum(q) / len(q) if q else 0.0, p50_queue_s=percentile(q, 50), p99_queue_s=percentile(q, 99),
        max_queue_s=max(q, default=0.0), mean_ttft_s=sum(tt) / len(tt) if tt else 0.0,
        p50_ttft_s=percentile(tt, 50), p99_ttft_s=percentile(tt, 99), max_ttft_s=max(tt, default=0.0),
        queue_s=q, ttft_s=tt, arrival_s=[arrival[i] * res.time_scale for i in ran])


def run_fold(trace: list[SimRequest], fold: Fold, base: SimConfig, load: float, schedulers,
             tuned_policy: DualQueueConfig) -> tuple[dict, float]:
    """Every scheduler on the requests before the fold's end (time scale calibrated on them), scored on the
    fold's window."""
    reqs = [r for r in trace if r.arrival < fold.score_until_s]
    scale, work = calibrate_time_scale(reqs, base, load=load)
    span = reqs[-1].arrival - reqs[0].arrival
    runs: dict[str, SimResult] = {}
    for s in schedulers:
        cfg = replace(base, scheduler=s, time_scale=scale)
        if s not in BASELINES:
            cfg = replace(cfg, policy=tuned_policy)
        sim = Simulator(reqs, cfg)
        runs[s] = windowed(sim.run(), sim, reqs, fold)
        runs[s].load_factor = work / (span * scale)
    return runs, scale


def ratios(runs: dict[str, SimResult], best: str) -> dict[str, float]:
    """kvtier's `best` scheduler against the fair baselines of the same fold: queueing and P99 TTFT ratios, and
    its longest queueing time minus the fair baselines' longest (<= 0: nothing starves)."""
    fair = [runs[b] for b in FAIR_BASELINES]
    k = runs[best]
    return {"queue": k.mean_queue_s / min(r.mean_queue_s for r in fair),
            "p99_ttft": k.p99_ttft_s / min(r.p99_ttft_s for r in fair),
            "max_queue_over_fair_s": k.max_queue_s - max(r.max_queue_s for r in fair)}


def tune_candidates() -> list[dict]:
    """Every combination of TUNE_GRID's knobs, without those a scheduler ignores (HRRN's knobs without `+hrrn`)."""
    out = []
    for sched in TUNE_GRID["scheduler"]:
        grid = dict(TUNE_GRID, scheduler=(sched,))
        if "hrrn" not in sched:
            grid.update(hrrn_service_exponent=(1.0,), starvation_lookahead=(False,))
        out.extend(dict(zip(grid, values)) for values in itertools.product(*grid.values()))
    return out


def tune(reqs, base: SimConfig, loads: list[float]) -> dict:
    """Grid over TUNE_GRID on the tuning half: the configuration with the lowest worst-load mean-queue ratio among
    those meeting every other target at every load."""
    print(f"\n== tuning on the first 15 minutes: {len(reqs)} requests (timestamp < {SPLIT_S * 1000:.0f} ms)")
    per_load = []
    for load in loads:
        scale, _ = calibrate_time_scale(reqs, base, load=load)
        fair = {b: simulate(reqs, replace(base, scheduler=b, time_scale=scale)) for b in BASELINES}
        per_load.append((load, scale, fair))
    results = []
    for knobs in tune_candidates():
        sched = knobs["scheduler"]
        pol = policy_config(knobs)
        worst, ok = 0.0, True
        row = []
        for load, scale, fair in per_load:
            r = simulate(reqs, replace(base, scheduler=sched, time_scale=scale, policy=pol))
            c = checks({**fair, sched: r}, sched)
            q = r.mean_queue_s / min(fair[b].mean_queue_s for b in FAIR_BASELINES)
            t = r.p99_ttft_s / min(fair[b].p99_ttft_s for b in FAIR_BASELINES)
            worst = max(worst, q)
            ok &= all(v for k, v in c.items() if "mean queue" not in k)
            row.append(f"load {load}: queue {q:.3f}x P99 TTFT {t:.3f}x max queue {r.max_queue_s:.1f} s")
        results.append((not ok, worst, len(results), knobs))
        print(f"  {' '.join(f'{k} {v}' for k, v in knobs.items())} {'ok ' if ok else 'bad'} | " + " | ".join(row),
              flush=True)
    bad, worst, _, best = min(results)
    print(f"  tuned: {best} (worst-load mean queue {worst:.3f}x{'' if not bad else ', misses another target'})")
    return best


# --- shared-prefix workload ----------------------------------------------------------------------------------------


def shared_prefix(base: SimConfig, load: float, requests: int, tmp: Path, seed: int = 0) -> dict:
    from kvtier.sim.workloads import SharedPrefixSpec, generate_shared_prefix, shared_prefix_stats

    def write(spec: SharedPrefixSpec):
        lines = generate_shared_prefix(spec)
        tmp.write_text("".join(json.dumps(o) + "\n" for o in lines))
        return load_trace(tmp), lines

    spec = SharedPrefixSpec(requests=requests, seed=seed)
    reqs, _ = write(spec)
    scale, _ = calibrate_time_scale(reqs, base, load=load)
    spec = replace(spec, task_rate=spec.task_rate / scale)  # the same load by arrival rate: windows stay 1 s
    reqs, lines = write(spec)
    _, work = calibrate_time_scale(reqs, base, load=load, iterations=1)
    stats = shared_prefix_stats(lines)
    span = reqs[-1].arrival - reqs[0].arrival
    print(f"\n== shared-prefix workload, seed {seed}: {len(reqs)} requests, task rate {spec.task_rate:.2f}/s, "
          f"{stats['share_fraction']:.1%} share >= 6K prefix tokens with another request within 1 s; "
          f"FCFS load {work / span:.2f}")
    runs = {s: simulate(reqs, replace(base, scheduler=s, time_scale=1.0)) for s in
            ("fcfs+prefetch", "recompute") + KVTIER_SCHEDULER_NAMES + OWN_LOADS_NAMES + EAGER_NAMES}
    print_table(list(runs.values()))
    out = {"spec": {k: getattr(spec, k) for k in spec.__dataclass_fields__}, "stats": stats,
           "runs": {k: v.to_json() for k, v in runs.items()}, "checks": {}}
    for plain, dh in (("dual-queue", "dual-queue+delay-hit"), ("dual-queue+hrrn", "dual-queue+hrrn+delay-hit"),
                      ("dual-queue", "dual-queue+delay-hit+own-loads"),
                      ("dual-queue+hrrn", "dual-queue+hrrn+delay-hit+own-loads")):
        a, b = runs[plain].recomputed_tokens, runs[dh].recomputed_tokens
        cut = 1 - b / a if a else 0.0
        ia, ib = runs[plain].recomputed["inflight"], runs[dh].recomputed["inflight"]
        print(f"  {dh}: recomputed tokens {b / 1e6:.3f}M vs {a / 1e6:.3f}M without ({cut:.0%} fewer; in flight "
              f"{ib / 1e6:.3f}M vs {ia / 1e6:.3f}M), mean queue {runs[dh].mean_queue_s:.2f} vs "
              f"{runs[plain].mean_queue_s:.2f} s, {runs[dh].policy_stats.get('deferred_delay_hit', 0)} deferrals")
        out["checks"][f"{dh} cuts recomputed tokens by >= {TARGET_DELAY_HIT_CUT:.0%} vs {plain}"] = \
            cut >= TARGET_DELAY_HIT_CUT
    for plain in ("dual-queue", "dual-queue+hrrn"):  # the idle-GPU re-plan's old rule, for reference (no check)
        dh = plain + "+delay-hit"
        a, b = runs[plain + "+eager-replan"].recomputed_tokens, runs[dh + "+eager-replan"].recomputed_tokens
        print(f"  with +eager-replan (the re-plan ignores the load): {dh}: {b / 1e6:.3f}M vs {a / 1e6:.3f}M "
              f"({1 - b / a if a else 0:.0%} fewer), mean queue {runs[dh + '+eager-replan'].mean_queue_s:.2f} vs "
              f"{runs[plain + '+eager-replan'].mean_queue_s:.2f} s; default vs eager re-plan with delay-hit: "
              f"mean queue {runs[dh].mean_queue_s:.2f} vs {runs[dh + '+eager-replan'].mean_queue_s:.2f} s")
    return out


# --- decision cost -------------------------------------------------------------------------------------------------


def _hint(rng: random.Random, i: int, now: float) -> tuple[TierHint, int]:
    arrival = now - rng.uniform(0, 30)
    u = rng.random()
    tokens = rng.randint(500, 40_000)
    prompt = tokens + rng.randint(10, 4000)
    if u < 0.55:
        h = TierHint(str(i), gpu_tokens=512, host_tokens=tokens, state=TierState.READY, arrival=arrival,
                     prompt_tokens=prompt)
    elif u < 0.65:
        h = TierHint(str(i), state=TierState.MISS, arrival=arrival, prompt_tokens=prompt)
    elif u < 0.70:
        h = TierHint(str(i), host_tokens=tokens, state=TierState.READY, arrival=arrival, inflight_tokens=1024,
                     prompt_tokens=prompt)
    else:
        h = TierHint(str(i), host_tokens=512, ssd_tokens=tokens, ssd_bytes=tokens * 131072,
                     state=TierState.PREPARING, arrival=arrival, prompt_tokens=prompt)
    need = prompt + rng.randint(10, 800)
    if rng.random() < 0.05:
        need = 300_000  # oversized: does not fit this step's free memory (200k), fits the GPU (400k)
    return h, need


def time_steps(policy_factory, waiting: int = 1000, steps: int = 400, batches: int = 7, seed: int = 0) -> dict:
    """Median per-step wall time (ms) of the hook path (`order`) and the simulator path (pick/dispatch/derive+plan/
    add/prefetch)."""
    rng = random.Random(seed)
    now = 1000.0
    p = policy_factory()
    planner = getattr(p, "planner", None)
    nid = 0
    for _ in range(waiting):
        h, need = _hint(rng, nid, now)
        p.add(h, need)
        nid += 1
    free = 200_000
    order_ms, step_ms, order_wall, step_wall, hook_ms = [], [], [], [], []
    for _ in range(batches):
        t0, w0 = _clock(), time.perf_counter()
        for _ in range(steps):
            p.order(now, free)
            now += 0.001
        order_ms.append((_clock() - t0) * 1e3 / steps)
        order_wall.append((time.perf_counter() - w0) * 1e3 / steps)
        # the vLLM hook's step: refresh every waiting request's hint (unchanged ones: the common case), then order
        hints = [(p.hint(r), None) for r in p.ids()]
        t0 = _clock()
        for _ in range(steps // 4):
            for h, _n in hints:
                p.update(h)
            p.order(now, free)
        hook_ms.append((_clock() - t0) * 1e3 / (steps // 4))
        t0, w0 = _clock(), time.perf_counter()
        for k in range(steps):
            rid = p.pick(now, free if k % 8 else 2 * free)  # memory frees up now and then (decodes finishing)
            if rid is not None:
                p.dispatched(rid, now)
            # keep the mix stationary: one ready request leaves, one promotion refills the ready queue, and a new
            # SSD-resident arrival (its hint derived and planned as the connector would) refills the preparing one
            tokens = rng.randint(500, 40_000)
            res = Residency(host_end=512, hit_end=512 + tokens, ssd_tokens=tokens, ssd_bytes=tokens * 131072)
            ctx = None
            if planner is not None:
                ctx = PlanContext(gpu_wait_s=p.gpu_backlog_s(), gpu_wait_fn=lambda s: p.gpu_wait_estimate(s),
                                  ssd_wait_s=p.ssd_backlog_bytes() / 1.5e9, ssd_read_share=0.5)
            h = derive_tier_hint(str(nid), now, gpu_tokens=0, residency=res, prefetch="queued",
                                 prompt_tokens=512 + tokens + 100, planner=planner, context=ctx)
            if h.state is not TierState.PREPARING:  # planned to recompute: still an SSD-resident arrival
                h = replace(h, state=TierState.PREPARING, plan=None)
            p.add(h, tokens + 200)
            nid += 1
            r = p.next_prefetch(now)
            if r is not None:
                p.prefetch_done(r, now)
            now += 0.001
        step_ms.append((_clock() - t0) * 1e3 / steps)
        step_wall.append((time.perf_counter() - w0) * 1e3 / steps)
    return {"waiting": len(p), "order_ms_median": statistics.median(order_ms),
            "step_ms_median": statistics.median(step_ms), "order_wall_ms_median": statistics.median(order_wall),
            "step_wall_ms_median": statistics.median(step_wall), "hook_step_ms_median": statistics.median(hook_ms)}


# --- main ----------------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace", help="Mooncake conversation trace (JSONL), at least 30 minutes, e.g. "
                    "mooncake_conversation_first30min.jsonl: the first 30 minutes of conversation_trace.jsonl "
                    "from https://github.com/kvcache-ai/Mooncake (FAST25-release/traces); "
                    "see docs/development.md")
    ap.add_argument("--loads", default="0.85,0.95", help="comma-separated FCFS GPU-busy targets")
    ap.add_argument("--eviction", default="lru")
    ap.add_argument("--profile", default="llama3-8b-h100")
    ap.add_argument("--tune", action="store_true", help="tune TUNED's knobs on the first 15 minutes first")
    ap.add_argument("--skip-shared-prefix", action="store_true")
    ap.add_argument("--shared-prefix-requests", type=int, default=2000)
    ap.add_argument("--shared-prefix-seeds", default="1,2,3",
                    help="generator seeds reported (seed 0 tuned the generator: not reported by default)")
    ap.add_argument("--json", dest="json_out")
    ap.add_argument("--plot", help="PNG of the first load's runs")
    ap.add_argument("--waiting", type=int, default=1000, help="queue size for the decision-cost measurement")
    ap.add_argument("--progress", action="store_true")
    args = ap.parse_args(argv)
    loads = [float(x) for x in args.loads.split(",")]
    base = SimConfig(profile=args.profile, eviction=args.eviction, progress=args.progress)
    report: dict = {"trace": args.trace, "profile": args.profile, "eviction": args.eviction, "loads": []}
    ok = True

    tuned = dict(TUNED)
    if args.tune:
        tuned = tune(load_trace(args.trace, end_s=SPLIT_S), base, loads)
    report["tuned"] = tuned
    trace = load_trace(args.trace)
    if not trace or trace[-1].arrival < FOLDS[-1].score_from_s:
        raise SystemExit(f"{args.trace}: no requests at or after {FOLDS[-1].score_from_s:.0f} s (need the 30-minute "
                         "trace)")
    best = tuned["scheduler"]
    pol = policy_config(tuned)

    def label(f: Fold) -> str:
        return f.name + ("*" if f.score_from_s < SPLIT_S else "")

    print(f"\n== rolling-origin folds of {args.trace}: scored " + ", ".join(label(f) for f in FOLDS)
          + "; each fold simulates every request before its window's end (warm) and scores the window's requests. "
          f"Knobs tuned on the first 15 minutes{' (this run)' if args.tune else ''} (* = the fold overlaps that "
          f"tuning): {tuned}. The figure reported is the worst fold.")
    schedulers = list(BASELINES) + list(KVTIER_SCHEDULER_NAMES) + [f"{best}+always-load", f"{best}+eager-replan"]
    for li, load in enumerate(loads):
        per_fold = []
        for fold in FOLDS:
            t0 = time.perf_counter()
            runs, scale = run_fold(trace, fold, base, load, schedulers, pol)
            f = runs["fcfs"]
            print(f"\n== load {load:.2f}, fold {label(fold)} ({f.requests} requests scored): time scale {scale:.3f}, "
                  f"load factor {f.load_factor:.3f}, {time.perf_counter() - t0:.0f} s")
            print_table(list(runs.values()))
            k = runs[best]
            print(f"  SSD (whole replay): {k.ssd_read_gb:.0f} GB read, {k.ssd_write_gb:.0f} GB written, "
                  f"{k.ssd_dropped_write_gb:.0f} GB of write-back dropped (full write buffer), busy {k.ssd_util:.0%} "
                  f"(reads {k.ssd_read_util:.0%}, writes {k.ssd_write_util:.0%}) under {best}")
            print(f"  load plan: {k.policy_stats.get('plan_recompute_ssd', 0)} SSD parts recomputed at arrival, "
                  f"{k.policy_stats.get('replan_recompute_ssd', 0)} at an idle GPU, "
                  f"{k.policy_stats.get('plan_prefetch', 0)} prefetched; vs {best}+always-load: mean queue "
                  f"{k.mean_queue_s:.2f} vs {runs[best + '+always-load'].mean_queue_s:.2f} s, P99 TTFT "
                  f"{k.p99_ttft_s:.2f} vs {runs[best + '+always-load'].p99_ttft_s:.2f} s; vs {best}+eager-replan "
                  f"(re-plan ignores the load): mean queue {k.mean_queue_s:.3f} vs "
                  f"{runs[best + '+eager-replan'].mean_queue_s:.3f} s, "
                  f"{runs[best + '+eager-replan'].policy_stats.get('replan_recompute_ssd', 0)} idle re-plans")
            c = checks(runs, best)
            for name, v in c.items():
                print(f"  [{'PASS' if v else 'FAIL'}] {name}")
            per_fold.append((fold, scale, c, ratios(runs, best), runs))
        print(f"\n== load {load:.2f}, worst fold ({best} against the best fair baseline of each fold)")
        worst = {}
        for key, what in (("queue", "mean queue ratio"), ("p99_ttft", "P99 TTFT ratio"),
                          ("max_queue_over_fair_s", "longest queueing minus the fair baselines' (s)")):
            fold, _, _, r, _ = max(per_fold, key=lambda x: x[3][key])
            worst[key] = {"fold": fold.name, "value": r[key]}
            print(f"  {what}: " + "  ".join(f"{label(x[0])} {x[3][key]:.3f}" for x in per_fold)
                  + f"  | worst {r[key]:.3f} ({label(fold)})")
        for name in per_fold[0][2]:
            v = all(x[2][name] for x in per_fold)
            failed = [label(x[0]) for x in per_fold if not x[2][name]]
            print(f"  [{'PASS' if v else 'FAIL'}] every fold: {name}" + (f" (fails on {', '.join(failed)})"
                                                                        if failed else ""))
            ok &= v
        report["loads"].append({"load": load, "worst": worst, "folds": [
            {"fold": asdict(fold), "time_scale": scale, "checks": c, "ratios": r,
             "runs": [x.to_json() for x in runs.values()]} for fold, scale, c, r, runs in per_fold]})
        if li == 0 and args.plot:
            fold, _, _, _, runs = max(per_fold, key=lambda x: x[3]["queue"])
            plot(list(runs.values()), args.plot)
            print(f"  wrote {args.plot} (fold {fold.name}, the worst by mean queue ratio)")

    if not args.skip_shared_prefix:
        report["shared_prefix"] = {}
        for seed in [int(x) for x in args.shared_prefix_seeds.split(",") if x.strip()]:
            with tempfile.TemporaryDirectory(prefix="kvtier-sim-") as d:
                sp = shared_prefix(base, 0.85, args.shared_prefix_requests, Path(d) / "shared-prefix.jsonl", seed)
            for name, v in sp["checks"].items():
                print(f"  [{'PASS' if v else 'FAIL'}] seed {seed}: {name}")
                ok &= v
            report["shared_prefix"][str(seed)] = sp

    print(f"\n== decision cost per scheduling step, {args.waiting} waiting requests (median of 7 batches)")
    tuned_order = "hrrn" if "+hrrn" in best else "arrival"
    over = {
        "dual-queue": time_steps(lambda: DualQueuePolicy(DualQueueConfig(gpu_capacity=400_000)), args.waiting),
        "dual-queue+hrrn": time_steps(lambda: DualQueuePolicy(DualQueueConfig(gpu_capacity=400_000,
                                                                              ready_order="hrrn")), args.waiting),
        f"{best} tuned": time_steps(lambda: DualQueuePolicy(policy_config(tuned, gpu_capacity=400_000,
                                                                        ready_order=tuned_order)),
                                      args.waiting),
        "fcfs": time_steps(lambda: FCFSPolicy(), args.waiting),
    }
    for name, o in over.items():
        print(f"  {name:<16} order(): {o['order_ms_median']:.3f} ms CPU ({o['order_wall_ms_median']:.3f} wall)   "
              f"pick+dispatch+derive/plan+add+prefetch: {o['step_ms_median']:.3f} ms CPU "
              f"({o['step_wall_ms_median']:.3f} wall)   hook step (update every hint + order): "
              f"{o['hook_step_ms_median']:.3f} ms CPU   (queue {o['waiting']})")
    for name in ("dual-queue", "dual-queue+hrrn", f"{best} tuned"):
        worst = max(over[name]["order_ms_median"], over[name]["step_ms_median"], over[name]["hook_step_ms_median"])
        passed = worst <= TARGET_STEP_MS
        print(f"  [{'PASS' if passed else 'FAIL'}] {name} step <= {TARGET_STEP_MS} ms of CPU (worst path "
              f"{worst:.3f} ms)")
        ok &= passed
    report["overhead"] = over
    if args.json_out:
        with open(args.json_out, "w") as fh:
            json.dump(report, fh, indent=2)
        print(f"wrote {args.json_out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
