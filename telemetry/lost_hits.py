"""Where the hits an unbounded prefix cache would have had went: the lost-hit ledger.

The limit for any KV tier is an engine whose own cache holds everything it ever computed: a request then reuses
the longest prefix of its prompt that some earlier request computed (page-aligned, at least one prompt token left
to compute, as vLLM's prefix cache does). `LostHitLedger` keeps that limit beside the real engine and, for each
admitted request, splits the difference between it (`ideal`) and what the engine reused (`hit`: vLLM's own cache
plus kvtier's tiers) into reasons, a partition:

- `recomputed`: the lookup found the tokens in a tier, but the request did not load them (the load plan chose to
  recompute, a deadline, the request's last token, vLLM trimmed the hit);
- past what the lookup found, the first missing chunk decides the rest of the prefix (the walk stops there):
  `save_in_flight` (its save was issued and has not landed yet), `not_saved` (never issued, or the worker did not
  store it: identity, back-pressure, no host room), `evicted` (it landed and is gone);
- `not_found`: the tail of the ideal prefix that is no whole chunk (kvtier stores whole chunks only: alignment).

`ideal - hit == lost - beyond_ideal`, where `beyond_ideal` counts hits past the limit (KV from before this process:
the SSD tier outlives it). Keys are chained hashes of key tokens over pages, seeded by the identity tag, so one
tenant's prefix never counts for another. Memory is bounded: the limit remembers at most `capacity` pages and the
save states as many chunks, least recently used first out (a forgotten chunk reads as `not_saved`). Plain Python,
no vLLM or LMCache import; the connector's scheduler side feeds it.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

__all__ = ["REASONS", "LostHitLedger", "LostHits", "SaveState"]

#: the reasons a hit of the limit was lost, in the order of the request's prefix walk
REASONS = ("recomputed", "save_in_flight", "not_saved", "evicted", "not_found")


class SaveState(Enum):
    IN_FLIGHT = "in_flight"  #: issued to the workers, not reported done
    LANDED = "landed"  #: stored by every rank
    DROPPED = "dropped"  #: reported done but not stored (a failed or partial store)


#: the reason the first missing chunk of a prefix gives, by its save state (none known: `not_saved`)
_REASON_OF = {SaveState.IN_FLIGHT: "save_in_flight", SaveState.LANDED: "evicted", SaveState.DROPPED: "not_saved"}


@dataclass(frozen=True)
class LostHits:
    """One admitted request: the limit's hit, the engine's, and the difference by reason (tokens)."""

    ideal: int
    hit: int
    recomputed: int = 0
    save_in_flight: int = 0
    not_saved: int = 0
    evicted: int = 0
    not_found: int = 0
    beyond_ideal: int = 0

    @property
    def lost(self) -> int:
        return self.recomputed + self.save_in_flight + self.not_saved + self.evicted + self.not_found

    def reasons(self) -> dict[str, int]:
        return {"recomputed": self.recomputed, "save_in_flight": self.save_in_flight, "not_saved": self.not_saved,
                "evicted": self.evicted, "not_found": self.not_found}


class _Bounded:
    """An insertion-ordered map of at most `capacity` keys; a touched key moves to the young end."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._d: collections.OrderedDict[int, SaveState | None] = collections.OrderedDict()

    def __contains__(self, key: int) -> bool:
        return key in self._d

    def __len__(self) -> int:
        return len(self._d)

    def get(self, key: int) -> SaveState | None:
        return self._d.get(key)

    def put(self, key: int, value: SaveState | None = None) -> None:
        self._d[key] = value
        self._d.move_to_end(key)
        while len(self._d) > self.capacity:
            self._d.popitem(last=False)

    def touch(self, key: int) -> None:
        self._d.move_to_end(key)


