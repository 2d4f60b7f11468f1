"""Recording of the host tier's policy stream (`kvtier.record_host_policy: DIR`), for an exact offline replay
(`kvtier replay-stream`, `kvtier.replay.policy_stream`).

Off by default: the host-tier adapter then builds the plain `HostPolicyCalls` and LMCache's plain dict, and nothing
here runs. `configure(DIR)` (the connector calls it before LMCache builds its host tier) makes every host tier built
afterwards in this process record: the policy reads its clock through the recorder, the adapter's calls go through
`RecordingHostPolicyCalls`, and LMCache's dict of chunks is a `LookupRecordingDict`. One JSON object a line, in
`DIR/host-policy-<pid>-<n>.jsonl`:

- `{"op": "start", "policy": NAME, "pid": PID}` first;
- `{"op": "key", "k": ID, "h": HASH}` the first time a chunk key appears: its id in this file and its `hash()`
  (policies sample keys by hash; the replay's keys hash the same);
- `put`, `hit`, `force_evict` (`k`), `evict` (`n`; `asked`: [ID, state] for each entry the policy offered, as
  the tier answered; `victims`), `request` (`chain`, `now`), `finished` (`chain`, `tokens`, `now`): the adapter's
  calls and the session signals, each with `t`, the clock times the policy read during the call, in order;
- `{"op": "lookup", "k": ID, "via": "contains"|"pin", "found": BOOL}`: the host tier asked whether it holds a
  chunk (LMCache never tells the policy of a miss);
- `{"op": "drop", "k": ID}`: the chunk left LMCache's dict (a victim, a forced removal, or a removal the policy is
  not told of, which leaves a stale entry in the policy until an eviction finds it gone).

Records are written under the lock that orders what they record: the adapter's calls and the signals under the
adapter's lock, lookups inside LMCache's own lock (the dict's membership test), so the file's order is the
order in which the policy and the tier saw them.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Hashable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

from kvtier.storage_backends.eviction import session_signals
from kvtier.storage_backends.eviction.base import EvictionPolicy, Key
from kvtier.storage_backends.eviction.host_calls import ChunkState, HostPolicyCalls

logger = logging.getLogger(__name__)

__all__ = ["LookupRecordingDict", "RecordingHostPolicyCalls", "StreamRecorder", "configure", "directory",
           "lookup_scope"]

_directory: str | None = None
_numbers = itertools.count()
_scope = threading.local()


def configure(path: str | None) -> None:
    """Record the policy stream of every host tier built from now on in this process into directory `path`
    (created if missing); None stops recording new host tiers."""
    global _directory
    if path:
        os.makedirs(path, exist_ok=True)
    _directory = path or None


def directory() -> str | None:
    """Where host tiers built now record their stream; None: recording is off."""
    return _directory


class StreamRecorder:
    """One host tier's stream file: key ids, the policy's clock reads, one record per call (thread-safe)."""

    def __init__(self, path: str | Path, policy_name: str) -> None:
        self.path = Path(path)
        self._file: IO[str] = open(self.path, "w", buffering=1)  # noqa: SIM115 (open for the tier's lifetime)
        self._lock = threading.Lock()
        self._ids: dict[Hashable, int] = {}
        self._clock_reads: list[float] = []  # appended and taken under the adapter's lock
        self._write({"op": "start", "policy": policy_name, "pid": os.getpid()})

    @classmethod
    def in_directory(cls, path: str, policy_name: str) -> StreamRecorder:
        rec = cls(Path(path) / f"host-policy-{os.getpid()}-{next(_numbers)}.jsonl", policy_name)
        logger.info("kvtier: recording the host tier's %s policy stream into %s", policy_name, rec.path)
        return rec

    def clock(self) -> float:
        """The policy's clock: the monotonic time, remembered for the record of the call that reads it."""
        t = time.monotonic()
        self._clock_reads.append(t)
        return t

    def record(self, op: str, keys: dict[str, Key] | None = None, chains: dict[str, Sequence[Key]] | None = None,
               clocked: bool = True, **fields: Any) -> None:
        """Write one record: `keys` and `chains` as key ids, `fields` as they are, the clock reads since the last
        clocked record as `t`."""
        rec: dict[str, Any] = {"op": op}
        if clocked:
            rec["t"], self._clock_reads = self._clock_reads, []
        with self._lock:
            for name, key in (keys or {}).items():
                rec[name] = self._id(key)
            for name, chain in (chains or {}).items():
                rec[name] = [self._id(k) for k in chain]
            rec.update(fields)
            self._write(rec)

    def key_ids(self, keys: Sequence[Key]) -> list[int]:
        with self._lock:
            return [self._id(k) for k in keys]

    def _id(self, key: Key) -> int:
        n = self._ids.get(key)
        if n is None:
            n = self._ids[key] = len(self._ids)
            self._write({"op": "key", "k": n, "h": hash(key)})
        return n

    def _write(self, rec: dict[str, Any]) -> None:
        with contextlib.suppress(ValueError):  # closed: the tier is shutting down
            self._file.write(json.dumps(rec, separators=(",", ":")) + "\n")

    def close(self) -> None:
        with self._lock:
            self._file.close()


