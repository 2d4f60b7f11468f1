"""An experiment of issue 29 (not shipped): admission at the second access (`2q`) and a tier split between
answer-length (first-seen chunks) and LRU (chunks seen twice), scored on the rolling folds.

    .venv/bin/python benchmarks/doorkeeper_split.py [--conversation PATH] [--poisson PATH] [--tune-only]

Why: vLLM's `store_threshold=2` variants beat answer-length at 5% and 10% on some conversation folds, while
answer-length wins at 2%. Where each wins, by kind of access (follow-up depth, age since the last access), is the
question; whether one policy can hold both is the experiment.

Variants (every one replayed by `kvtier.replay.runner.simulate`, the replay every eviction figure uses):
- `2q`: first-seen chunks on a FIFO probation evicted first; chunks stored again while a doorkeeper remembers them
  (the last `ghost_multiple` x capacity distinct chunks stored) or hit on probation go to an LRU main queue.
- `split S`: the same doorkeeper, but probation is ordered by answer-length and holds up to S of the capacity
  before main (LRU) gives way; `split auto`: S moved by ghost hits of each side (the last 5% of the capacity
  evicted from each), ARC-style.
Choices (the doorkeeper's 4x, S = 0.1, the ghosts' 5%) were made on the tuning fold only: minutes [5, 10) of the
conversation trace after a warm-up on [0, 5), which no scored fold contains. The folds are `eviction_replay.py`'s.
"""

from __future__ import annotations

import argparse
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator, Sequence

from kvtier.replay.folds import Fold, fold_capacity, fold_requests, rolling_folds, rolling_folds_for
from kvtier.replay.runner import ReplayClock, build_policy, host_key_sequence, simulate
from kvtier.replay.synthetic import BurstySpec, bursty_trace
from kvtier.replay.traces import TraceRequest, read_trace
from kvtier.storage_backends.eviction.base import EvictionPolicy, Key

SIZES = (0.02, 0.05, 0.10)


class SplitPolicy(EvictionPolicy):
    """Probation (first-seen chunks) under one policy, main (seen twice) under another; probation gives way first
    once it holds more than `share` of the capacity (always, with share 0)."""

    name = "split"

    def __init__(self, probation: EvictionPolicy, main: EvictionPolicy, capacity: int, share: float,
                 auto: bool = False, ghost_multiple: float = 4.0, ghost_share: float = 0.05) -> None:
        super().__init__(None)
        self.probation, self.main, self.cap, self.share, self.auto = probation, main, capacity, share, auto
        self.seen: OrderedDict[Key, None] = OrderedDict()
        self.remembered = int(ghost_multiple * capacity)
        self.ghost_len = max(1, int(ghost_share * capacity))
        self.on_probation: set[Key] = set()
        self.in_main: set[Key] = set()
        self.ghosts: dict[str, OrderedDict[Key, None]] = {"probation": OrderedDict(), "main": OrderedDict()}

    def on_request(self, chain: Sequence[Key], now: float | None = None) -> None:
        self.probation.on_request(chain, now)
        self.main.on_request(chain, now)

    def on_request_finished(self, chain: Sequence[Key], answer_tokens: int, now: float | None = None) -> None:
        self.probation.on_request_finished(chain, answer_tokens, now)
        self.main.on_request_finished(chain, answer_tokens, now)

    def on_insert(self, key: Key, size: int = 1) -> None:
        if key in self.seen:
            self.seen.move_to_end(key)
            if self.auto:
                step = 1 / self.cap
                if self.ghosts["main"].pop(key, 0) is None:
                    self.share = max(0.0, self.share - step)
                elif self.ghosts["probation"].pop(key, 0) is None:
                    self.share = min(1.0, self.share + step)
            self.in_main.add(key)
            self.main.on_insert(key, size)
            return
        self.seen[key] = None
        while len(self.seen) > self.remembered:
            self.seen.popitem(last=False)
        self.on_probation.add(key)
        self.probation.on_insert(key, size)

    def on_access(self, key: Key) -> None:
        if key in self.on_probation:
            self.on_probation.discard(key)
            self.probation.on_remove(key)
            self.in_main.add(key)
            self.main.on_insert(key, 1)
        else:
            self.main.on_access(key)

    def on_remove(self, key: Key) -> None:
        side = "probation" if key in self.on_probation else "main"
        (self.on_probation if side == "probation" else self.in_main).discard(key)
        (self.probation if side == "probation" else self.main).on_remove(key)
        ghost = self.ghosts[side]
        ghost[key] = None
        if len(ghost) > self.ghost_len:
            ghost.popitem(last=False)

    def victims(self, need: int, evictable: Callable[[Key], bool]) -> Iterator[Key]:
        freed = 0
        while freed < need:
            first = self.on_probation and (len(self.on_probation) > self.share * self.cap or not self.in_main)
            order = (self.probation, self.main) if first else (self.main, self.probation)
            key = next((k for src in order for k in src.victims(1, evictable)), None)
            if key is None:
                return
            freed += 1
            yield key

    def __len__(self) -> int:
        return len(self.on_probation) + len(self.in_main)

    def __contains__(self, key: Key) -> bool:
        return key in self.on_probation or key in self.in_main


