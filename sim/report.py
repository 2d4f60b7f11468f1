"""What `kvtier simulate` prints and draws: the table of runs with each kvtier run's ratios against the best fair
baseline, the table of cluster runs (`--replicas` / `--remote`), and the plot (TTFT CDF, queueing over time)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from kvtier.scheduler_hooks.dual_queue_policy import BASELINE_NAMES
from kvtier.sim.base import SimResult

if TYPE_CHECKING:
    from kvtier.sim.remote import ClusterResult

__all__ = ["FAIR_BASELINES", "best_baseline", "plot", "print_cluster_table", "print_table"]

#: the baselines kvtier's schedulers are compared with (`fcfs` stalls the GPU on SSD reads: not a fair one)
FAIR_BASELINES = ("fcfs+prefetch", "recompute")


def best_baseline(results: Sequence[SimResult], metric: str) -> SimResult | None:
    """The fair baseline (`FAIR_BASELINES`) with the lowest `metric` among `results`, or None."""
    fair = [r for r in results if r.scheduler in FAIR_BASELINES]
    return min(fair, key=lambda r: getattr(r, metric)) if fair else None


def print_table(results: Sequence[SimResult]) -> None:
    """One row per run, then each kvtier run's ratios against the best fair baseline of the same invocation."""
    hdr = (f"{'scheduler':<28}{'done':>6}{'rej':>5}{'queue mean':>11}{'p50':>8}{'p99':>8}{'max':>8}"
           f"{'TTFT mean':>10}{'p50':>8}{'p99':>8}{'GPU':>6}{'SSD':>6}{'recomp Mtok':>12}")
    print(hdr)
    for r in results:
        print(f"{r.scheduler:<28}{r.completed:>6}{r.rejected:>5}{r.mean_queue_s:>11.2f}{r.p50_queue_s:>8.2f}"
              f"{r.p99_queue_s:>8.2f}{r.max_queue_s:>8.1f}{r.mean_ttft_s:>10.2f}{r.p50_ttft_s:>8.2f}"
              f"{r.p99_ttft_s:>8.2f}{r.gpu_util:>6.0%}{r.ssd_util:>6.0%}{r.recomputed_tokens / 1e6:>12.2f}")
    bq, bt = best_baseline(results, "mean_queue_s"), best_baseline(results, "p99_ttft_s")
    if bq is None or bt is None:
        return
    print(f"  best fair baseline: mean queue {bq.scheduler} ({bq.mean_queue_s:.2f} s), "
          f"P99 TTFT {bt.scheduler} ({bt.p99_ttft_s:.2f} s)")
    for r in results:
        if r.scheduler in BASELINE_NAMES:
            continue
        print(f"  {r.scheduler} / best fair baseline: "
              f"mean queue {r.mean_queue_s / max(bq.mean_queue_s, 1e-12):.2f}x, "
              f"P99 TTFT {r.p99_ttft_s / max(bt.p99_ttft_s, 1e-12):.2f}x")


def print_admission(results: Sequence[SimResult]) -> None:
    """The SSD tier's write admission per run: bytes written, SSD hits (blocks), bytes written per SSD hit."""
    print(f"{'scheduler':<28}{'ssd admission':<14}{'GB written':>11}{'refused blocks':>15}{'ssd hit blocks':>15}"
          f"{'MB written/hit':>15}")
    for r in results:
        hits = r.ssd_hit_blocks
        per_hit = f"{r.ssd_write_gb * 1e3 / hits:>15.2f}" if hits else f"{'-':>15}"
        print(f"{r.scheduler:<28}{r.ssd_admission:<14}{r.ssd_write_gb:>11.3f}{r.ssd_refused_blocks:>15}"
              f"{hits:>15.0f}{per_hit}")


def print_cluster_table(results: Sequence[ClusterResult]) -> None:
    """One row per cluster run: queueing, TTFT, hits per tier, and the shared store's traffic."""
    print(f"{'scheduler':<22}{'tiers':<14}{'done':>6}{'queue mean':>11}{'p99':>8}{'TTFT p99':>9}"
          f"{'gpu Mtok':>9}{'host':>7}{'ssd':>7}{'remote':>7}{'computed':>9}")
    for r in results:
        tiers = "none" if r.scheduler == "recompute" else ("local+remote" if r.remote else "local")
        h = r.hits
        print(f"{r.scheduler:<22}{tiers:<14}{r.completed:>6}{r.mean_queue_s:>11.2f}{r.p99_queue_s:>8.2f}"
              f"{r.p99_ttft_s:>9.2f}{h['gpu'] / 1e6:>9.2f}{h['host'] / 1e6:>7.2f}{h['ssd'] / 1e6:>7.2f}"
              f"{h['remote'] / 1e6:>7.2f}{h['computed'] / 1e6:>9.2f}")
        if r.remote_stats:
            s = r.remote_stats
            print(f"{'':<22}store: read {s['read_gb']:.0f} GB, wrote {s['written_gb']:.0f} GB, dropped "
                  f"{s['dropped_write_gb']:.0f} GB ({s['dropped_writes']} writes), {s['evictions']} evictions; "
                  f"link busy: reads {s['read_link_util']:.0%}, writes {s['write_link_util']:.0%}")


def plot(results: Sequence[SimResult], path: str | Path) -> None:
    """A PNG at `path`: each run's TTFT CDF, and its queueing time over the trace (moving mean)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for r in results:
        xs = sorted(r.ttft_s)
        if xs:
            a1.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=r.scheduler)
        pts = sorted(zip(r.arrival_s, r.queue_s))
        if pts:
            w = max(len(pts) // 100, 1)  # moving mean over ~1% of the requests
            ts = [p[0] for p in pts]
            qs = [p[1] for p in pts]
            acc, sm = 0.0, []
            for i, v in enumerate(qs):
                acc += v
                if i >= w:
                    acc -= qs[i - w]
                sm.append(acc / min(i + 1, w))
            a2.plot(ts, sm, label=r.scheduler)
    a1.set_xscale("log")
    a1.set_xlabel("TTFT (s)")
    a1.set_ylabel("fraction of requests")
    a1.set_title("TTFT CDF")
    a1.grid(alpha=0.3)
    a1.legend()
    a2.set_xlabel("arrival time (s, scaled)")
    a2.set_ylabel("queueing time (s), moving mean")
    a2.set_title("queueing over the trace")
    a2.grid(alpha=0.3)
    a2.legend()
    if results:
        fig.suptitle(f"kvtier simulate: {results[0].profile}, eviction {results[0].eviction}, "
                     f"time scale {results[0].time_scale:.2f}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
