"""Benchmark of the eviction policies on the shared Mooncake traces (issue 4's targets), with an ablation of the
answer-length policy's signals and the per-access / per-eviction-decision cost at 100k cached chunks.

    .venv/bin/python benchmarks/eviction_replay.py [--conversation PATH] [--poisson PATH] [--jobs N] [--json OUT]

Prints, per trace and host capacity (2% and 5% of the trace's unique blocks): every policy's host hit rate, its
ratio to LRU, and the share of the LRU-to-Belady gap it closes; then the ablation (answer-length with one signal
switched off at a time) and the cost table (medians). Exit status 0 even when a target is missed: the printed
PASS/MISS lines say which.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from kvtier.tools.replay import ReplayClock, parse_capacity, replay_one
from kvtier.tools.traces import read_trace, unique_blocks

SHARED = Path(__file__).resolve().parents[1].parent / "shared" / "traces"
POLICIES = ["lru", "fifo", "lfu", "arc", "s3fifo", "answer-length", "belady"]
CAPACITIES = ["0.02", "0.05"]
ABLATION = [
    ("full", {}),
    ("- answer length (bound, timing)", {"use_answer_length": False}),
    ("- answer-length timing rows", {"answer_timing": False}),
    ("- previous-gap timing rows", {"gap_timing": False}),
    ("- depth", {"use_depth": False}),
    ("- new-chunks count", {"use_new_blocks": False}),
    ("- tail class", {"use_tail": False}),
    ("- shared class (reuse count)", {"use_shared": False}),
    ("- elapsed time (timing)", {"use_elapsed": False}),
    ("- ghost Belady (h = 1)", {"use_ghost": False}),
    ("potential instead of density", {"score": "potential"}),
    ("- fallback", {"fallback": ()}),
]


def _job(args: tuple) -> dict:
    path, policy, cap, kwargs, label = args
    reqs = read_trace(path)
    c = parse_capacity(cap, unique_blocks(reqs))
    r = replay_one(reqs, policy, c, policy_kwargs=kwargs)
    return {
        "trace": str(path), "policy": policy, "label": label, "capacity": cap, "hit_rate": r.hit_rate,
        "seconds": r.seconds, "mode": r.extra.get("mode"),
    }


def _run_all(jobs: list[tuple], n: int) -> list[dict]:
    if n <= 1:
        return [_job(j) for j in jobs]
    with ProcessPoolExecutor(max_workers=n) as ex:
        return list(ex.map(_job, jobs))


def _synthetic_sessions(n_chunks: int, seed: int = 1):
    """A session-shaped workload with about `n_chunks` distinct chunks: chains that later turns extend."""
    rng = random.Random(seed)
    chains, next_id, t = [], 1, 0.0
    live: list[list[int]] = []
    while next_id < n_chunks:
        t += rng.expovariate(2.0)
        if live and rng.random() < 0.35:
            chain = live.pop(rng.randrange(len(live)))
            chain = chain[:-1] + list(range(next_id, next_id + rng.randint(1, 6)))
        else:
            chain = [0] + list(range(next_id, next_id + rng.randint(2, 40)))
        next_id = max(next_id, chain[-1] + 1)
        live.append(chain)
        if len(live) > 2000:
            live.pop(0)
        chains.append((t, chain, rng.randint(5, 800)))
    return chains


def measure_cost(policy_name: str, n_chunks: int = 100_000, samples: int = 2000) -> dict:
    """Median ns per access (a hit) and per eviction decision (victims(1) + on_remove) with n_chunks resident."""
    from kvtier.storage_backends.eviction import make_policy
    from kvtier.storage_backends.eviction.belady import BeladyPolicy

    clock = ReplayClock()
    reqs = _synthetic_sessions(n_chunks + 20 * samples)
    if policy_name == "belady":
        seq = [k for _, chain, _ in reqs for k in dict.fromkeys(chain)]
        p = BeladyPolicy(clock=clock)
        p.set_future(seq + seq)  # enough future for the fill and the probes
    else:
        p = make_policy(policy_name, production=False, clock=clock)
    p.set_capacity(n_chunks)
    resident = 0
    always = lambda _k: True  # noqa: E731
    acc_ns: list[int] = []
    ev_ns: list[int] = []
    for t, chain, answer in reqs:
        clock.now = t
        p.on_request(chain, t)
        for k in dict.fromkeys(chain):
            if k in p:
                t0 = time.perf_counter_ns()
                p.on_access(k)
                dt = time.perf_counter_ns() - t0
                if resident >= n_chunks:
                    acc_ns.append(dt)
                continue
            if resident >= n_chunks:
                t0 = time.perf_counter_ns()
                for v in p.victims(1, always):
                    p.on_remove(v)
                    resident -= 1
                ev_ns.append(time.perf_counter_ns() - t0)
            p.on_insert(k, 1)
            resident += 1
        p.on_request_finished(chain, answer, t)
        if len(ev_ns) >= samples and len(acc_ns) >= samples:
            break
    return {
        "policy": policy_name,
        "resident": len(p),
        "access_us": statistics.median(acc_ns) / 1e3 if acc_ns else float("nan"),
        "access_mean_us": statistics.fmean(acc_ns) / 1e3 if acc_ns else float("nan"),
        "eviction_ms": statistics.median(ev_ns) / 1e6 if ev_ns else float("nan"),
        "eviction_p99_ms": sorted(ev_ns)[int(0.99 * (len(ev_ns) - 1))] / 1e6 if ev_ns else float("nan"),
        "samples": (len(acc_ns), len(ev_ns)),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--conversation", default=str(SHARED / "mooncake_conversation_first30min.jsonl"))
    ap.add_argument("--poisson", default=str(SHARED / "mooncake_synthetic_poisson.jsonl"))
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--no-ablation", action="store_true")
    ap.add_argument("--no-cost", action="store_true")
    ap.add_argument("--json", default=None, help="write all figures here")
    args = ap.parse_args(argv)
    traces = {"conversation": args.conversation, "poisson": args.poisson}
    for name, path in traces.items():
        if not Path(path).exists():
            print(f"{name} trace not found: {path}", file=sys.stderr)
            return 2

    jobs = [(path, p, cap, {}, p) for path in traces.values() for cap in CAPACITIES for p in POLICIES]
    if not args.no_ablation:
        jobs += [
            (traces["conversation"], "answer-length", cap, kw, label)
            for label, kw in ABLATION[1:] for cap in CAPACITIES
        ]
        jobs += [(traces["poisson"], "answer-length", cap, {"fallback": ()}, "- fallback") for cap in CAPACITIES]
    t0 = time.perf_counter()
    rows = _run_all(jobs, args.jobs)
    out: dict = {"results": rows, "targets": []}

    def hr(trace: str, label: str, cap: str) -> float:
        return next(r["hit_rate"] for r in rows if r["trace"] == traces[trace] and r["label"] == label
                    and r["capacity"] == cap)

    for tname in traces:
        print(f"\n== {tname}: {traces[tname]}")
        print(f"{'policy':<14}" + "".join(f"{'hit@' + c:>10}{'xLRU':>7}{'gap%':>7}{'sec':>6}" for c in CAPACITIES))
        for p in POLICIES:
            line = f"{p:<14}"
            for c in CAPACITIES:
                h, lru, bel = hr(tname, p, c), hr(tname, "lru", c), hr(tname, "belady", c)
                sec = next(r["seconds"] for r in rows if r["trace"] == traces[tname] and r["label"] == p
                           and r["capacity"] == c)
                gap = (h - lru) / (bel - lru) if bel > lru else float("nan")
                line += f"{100 * h:>9.2f}%{h / lru if lru else float('nan'):>7.2f}{100 * gap:>6.1f}%{sec:>6.1f}"
            print(line)

    print("\n== targets")
    for c in CAPACITIES:
        al, lru, bel = hr("conversation", "answer-length", c), hr("conversation", "lru", c), hr(
            "conversation", "belady", c)
        gap = (al - lru) / (bel - lru)
        arc, s3 = hr("conversation", "arc", c), hr("conversation", "s3fifo", c)
        ok = gap >= 0.25 and al > arc and al > s3
        out["targets"].append({"target": f"conversation@{c}", "gap_closed": gap, "pass": ok})
        print(f"{'PASS' if ok else 'MISS'} conversation@{c}: answer-length {100 * al:.2f}% closes {100 * gap:.1f}% "
              f"of the LRU->Belady gap (>= 25%); ARC {100 * arc:.2f}%, S3-FIFO {100 * s3:.2f}%")
        best = max(("lru", "fifo", "lfu", "arc", "s3fifo"), key=lambda p: hr("poisson", p, c))
        al_p, best_p = hr("poisson", "answer-length", c), hr("poisson", best, c)
        ok = al_p >= best_p - 0.01
        out["targets"].append({"target": f"poisson@{c}", "delta_vs_best": al_p - best_p, "pass": ok})
        print(f"{'PASS' if ok else 'MISS'} poisson@{c}: answer-length {100 * al_p:.2f}% vs best baseline "
              f"{best} {100 * best_p:.2f}% (within 1 point)")

    if not args.no_ablation:
        print("\n== ablation (conversation trace; answer-length with one signal off)")
        print(f"{'variant':<32}" + "".join(f"{'hit@' + c:>10}{'delta':>8}" for c in CAPACITIES))
        for label, _ in ABLATION:
            lab = "answer-length" if label == "full" else label
            line = f"{label:<32}"
            for c in CAPACITIES:
                h = hr("conversation", lab, c)
                line += f"{100 * h:>9.2f}%{100 * (h - hr('conversation', 'answer-length', c)):>+8.2f}"
            print(line)
        line = f"{'poisson: - fallback':<32}"
        for c in CAPACITIES:
            h = hr("poisson", "- fallback", c)
            line += f"{100 * h:>9.2f}%{100 * (h - hr('poisson', 'answer-length', c)):>+8.2f}"
        print(line)

    if not args.no_cost:
        print("\n== cost with 100k cached chunks (medians; targets: <= 20 us per access, <= 0.35 ms per decision)")
        costs = [measure_cost(p) for p in POLICIES]
        out["cost"] = costs
        for c in costs:
            print(f"{c['policy']:<14} access {c['access_us']:>7.2f} us (mean {c['access_mean_us']:.2f})   eviction decision {c['eviction_ms']:>7.3f} ms"
                  f" (p99 {c['eviction_p99_ms']:.3f} ms)   resident {c['resident']}")
        worst = max(r["seconds"] for r in rows if r["trace"] == traces["conversation"] and r["label"] in POLICIES)
        print(f"slowest whole-conversation replay of one policy at one capacity: {worst:.1f} s (target < 60 s)")
    print(f"\n(total {time.perf_counter() - t0:.0f} s)")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=2, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