def replay(reqs: Sequence[TraceRequest], fold: Fold, variant: str, fraction: float,
           flags: list[bool] | None = None) -> float:
    """Host hit rate (%) of one variant on one fold."""
    replayed, _ = fold_requests(reqs, fold)
    cap = fold_capacity(replayed, fraction).blocks or 1
    clock = ReplayClock()
    if variant.startswith("split"):
        arg = variant.split()[1]
        policy: EvictionPolicy = SplitPolicy(build_policy("answer-length", clock, cap), build_policy("lru", clock, cap),
                                             cap, 0.1 if arg == "auto" else float(arg), auto=arg == "auto")
    else:
        policy = build_policy(variant, clock, cap)
        if variant == "belady":
            policy.set_future(host_key_sequence(replayed))  # type: ignore[attr-defined]
    c = simulate(replayed, policy, cap, None, None, clock, None, fold.score_from_s, host_flags=flags)
    return 100.0 * c["host_hits"] / max(c["accesses"], 1)


def table(name: str, reqs: Sequence[TraceRequest], folds: Sequence[Fold], variants: Sequence[str]) -> None:
    print(f"\n## {name}: host hit rate %, folds {', '.join(f.name for f in folds)} at {SIZES}")
    rows: dict[str, list[float]] = {}
    for v in variants:
        t0 = time.perf_counter()
        rows[v] = [replay(reqs, f, v, s) for s in SIZES for f in folds]
        print(f"{v:14s}", " ".join(f"{x:6.2f}" for x in rows[v]), f"({time.perf_counter() - t0:.0f} s)", flush=True)
    if "lru" in rows and "belady" in rows:
        print("gap LRU->Belady closed (%), worst fold per size:")
        for v in variants:
            if v in ("lru", "belady"):
                continue
            gaps = [(h - lo) / (b - lo) * 100 if b > lo else float("nan")
                    for h, lo, b in zip(rows[v], rows["lru"], rows["belady"], strict=True)]
            n = len(folds)
            worst = [min(gaps[i * n:(i + 1) * n]) for i in range(len(SIZES))]
            print(f"  {v:14s}", " / ".join(f"{w:5.1f}" for w in worst))


def where(reqs: Sequence[TraceRequest], fold: Fold, fraction: float, variants: Sequence[str]) -> None:
    """Hits per kind of scored access: the chunk's place (in the parent turn's prompt, or read before by another
    session), the request's turn (4: 4 and deeper) and the age since the chunk's last access."""
    flags = {v: [] for v in variants}
    for v in variants:
        replay(reqs, fold, v, fraction, flags[v])
    replayed, _ = fold_requests(reqs, fold)
    counts: Counter = Counter()
    last: dict[int, float] = {}
    owner: dict[int, int] = {}
    i = 0
    for r in replayed:
        parent = set(replayed[r.parent].hash_ids) if r.parent is not None else set()
        for k in r.hash_ids:
            if r.timestamp >= fold.score_from_s and k in last:
                place = "parent" if k in parent else "other session" if owner[k] != r.session else "own, older"
                age = r.timestamp - last[k]
                band = "<60 s" if age < 60 else "60-180 s" if age < 180 else "180-600 s" if age < 600 else ">=600 s"
                cell = (place, min(r.turn, 4), band)
                counts[cell + ("n",)] += 1
                for v in variants:
                    counts[cell + (v,)] += flags[v][i]
            i += 1
            last[k] = r.timestamp
            owner.setdefault(k, r.session)
    print(f"\n## where the hits are: fold {fold.name}, {fraction:.0%} (accesses of chunks seen before)")
    print(f"{'place':14s} {'turn':>4s} {'age':10s} {'n':>6s}", " ".join(f"{v:>10s}" for v in variants))
    for cell in sorted({c[:3] for c in counts}):
        if counts[cell + ("n",)] >= 100:
            print(f"{cell[0]:14s} {cell[1]:4d} {cell[2]:10s} {counts[cell + ('n',)]:6d}",
                  " ".join(f"{counts[cell + (v,)]:10d}" for v in variants))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--conversation", required=True, help="mooncake_conversation_first30min.jsonl")
    ap.add_argument("--poisson", help="mooncake_synthetic_poisson.jsonl (optional)")
    ap.add_argument("--tune-only", action="store_true", help="only the tuning fold (minutes [5, 10))")
    args = ap.parse_args()
    conv = read_trace(args.conversation)
    variants = ["lru", "answer-length", "2q", "split 0.1", "split auto", "belady"]
    table("conversation, tuning fold", conv, [Fold("5-10 min", 300, 600)],
          variants + ["split 0.05", "split 0.25", "split 0.5"])
    if args.tune_only:
        return
    folds = rolling_folds()
    table("conversation", conv, folds, variants)
    print("\n## the split's share at 2%, fold 15-20 min (how rough the surface is)")
    for share in (0.1, 0.3, 0.5, 0.7, 0.9):
        print(f"share {share}: {replay(conv, folds[1], f'split {share}', 0.02):.2f}")
    where(conv, folds[0], 0.10, ["answer-length", "2q", "belady"])
    others: list[tuple[str, list[TraceRequest]]] = []
    if args.poisson:
        others.append(("poisson", read_trace(args.poisson)))
    for sessions in (True, False):
        others.append((f"bursty-{'sessions' if sessions else 'no-sessions'}/1",
                       bursty_trace(BurstySpec(sessions=sessions, seed=1))))
    for name, reqs in others:
        table(name, reqs, rolling_folds_for(reqs, 4), ["lru", "arc", "s3fifo", "answer-length", "2q", "split 0.1"])


if __name__ == "__main__":
    main()
