"""What an eviction policy loses against Belady, by kind of access and reuse time (offline analysis tool).

Replays a trace through the host tier of `kvtier replay`'s model (unbounded SSD, one slot per block) once per
policy and sorts every scored block access into a category: its position (the chain's first block, typically a
shared system prompt, or a later one), how often the block was read before (second access: mostly a conversation's
first follow-up; third or later: deeper conversations and blocks shared across sessions) and the time since its
previous access (bucketed). Per category it counts accesses and each policy's host hits, so the rows where Belady
hits and a policy does not show where the LRU->Belady gap is left.

    python -m kvtier.replay.eviction_loss TRACE --host-capacity 0.02 [--until 900 --score-from 450]
        [--policies lru,answer-length,belady]
"""

from __future__ import annotations

import argparse
import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvtier.replay.runner import ReplayClock, build_policy, host_key_sequence, parse_capacity, simulate
from kvtier.replay.traces import TraceRequest, read_trace, unique_blocks

logger = logging.getLogger(__name__)

#: upper edges (seconds) of the reuse-time buckets of the breakdown; the last bucket is open
GAP_EDGES = (15.0, 30.0, 60.0, 120.0, 300.0)


@dataclass(frozen=True)
class Category:
    """One row of the breakdown."""

    kind: str  #: "first-block" (position 0 of the chain), "2nd-access", "3rd+-access"
    gap_bucket: int  #: index into GAP_EDGES (len(GAP_EDGES): beyond the last edge)

    def label(self) -> str:
        lo = 0.0 if self.gap_bucket == 0 else GAP_EDGES[self.gap_bucket - 1]
        hi = f"{GAP_EDGES[self.gap_bucket]:g}" if self.gap_bucket < len(GAP_EDGES) else "inf"
        return f"{self.kind} gap {lo:g}-{hi} s"


@dataclass
class Breakdown:
    accesses: Counter = field(default_factory=Counter)  #: Category -> scored accesses (reuses only)
    hits: dict[str, Counter] = field(default_factory=dict)  #: policy -> Category -> host hits
    first_touches: int = 0  #: scored accesses of blocks never read before (no policy can hit them)
    total: int = 0  #: all scored accesses


def categories(reqs: Sequence[TraceRequest], score_from: float | None = None) -> list[Category | None]:
    """The category of every block access in replay order (None: a first touch, or not scored)."""
    last: dict[int, float] = {}
    count: Counter = Counter()
    out: list[Category | None] = []
    for r in reqs:
        scored = score_from is None or r.timestamp >= score_from
        for i, k in enumerate(r.hash_ids):
            cat = None
            if k in last and scored:
                gap = r.timestamp - last[k]
                b = next((j for j, e in enumerate(GAP_EDGES) if gap < e), len(GAP_EDGES))
                kind = "first-block" if i == 0 else ("2nd-access" if count[k] == 1 else "3rd+-access")
                cat = Category(kind, b)
            last[k] = r.timestamp
            count[k] += 1
            out.append(cat)
    return out


def host_hits(reqs: Sequence[TraceRequest], policy: str, blocks: int, policy_kwargs: dict | None = None) -> list[bool]:
    """Host hit flag of every block access in replay order: `replay.simulate`'s host tier (unbounded SSD)."""
    clock = ReplayClock()
    p = build_policy(policy, clock, blocks, **(policy_kwargs or {}))
    if policy == "belady":
        p.set_future(host_key_sequence(reqs))  # type: ignore[attr-defined]
    out: list[bool] = []
    simulate(reqs, p, blocks, clock=clock, host_flags=out)
    return out


def breakdown(reqs: Sequence[TraceRequest], policies: Sequence[str], blocks: int,
              score_from: float | None = None) -> Breakdown:
    cats = categories(reqs, score_from)
    bd = Breakdown()
    pos = 0
    for r in reqs:
        n = len(r.hash_ids)
        if score_from is None or r.timestamp >= score_from:
            bd.total += n
            for c in cats[pos:pos + n]:
                if c is None:
                    bd.first_touches += 1
                else:
                    bd.accesses[c] += 1
        pos += n
    for p in policies:
        flags = host_hits(reqs, p, blocks)
        bd.hits[p] = Counter(c for c, h in zip(cats, flags) if h and c is not None)
    return bd


def format_breakdown(bd: Breakdown, policies: Sequence[str]) -> str:
    head = f"{'category':<30}{'accesses':>9}" + "".join(f"{p[:13]:>14}" for p in policies)
    lines = [head, "-" * len(head)]
    order = sorted(bd.accesses, key=lambda c: (c.kind, c.gap_bucket))
    for c in order:
        lines.append(f"{c.label():<30}{bd.accesses[c]:>9}" + "".join(f"{bd.hits[p][c]:>14}" for p in policies))
    tot = bd.total or 1
    lines.append(f"{'hit rate (all scored accesses)':<30}{bd.total:>9}"
                 + "".join(f"{100 * sum(bd.hits[p].values()) / tot:>13.2f}%" for p in policies))
    lines.append(f"first touches (never hittable): {bd.first_touches}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace")
    ap.add_argument("--host-capacity", default="0.02", help="fraction of the scored unique blocks, or N blocks")
    ap.add_argument("--policies", default="lru,answer-length,belady")
    ap.add_argument("--until", type=float, default=None, help="replay only requests before this time (s)")
    ap.add_argument("--score-from", type=float, default=None, help="count only requests from this time on (s)")
    args = ap.parse_args(argv)
    reqs = read_trace(args.trace)
    if args.until is not None:
        reqs = [r for r in reqs if r.timestamp < args.until]
    scored = [r for r in reqs if args.score_from is None or r.timestamp >= args.score_from]
    cap = parse_capacity(args.host_capacity, unique_blocks(scored))
    if cap.blocks is None:
        raise SystemExit("--host-capacity must be bounded")
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    bd = breakdown(reqs, policies, cap.blocks, args.score_from)
    print(f"{args.trace}: host capacity {cap.blocks} blocks")
    print(format_breakdown(bd, policies))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
