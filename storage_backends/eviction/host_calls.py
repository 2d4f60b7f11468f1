"""The host tier's calls into a kvtier eviction policy, in plain Python: one object that LMCache's host tier drives
(through the adapter in `storage_backends/lmcache/host_policy.py`) and that the offline replay of a recorded
stream (`kvtier.replay.policy_stream`) drives the same way.

LMCache keeps its own dict as the store and asks the policy only for an order: `hit` (a read), `put` (a store: a
new entry, or a touch of one the policy holds), `force_evict` (LMCache removed the entry itself) and
`evict_candidates(n, state)` (the victims LMCache then removes; `state(key)` says whether the entry may go now).
The lock orders these calls and the session signals (`session_signals`), which arrive from other threads.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Literal

from kvtier.storage_backends.eviction import session_signals
from kvtier.storage_backends.eviction.base import EvictionPolicy, Key

#: what the tier says of an entry the policy offers as a victim: it may go, it is pinned or being read, or the
#: tier no longer holds it (LMCache dropped it without telling the policy: a stale entry)
ChunkState = Literal["evictable", "busy", "gone"]
EVICTABLE: ChunkState = "evictable"
BUSY: ChunkState = "busy"
GONE: ChunkState = "gone"


class HostPolicyCalls:
    """The host tier's view of one policy: the calls LMCache makes, under one lock."""

    def __init__(self, policy: EvictionPolicy, lock: threading.RLock | None = None) -> None:
        self.policy = policy
        self.lock = lock or threading.RLock()  # held around every policy call; session signals take it too

    @property
    def name(self) -> str:
        return self.policy.name

    def register_signals(self) -> None:
        """Let the policy receive the process's session signals, under this object's lock."""
        session_signals.register(self.policy, lock=self.lock)

    def hit(self, key: Key) -> None:
        with self.lock:
            if key in self.policy:
                self.policy.on_access(key)

    def put(self, key: Key) -> None:
        with self.lock:
            if key in self.policy:
                self.policy.on_access(key)
            else:
                self.policy.on_insert(key, 1)

    def force_evict(self, key: Key) -> None:
        with self.lock:
            self.policy.on_remove(key)

    def evict_candidates(self, num_candidates: int, state: Callable[[Key], ChunkState]) -> list[Key]:
        """Up to `num_candidates` victims, removed from the policy (LMCache removes them without telling it);
        entries the tier no longer holds are dropped from the policy too."""
        stale: list[Key] = []

        def evictable(k: Key) -> bool:
            s = state(k)
            if s == GONE:
                stale.append(k)
                return False
            return s == EVICTABLE

        out: list[Key] = []
        with self.lock:
            for key in self.policy.victims(num_candidates, evictable):
                out.append(key)
                self.policy.on_remove(key)
            for k in stale:
                self.policy.on_remove(k)
        return out

    # session signals (the sink `session_signals` calls, already under `lock`)
    def on_request(self, chain: Sequence[Key], now: float | None = None) -> None:
        self.policy.on_request(chain, now)

    def on_request_finished(self, chain: Sequence[Key], answer_tokens: int, now: float | None = None) -> None:
        self.policy.on_request_finished(chain, answer_tokens, now)
