"""The exact offline replay of a host tier's recorded policy stream (`kvtier.record_host_policy`,
`storage_backends/eviction/recording.py`): `kvtier replay-stream FILE [--policy NAME]`.

A fresh policy of the recorded name (`make_policy`) reads a clock that plays back the times the engine's policy
read, call by call, and receives the recorded calls in order through the same `HostPolicyCalls` the engine's
adapter used: puts, hits, forced removals, session signals, and at each recorded eviction the same request, the
tier's recorded answer for each entry the policy offers, compared with the recorded victims. Keys are stand-ins
that hash as the engine's keys did (policies sample by hash). The replay keeps the tier's residency (puts in;
victims, forced removals and the tier's other removals out) and answers each recorded lookup from it: its hits
and misses against the engine's. The first divergence (a victim, a lookup, an entry the engine was never asked
about, the clock read a different number of times) is reported with its record number; with the recorded policy
none is expected.
`--policy NAME` replays another policy on the same calls (a what-if: divergences are then expected).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtier.storage_backends.eviction import make_policy
from kvtier.storage_backends.eviction.base import Key
from kvtier.storage_backends.eviction.host_calls import EVICTABLE, GONE, ChunkState, HostPolicyCalls

__all__ = ["StreamKey", "StreamReplay", "add_arguments", "read_stream", "replay_stream", "run"]


class StreamKey:
    """A recorded chunk key: equal by its id in the file, hashing as the engine's key did."""

    __slots__ = ("h", "id")

    def __init__(self, key_id: int, h: int) -> None:
        self.id = key_id
        self.h = h

    def __hash__(self) -> int:
        return self.h

    def __eq__(self, other: object) -> bool:
        return isinstance(other, StreamKey) and other.id == self.id

    def __repr__(self) -> str:
        return f"key#{self.id}"


class _PlaybackClock:
    """The policy's clock in the replay: the recorded reads of the current call, in order."""

    def __init__(self) -> None:
        self.reads: list[float] = []
        self.overrun = 0
        self.last = 0.0

    def load(self, reads: list[float]) -> None:
        self.reads, self.overrun = list(reversed(reads)), 0

    def __call__(self) -> float:
        if self.reads:
            self.last = self.reads.pop()
        else:
            self.overrun += 1
        return self.last


@dataclass
class StreamReplay:
    """What the engine recorded and what the offline replay of it gives."""

    policy: str
    records: int = 0
    engine_hits: int = 0
    engine_misses: int = 0
    offline_hits: int = 0
    offline_misses: int = 0
    evictions: int = 0  # recorded get_evict_candidates calls
    victims: int = 0  # recorded victims
    signals: int = 0  # recorded session signals
    divergences: int = 0
    first_divergence: tuple[int, str] | None = None  # (record number, from 1, what differed)
    by_via: dict[str, list[int]] = field(default_factory=dict)  # lookup kind -> [engine hits, offline hits, n]

    @property
    def equal(self) -> bool:
        return self.first_divergence is None and (self.engine_hits, self.engine_misses) == (
            self.offline_hits, self.offline_misses)

    def diverge(self, number: int, what: str) -> None:
        self.divergences += 1
        if self.first_divergence is None:
            self.first_divergence = (number, what)

    def report(self) -> str:
        lines = [f"policy {self.policy}: {self.records} records, {self.evictions} evictions ({self.victims} victims), "
                 f"{self.signals} session signals",
                 f"  engine : {self.engine_hits} hits / {self.engine_misses} misses",
                 f"  offline: {self.offline_hits} hits / {self.offline_misses} misses"]
        for via, (eh, oh, n) in sorted(self.by_via.items()):
            lines.append(f"    {via}: {n} lookups, engine {eh} hits, offline {oh} hits")
        if self.first_divergence is None:
            lines.append("  no divergence: the replay made the engine's calls and got the engine's answers")
        else:
            n, what = self.first_divergence
            lines.append(f"  first divergence at record {n}: {what} ({self.divergences} in all)")
        return "\n".join(lines)


def read_stream(path: str | Path) -> list[dict[str, Any]]:
    """The records of a stream file; a last line cut short (the engine was killed mid-write) is left out."""
    lines = Path(path).read_text().splitlines()
    out: list[dict[str, Any]] = []
    for i, line in enumerate(lines):
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            if i == len(lines) - 1:
                break
            raise ValueError(f"{path}:{i + 1}: not a JSON record") from None
    if not out or out[0].get("op") != "start":
        raise ValueError(f"{path}: not a recorded host-policy stream (no start record)")
    return out


