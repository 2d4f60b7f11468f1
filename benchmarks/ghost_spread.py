"""How much the answer-length policy's hit rate hangs on one ghost sampling hash, on the TUNING half only.

    .venv/bin/python benchmarks/ghost_spread.py [--trace PATH] [--salts 6] [--sizes 0.02,0.05,0.1]
        [--config '{"ghost_capacity": 80}']

Replays the first 15 minutes of the conversation trace (hits counted from t >= 450 s) at the held-out cache sizes
in blocks (fractions of the unique blocks of the second 15 minutes, as `eviction_replay.py` scores them), once per
ghost sampling salt (`ghost_salt` 0..N-1: independent hashes, so independent samples), and prints per size the hits
per salt, their mean, the sample standard deviation and the range. It never replays the held-out half.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from kvtier.replay.runner import parse_capacity, replay_one
from kvtier.replay.traces import read_trace, unique_blocks

REPO = Path(__file__).resolve().parents[1]
#: a checkout beside ../shared, or a worktree one level further down (as in eviction_replay.py)
SHARED = next((p for p in (REPO.parent / "shared" / "traces", REPO.parent.parent / "shared" / "traces")
               if p.exists()), REPO.parent / "shared" / "traces")
TRACE = SHARED / "mooncake_conversation_first30min.jsonl"
TUNE_END_S = 900.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trace", default=str(TRACE),
                    help="the first 30 minutes of conversation_trace.jsonl of https://github.com/kvcache-ai/Mooncake "
                         "(FAST25-release/traces); see docs/development.md, 'Traces' (default: %(default)s)")
    ap.add_argument("--salts", type=int, default=6)
    ap.add_argument("--sizes", default="0.02,0.05,0.1", help="fractions of the held-out half's unique blocks")
    ap.add_argument("--config", default="{}", help="answer-length options (JSON), e.g. ghost_capacity")
    a = ap.parse_args()
    kw = json.loads(a.config)
    reqs = read_trace(a.trace)
    held_unique = unique_blocks(r for r in reqs if r.timestamp >= TUNE_END_S)
    tune = [r for r in reqs if r.timestamp < TUNE_END_S]
    print(f"tuning half only (t < {TUNE_END_S:.0f} s, scored from {TUNE_END_S / 2:.0f} s); config {kw or 'defaults'}")
    for f in (float(x) for x in a.sizes.split(",")):
        cap = parse_capacity(f"{round(f * held_unique)}blocks", held_unique)
        rates = []
        for salt in range(a.salts):
            r = replay_one(tune, "answer-length", cap, policy_kwargs={**kw, "ghost_salt": salt}, score_from=450.0)
            rates.append(100.0 * r.hit_rate)
        sd = statistics.stdev(rates) if len(rates) > 1 else 0.0
        print(f"{f:g} ({cap.blocks} blocks): hit% " + " ".join(f"{x:.2f}" for x in rates)
              + f" | mean {statistics.mean(rates):.2f} sd {sd:.2f} range {max(rates) - min(rates):.2f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