class RecordingHostPolicyCalls(HostPolicyCalls):
    """`HostPolicyCalls` that records each call, and receives the session signals itself to record them."""

    def __init__(self, policy: EvictionPolicy, recorder: StreamRecorder, lock: threading.RLock | None = None
                 ) -> None:
        super().__init__(policy, lock)
        self.recorder = recorder

    def register_signals(self) -> None:
        session_signals.register(self, lock=self.lock)

    def hit(self, key: Key) -> None:
        with self.lock:
            super().hit(key)
            self.recorder.record("hit", {"k": key})

    def put(self, key: Key) -> None:
        with self.lock:
            super().put(key)
            self.recorder.record("put", {"k": key})

    def force_evict(self, key: Key) -> None:
        with self.lock:
            super().force_evict(key)
            self.recorder.record("force_evict", {"k": key})

    def evict_candidates(self, num_candidates: int, state: Callable[[Key], ChunkState]) -> list[Key]:
        asked: list[tuple[Key, ChunkState]] = []

        def recorded_state(k: Key) -> ChunkState:
            s = state(k)
            asked.append((k, s))
            return s

        with self.lock:
            out = super().evict_candidates(num_candidates, recorded_state)
            ids = self.recorder.key_ids([k for k, _ in asked])
            self.recorder.record("evict", chains={"victims": out}, n=num_candidates,
                                 asked=[[i, s] for i, (_, s) in zip(ids, asked)])
        return out

    def on_request(self, chain: Sequence[Key], now: float | None = None) -> None:
        super().on_request(chain, now)
        self.recorder.record("request", chains={"chain": chain}, now=now)

    def on_request_finished(self, chain: Sequence[Key], answer_tokens: int, now: float | None = None) -> None:
        super().on_request_finished(chain, answer_tokens, now)
        self.recorder.record("finished", chains={"chain": chain}, tokens=answer_tokens, now=now)


@contextmanager
def lookup_scope(via: str) -> Iterator[None]:
    """Around a host-tier lookup (`contains`, `pin`): its membership test in the chunk dict is recorded."""
    _scope.via = via
    try:
        yield
    finally:
        _scope.via = None


class LookupRecordingDict(dict[Any, Any]):
    """LMCache's dict of host chunks, recording the membership test of each lookup (inside LMCache's lock, where
    the answer is decided) and each chunk that leaves it."""

    def __init__(self, recorder: StreamRecorder) -> None:
        super().__init__()
        self.recorder = recorder

    def pop(self, key: Any, *default: Any) -> Any:
        held = dict.__contains__(self, key)
        value = dict.pop(self, key, *default)
        if held:
            self.recorder.record("drop", {"k": key}, clocked=False)
        return value

    def __delitem__(self, key: Any) -> None:
        dict.__delitem__(self, key)
        self.recorder.record("drop", {"k": key}, clocked=False)

    def __contains__(self, key: object) -> bool:
        found = dict.__contains__(self, key)
        via = getattr(_scope, "via", None)
        if via is not None:
            _scope.via = None  # one record per lookup: its first test
            self.recorder.record("lookup", {"k": key}, clocked=False, via=via, found=found)
        return found