def replay_stream(records: Iterable[dict[str, Any]] | str | Path, policy: str | None = None) -> StreamReplay:
    """Replay a recorded stream (records, or a file) through a fresh policy (the recorded one unless `policy`)."""
    recs = read_stream(records) if isinstance(records, (str, Path)) else list(records)
    name = policy or recs[0]["policy"]
    clock = _PlaybackClock()
    calls = HostPolicyCalls(make_policy(name, clock=clock))
    keys: dict[int, StreamKey] = {}
    resident: set[Key] = set()
    out = StreamReplay(name)

    def key(i: int) -> StreamKey:
        return keys[i]

    for number, rec in enumerate(recs, 1):
        op = rec["op"]
        out.records += 1
        if "t" in rec:
            clock.load(rec["t"])
        if op == "key":
            keys[rec["k"]] = StreamKey(rec["k"], rec["h"])
        elif op == "put":
            calls.put(key(rec["k"]))
            resident.add(key(rec["k"]))
        elif op == "hit":
            calls.hit(key(rec["k"]))
        elif op == "force_evict":
            calls.force_evict(key(rec["k"]))
            resident.discard(key(rec["k"]))
        elif op == "evict":
            _evict(calls, rec, number, key, resident, out)
        elif op == "request":
            out.signals += 1
            calls.on_request([key(i) for i in rec["chain"]], rec["now"])
        elif op == "finished":
            out.signals += 1
            calls.on_request_finished([key(i) for i in rec["chain"]], rec["tokens"], rec["now"])
        elif op == "drop":
            resident.discard(key(rec["k"]))
        elif op == "lookup":
            _lookup(rec, number, key(rec["k"]) in resident, out)
        elif op != "start":
            raise ValueError(f"record {number}: unknown op {op!r}")
        if "t" in rec and (clock.reads or clock.overrun):
            out.diverge(number, f"{op}: the policy read the clock {len(rec['t']) + clock.overrun - len(clock.reads)} "
                                f"times, the engine's {len(rec['t'])}")
    return out


def _evict(calls: HostPolicyCalls, rec: dict[str, Any], number: int, key: Any, resident: set[Key],
           out: StreamReplay) -> None:
    answers: dict[int, ChunkState] = {i: s for i, s in rec["asked"]}
    out.evictions += 1
    out.victims += len(rec["victims"])

    def state(k: Key) -> ChunkState:
        assert isinstance(k, StreamKey)
        s = answers.get(k.id)
        if s is None:  # the engine's policy never offered this entry: answer from the replay's residency
            out.diverge(number, f"evict: the policy offered {k!r}, which the engine's policy did not")
            return EVICTABLE if k in resident else GONE
        return s

    victims = calls.evict_candidates(rec["n"], state)
    if [v.id for v in victims if isinstance(v, StreamKey)] != rec["victims"]:
        out.diverge(number, f"evict: victims {[v.id for v in victims if isinstance(v, StreamKey)]}, the engine's "
                            f"{rec['victims']}")
    for v in victims:
        resident.discard(v)
    for i, s in rec["asked"]:
        if s == GONE:
            resident.discard(key(i))


def _lookup(rec: dict[str, Any], number: int, offline: bool, out: StreamReplay) -> None:
    engine = bool(rec["found"])
    out.engine_hits += engine
    out.engine_misses += not engine
    out.offline_hits += offline
    out.offline_misses += not offline
    row = out.by_via.setdefault(rec.get("via", "lookup"), [0, 0, 0])
    row[0] += engine
    row[1] += offline
    row[2] += 1
    if engine != offline:
        out.diverge(number, f"lookup of key#{rec['k']}: the engine {'found' if engine else 'missed'} it, the "
                            f"replay {'found' if offline else 'missed'} it")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("streams", nargs="+", metavar="FILE", help="host-policy stream files (kvtier.record_host_policy)")
    p.add_argument("--policy", default=None, metavar="NAME",
                   help="replay this policy instead of the recorded one (a what-if; divergences are then expected)")


def run(args: argparse.Namespace) -> int:
    rc = 0
    for path in args.streams:
        try:
            res = replay_stream(path, args.policy)
        except (OSError, ValueError) as e:
            print(f"{path}: {e}")
            return 1
        print(f"{path}\n{res.report()}")
        if args.policy is None and not res.equal:
            rc = 1
    return rc