class LostHitLedger:
    """The limit (pages computed so far) and the save state of every chunk, keyed by chained page hashes."""

    def __init__(self, page: int, chunk: int, capacity: int = 1 << 18) -> None:
        if page <= 0 or chunk % page:
            raise ValueError(f"the chunk ({chunk} tokens) must be a multiple of the page ({page} tokens)")
        self.page, self.chunk = page, chunk
        self._per_chunk = chunk // page
        self._computed = _Bounded(capacity)
        self._saves = _Bounded(capacity)
        self._keys: dict[str, list[int]] = {}  # request -> chained key of each of its pages hashed so far
        self._seed: dict[str, int] = {}
        self._joined: dict[str, int] = {}  # request -> its pages already in the limit
        self._jobs: dict[int, list[int]] = {}  # save job -> its chunks' keys
        self.totals: collections.Counter[str] = collections.Counter()
        #: recent admitted requests: request id -> its account, oldest first
        self.recent: collections.OrderedDict[str, LostHits] = collections.OrderedDict()
        self.recent_max = 4096

    # ------------------------------------------------------------------ keys
    def keys(self, rid: str, tag: str, tokens: Sequence[int], end: int) -> list[int]:
        """The chained key of each full page of `tokens[:end]` (key tokens of request `rid`, identity `tag`)."""
        keys = self._keys.get(rid)
        if keys is None:
            keys = self._keys[rid] = []
            self._seed[rid] = hash(("kvtier-lost-hits", tag))
        page = self.page
        h = keys[-1] if keys else self._seed[rid]
        for i in range(len(keys), end // page):
            h = hash((h, tuple(tokens[i * page:(i + 1) * page])))
            keys.append(h)
        return keys[:end // page] if len(keys) > end // page else keys

    def joins(self, rid: str, end: int) -> bool:
        """Whether `computed(rid, ..., end)` would add a page to the limit (cheap: no key tokens needed)."""
        return end // self.page > self._joined.get(rid, 0)

    def _chunk_keys(self, keys: list[int], start: int, end: int) -> list[int]:
        """Keys of the whole chunks in tokens [start, end) (a chunk's key is its last page's)."""
        c = self._per_chunk
        return [keys[(i + 1) * c - 1] for i in range(start // self.chunk, end // self.chunk)
                if (i + 1) * c <= len(keys)]

    # ------------------------------------------------------------------ events
    def computed(self, rid: str, tag: str, tokens: Sequence[int], end: int) -> None:
        """The engine computed (or loaded) the KV of `tokens[:end]`: its full pages join the limit."""
        keys = self.keys(rid, tag, tokens, end)
        for k in keys[self._joined.get(rid, 0):]:
            self._computed.put(k)
        self._joined[rid] = max(len(keys), self._joined.get(rid, 0))

    def save_issued(self, job: int, rid: str, tag: str, tokens: Sequence[int], start: int, end: int) -> None:
        """Save job `job` stores `rid`'s chunks in tokens [start, end)."""
        chunks = self._chunk_keys(self.keys(rid, tag, tokens, end), start, end)
        self._jobs[job] = chunks
        for k in chunks:
            if self._saves.get(k) is not SaveState.LANDED:
                self._saves.put(k, SaveState.IN_FLIGHT)

    def save_done(self, job: int, stored: int | None = None) -> None:
        """Every rank reported save job `job`: its first `stored` chunks landed (None: all), the rest did not."""
        chunks = self._jobs.pop(job, [])
        n = len(chunks) if stored is None else stored
        for i, k in enumerate(chunks):
            if i < n:
                self._saves.put(k, SaveState.LANDED)
            elif self._saves.get(k) is not SaveState.LANDED:
                self._saves.put(k, SaveState.DROPPED)

    def forget(self, rid: str) -> None:
        """`rid` finished: its keys are no longer extended (its pages and chunks stay known)."""
        self._keys.pop(rid, None)
        self._seed.pop(rid, None)
        self._joined.pop(rid, None)

    # ------------------------------------------------------------------ accounting
    def ideal_tokens(self, rid: str, tag: str, tokens: Sequence[int], prompt_len: int) -> int:
        """What the limit reuses of this prompt: its longest computed page prefix, leaving one token to compute."""
        cap = (prompt_len - 1) // self.page
        n = 0
        for k in self.keys(rid, tag, tokens, cap * self.page):
            if k not in self._computed:
                break
            self._computed.touch(k)
            n += 1
        return n * self.page

    def admitted(self, rid: str, tag: str, tokens: Sequence[int], prompt_len: int, hit: int,
                 found_end: int) -> LostHits:
        """Account for request `rid` at its admission: `hit` tokens reused (vLLM's cache + kvtier), `found_end` the
        end of the prefix its last lookup found in kvtier's tiers. Call before its own pages join the limit."""
        ideal = self.ideal_tokens(rid, tag, tokens, prompt_len)
        if hit >= ideal:
            acc = LostHits(ideal, hit, beyond_ideal=hit - ideal)
        else:
            found = min(ideal, found_end)
            recomputed = max(0, found - hit)
            start = max(hit, found)
            whole = ideal // self.chunk * self.chunk
            reasons = {"recomputed": recomputed, "not_found": ideal - max(start, whole)}
            if start < whole:
                keys = self.keys(rid, tag, tokens, whole)
                state = self._saves.get(keys[(start // self.chunk + 1) * self._per_chunk - 1])
                reasons["not_saved" if state is None else _REASON_OF[state]] = whole - start
            acc = LostHits(ideal, hit, **reasons)
        self.totals.update(ideal=acc.ideal, hit=acc.hit, beyond_ideal=acc.beyond_ideal, **acc.reasons())
        self.recent[rid] = acc
        while len(self.recent) > self.recent_max:
            self.recent.popitem(last=False)
        return acc
