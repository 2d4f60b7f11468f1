"""What a soak (`testing/soak.py`) records and reports: samples of the server over time, each fault's record, the
episode messages counted in the server logs, and the printed table, the JSON file and the PNG plot."""

from __future__ import annotations

import json
import logging
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

logger = logging.getLogger(__name__)

TIERS = ("host", "ssd", "remote")

#: per fault: kvtier's episode messages, (kind, start pattern, clear pattern or None when the fault has none)
EPISODES: dict[str, tuple[tuple[str, str, str | None], ...]] = {
    "enospc": (("disk-full", r"disk full under .*: the SSD tier stays at", r"the SSD tier's disk has room again"),
               ("journal", r"SSD journal append failed under", r"SSD journal appends succeed again"),
               ("write", r"SSD write failed: disk full", r"SSD writes succeed again"),
               ("journal-free", r"SSD journal: cannot record freed slots", r"freed slots are recorded again")),
    "redis": (("shared", r"kvtier: shared store \S+ is unreachable", r"kvtier: shared store \S+ answers again after"),),
    "journal": (("journal-damage", r"SSD journal .*: skipped \d+ damaged byte range", None),),
    "kill": (),
}


@dataclass
class Sample:
    t: float  #: seconds since the soak started
    life: int  #: server lifetime (0, 1, ... : a new one after each restart)
    rss_mib: float  #: resident memory summed over the server's process group
    fds: int  #: open file descriptors of the group
    procs: int
    hits: dict[str, float]  #: kvtier_connector_hit_tokens_total by tier (this lifetime)
    ssd_used: float  #: kvtier_ssd_used_bytes
    slot_bytes: int  #: the slot files' sizes on disk (st_size)
    slot_alloc: int  #: their allocated blocks (st_blocks x 512)


@dataclass
class FaultRecord:
    name: str
    status: str = "done"  #: done | SKIPPED | FAILED
    reason: str = ""
    injected: float = 0.0
    cleared: float = 0.0
    life_before: int = 0
    life_after: int = 0
    hits_before: dict[str, float] = field(default_factory=dict)
    hits_after: dict[str, float] = field(default_factory=dict)
    episodes: dict[str, list[int]] = field(default_factory=dict)  #: kind -> [starts, clears] in its log segment
    server_back_s: float | None = None
    greedy_checked: int = 0
    greedy_mismatches: int = 0
    details: dict = field(default_factory=dict)


@dataclass
class SoakReport:
    config: dict
    faults: list[FaultRecord] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    rounds: list[dict] = field(default_factory=list)
    failed_outside: int = 0
    failed_inflight: int = 0
    requests: int = 0
    greedy_checked: int = 0
    greedy_mismatches: int = 0
    mismatch_examples: list[dict] = field(default_factory=list)
    ssd_over_capacity: list[dict] = field(default_factory=list)
    slopes: list[dict] = field(default_factory=list)
    stray_episodes: dict[str, int] = field(default_factory=dict)
    wall_s: float = 0.0
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return asdict(self)


def count_episodes(text: str, fault: str) -> dict[str, list[int]]:
    """kind -> [start messages, clear messages] of `fault`'s episode kinds in a piece of server log."""
    out = {}
    for kind, start, clear in EPISODES[fault]:
        out[kind] = [len(re.findall(start, text)), len(re.findall(clear, text)) if clear else 0]
    return out


def slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys over xs (NaN with fewer than 3 points)."""
    n = len(xs)
    if n < 3:
        return float("nan")
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else float("nan")


def lifetime_slopes(samples: list[Sample], warmup_s: float) -> list[dict]:
    """Per server lifetime, after `warmup_s` of it: RSS MiB/min and fds/min (least squares)."""
    out = []
    for life in sorted({s.life for s in samples}):
        ss = [s for s in samples if s.life == life]
        t0 = ss[0].t + warmup_s
        ss = [s for s in ss if s.t >= t0]
        ts = [s.t / 60 for s in ss]
        out.append({"life": life, "samples": len(ss), "minutes": (ts[-1] - ts[0]) if ss else 0.0,
                    "rss_mib_per_min": slope(ts, [s.rss_mib for s in ss]),
                    "fds_per_min": slope(ts, [float(s.fds) for s in ss]),
                    "rss_mib_last": ss[-1].rss_mib if ss else float("nan"), "fds_last": ss[-1].fds if ss else 0})
    return out


def print_report(rep: SoakReport) -> None:
    print(f"\nsoak: {rep.wall_s / 60:.1f} min, {rep.requests} requests in {len(rep.rounds)} client rounds; failed "
          f"outside the in-flight ones at a kill: {rep.failed_outside} (target 0), in flight at a kill: "
          f"{rep.failed_inflight}; greedy sample: {rep.greedy_mismatches} mismatches of {rep.greedy_checked} "
          f"(target 0); SSD over capacity at {len(rep.ssd_over_capacity)} of {len(rep.samples)} samples (target 0)")
    head = (f"{'fault':<14}{'status':<9}{'at s':>7}{'clear s':>9}  {'hits before host/ssd/remote':<30}"
            f"{'hits after host/ssd/remote':<30}{'episodes kind=starts/clears'}")
    print(head)
    print("-" * len(head))
    for f in rep.faults:
        hb = "/".join(f"{f.hits_before.get(t, 0):.0f}" for t in TIERS)
        ha = "/".join(f"{f.hits_after.get(t, 0):.0f}" for t in TIERS)
        ep = " ".join(f"{k}={a}/{b}" for k, (a, b) in f.episodes.items() if a or b) or "-"
        back = f" back in {f.server_back_s:.0f} s" if f.server_back_s is not None else ""
        print(f"{f.name:<14}{f.status:<9}{f.injected:>7.0f}{f.cleared:>9.0f}  {hb:<30}{ha:<30}{ep}{back}"
              + (f"  ({f.reason})" if f.reason else ""))
    print("\nserver lifetimes (after warm-up): RSS slope, fd slope (least squares)")
    for s in rep.slopes:
        print(f"  life {s['life']}: {s['samples']} samples over {s['minutes']:.1f} min: RSS {s['rss_mib_last']:.0f} "
              f"MiB, {s['rss_mib_per_min']:+.2f} MiB/min; fds {s['fds_last']}, {s['fds_per_min']:+.2f} fds/min")
    if rep.stray_episodes:
        print(f"episode messages outside their fault's window: {rep.stray_episodes}")
    for n in rep.notes:
        print(f"note: {n}")


def write_json(rep: SoakReport, path: Path) -> None:
    path.write_text(json.dumps(rep.to_json(), indent=1, default=str))


def plot(rep: SoakReport, path: Path) -> str:
    """RSS, fds and hits per tier over time with a marker at each fault; returns a note (written or why not)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "no plot: matplotlib is not installed"
    fig, axes = plt.subplots(3, 1, figsize=(11, 8), sharex=True)
    for life in sorted({s.life for s in rep.samples}):  # one line per server lifetime (no line across a restart)
        ss = [s for s in rep.samples if s.life == life]
        ts = [s.t for s in ss]
        axes[0].plot(ts, [s.rss_mib for s in ss], ".-", ms=2, color="C0")
        axes[1].plot(ts, [s.fds for s in ss], ".-", ms=2, color="C0")
        for i, tier in enumerate(TIERS):
            axes[2].plot(ts, [s.hits.get(tier, 0) for s in ss], ".-", ms=2, color=f"C{i + 1}",
                         label=tier if life == rep.samples[0].life else None)
    axes[0].set_ylabel("RSS MiB (group)")
    axes[1].set_ylabel("open fds")
    axes[2].set_ylabel("hit tokens (per lifetime)")
    axes[2].set_xlabel("s")
    axes[2].legend(loc="upper left")
    for f in rep.faults:
        if f.status != "done":
            continue
        for ax in axes:
            ax.axvspan(f.injected, max(f.cleared, f.injected + 0.5), color="red", alpha=0.15)
        axes[0].annotate(f.name, (f.injected, axes[0].get_ylim()[1]), fontsize=7, rotation=90, va="top")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return f"plot: {path}"
