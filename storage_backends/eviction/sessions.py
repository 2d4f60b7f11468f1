"""Sessions (conversations) inferred from prefix chains, for session-aware eviction.

A follow-up turn repeats its parent's whole prompt (except, usually, the parent's partial last chunk) and appends
to it. So the chunk a chain ends at identifies the session tail: the tracker indexes the last two keys of each
session's latest chain, and a new chain whose key at position j is such a tail of a session whose chain had
`j + 1` or `j + 2` keys (and that starts with the same key) continues that session. At least two matched keys are
required, so a shared first chunk (a system prompt) alone never links two conversations.

Memory is bounded: at most `max_sessions` records; the least recently active session without resident chunks is
forgotten first (its tail keys leave the index).
"""

from __future__ import annotations

import itertools
import logging
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvtier.storage_backends.eviction.reuse_model import Item

logger = logging.getLogger(__name__)

Key = Hashable


class Session:
    """One conversation, as the policy sees it. Also the eviction unit of its resident history chunks."""

    __slots__ = (
        "sid", "depth", "chain_len", "first_key", "tail_keys", "last_time", "answer_tokens", "keys", "new_blocks",
        "prev_gap", "item", "cls", "lb", "ver", "filed", "nbytes", "entry", "until", "epoch",
        "__weakref__",
    )

    def __init__(self, sid: int, now: float) -> None:
        self.sid = sid
        self.depth = 0  #: turns seen so far
        self.chain_len = 0  #: keys in the latest chain
        self.first_key: Key = None
        self.tail_keys: tuple = ()
        self.last_time = now  #: arrival of the latest turn
        self.answer_tokens: int | None = None  #: answer of the latest turn (None while in flight)
        self.keys: OrderedDict[Key, int] = OrderedDict()  #: resident history chunks, prefix order -> size
        self.new_blocks = 0  #: keys the latest turn added to the chain (the user's new input, roughly)
        self.prev_gap: float | None = None  #: seconds between the two latest turns (None after a first turn)
        # Set by the eviction policy:
        self.item: Item | None = None  #: the reuse-model item waiting for the next turn
        self.cls = -1  #: row of the policy's score tables (its class, timed once the answer is known)
        self.lb = 0  #: reuse-time bucket the next turn cannot come before (answer-length lower bound)
        self.ver = 0  #: bumped whenever the policy re-scores the session (stale heap entries are skipped)
        self.filed = False  #: has a live entry in the policy's eviction heap
        self.nbytes = 0  #: total size of the resident history chunks (kept by the policy)
        self.entry: tuple | None = None  #: its latest heap entry, with when it stops being current (the policy's)
        self.until = 0.0
        self.epoch = -1

    def __repr__(self) -> str:
        return f"Session(sid={self.sid}, depth={self.depth}, keys={len(self.keys)}, answer={self.answer_tokens})"


class SessionTracker:
    def __init__(self, max_sessions: int = 100_000) -> None:
        self.max_sessions = max_sessions
        self._by_tail: dict[Key, Session] = {}
        self._sessions: OrderedDict[int, Session] = OrderedDict()
        self._ids = itertools.count()
        self.forgotten = 0

    def __len__(self) -> int:
        return len(self._sessions)

    def find_parent(self, chain: Sequence[Key]) -> Session | None:
        """The session this chain continues, or None (a new conversation)."""
        by_tail = self._by_tail
        if not by_tail or len(chain) < 2:
            return None
        first = chain[0]
        for j in range(len(chain) - 1, 0, -1):
            s = by_tail.get(chain[j])
            if s is not None and s.chain_len - 2 <= j <= s.chain_len - 1 and s.first_key == first:
                return s
        return None

    def begin(self, chain: Sequence[Key], now: float) -> tuple[Session, bool]:
        """Attribute a new request's chain to a session: (session, is_follow_up)."""
        parent = self.find_parent(chain)
        if parent is None:
            s = Session(next(self._ids), now)
            self._sessions[s.sid] = s
            self._trim()
        else:
            s = parent
            self._sessions.move_to_end(s.sid)
        for k in s.tail_keys:
            if self._by_tail.get(k) is s:
                del self._by_tail[k]
        s.depth += 1
        s.new_blocks = len(chain) - max(0, s.chain_len - 1) if parent is not None else len(chain)
        s.prev_gap = now - s.last_time if parent is not None else None
        s.chain_len = len(chain)
        s.first_key = chain[0] if chain else None
        s.last_time = now
        s.answer_tokens = None
        s.tail_keys = tuple(chain[-2:])
        for k in s.tail_keys:
            self._by_tail[k] = s
        return s, parent is not None

    def session_of_chain(self, chain: Sequence[Key]) -> Session | None:
        """The session whose latest chain is `chain` (for on_request_finished)."""
        if not chain:
            return None
        s = self._by_tail.get(chain[-1])
        if s is not None and s.chain_len == len(chain):
            return s
        return None

    def _trim(self) -> None:
        if len(self._sessions) <= self.max_sessions:
            return
        for _ in range(len(self._sessions)):
            sid, s = next(iter(self._sessions.items()))
            if s.keys:  # still has resident chunks: keep, look further
                self._sessions.move_to_end(sid)
                continue
            del self._sessions[sid]
            for k in s.tail_keys:
                if self._by_tail.get(k) is s:
                    del self._by_tail[k]
            s.tail_keys = ()
            self.forgotten += 1
            if len(self._sessions) <= self.max_sessions:
                return
