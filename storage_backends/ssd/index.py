"""The SSD tier's index: which chunk lives in which slot, who may evict what, and what the journal says.

Plain Python, no I/O, no torch: entries (slot, generation, metadata), pins with expiry, readers, the free-slot
heap, the slot budget (the configured capacity, lowered while the disk is full), the eviction policy, and journal
replay. The I/O engine (`slot_io.SlotIO`) moves bytes; `tier.SSDTier` composes the two with the write queue.
The same object serves the LMCache plugin, the MP-mode L2 adapter and offline replays (`kvtier.replay.runner`).
`ChunkMeta` and `TierStats` are the shared contracts' (`kvtier.storage_backends.base`), re-exported here.

Slot life cycle: `reserve()` hands out a slot and a fresh generation (a free slot, a new slot below the budget, or
one freed by evicting an unpinned, unread chunk); the writer either `commit()`s a chunk into it or `unreserve()`s it.
An eviction for a reservation stays undoable until the writer journals its FREE record (`victim_frees`,
`settle_victims`): if that append fails, `restore_victims` puts the evicted chunk back, so a failing journal costs
only the chunks being stored, never one already committed.
A committed chunk leaves through `remove()`, eviction, or a failed read (`end_read` with a verdict); its slot is
freed when its last reader is done, and `on_slot_freed` is told (the tier journals a FREE record). Every operation
takes the index's lock; drop listeners and `on_slot_freed` run under it and must not block.
"""

from __future__ import annotations

import heapq
import logging
import threading
import time
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvtier.storage_backends import metrics as M
from kvtier.storage_backends.base import ChunkMeta, TierStats
from kvtier.storage_backends.eviction import EvictionPolicy
from kvtier.storage_backends.ssd.slot_format import TRUSTED_GENERATION, CommitRecord, FreeRecord, JournalRecord

logger = logging.getLogger(__name__)

#: A read's verdict when the chunk was not read at all (no room or engine for it): a miss, the chunk stays.
NOT_READ = "not_read"


@dataclass(slots=True)
class Entry:
    slot: int
    gen: int
    meta: ChunkMeta | CommitRecord  # a replayed CommitRecord carries the same fields as ChunkMeta
    seg: int
    pins: list[float] = field(default_factory=list)  # expiry times
    readers: int = 0
    removed: bool = False
    foreign: bool = False  # of another namespace (identity.namespace): never looked up, reclaimed first


@dataclass(frozen=True)
class Reservation:
    """A slot handed to the writer, with the generation its header and COMMIT record carry."""

    slot: int
    gen: int


@dataclass(frozen=True)
class ReplayReport:
    chunks: int
    dropped_for_capacity: int
    dropped_invalid: int  #: records out of range: a chunk larger than a slot, a generation not trusted
    stale: int  #: COMMIT records older than what their slot or key already held (duplicates, replays)
    max_gen: int
    foreign: int = 0  #: chunks of another namespace (kept, reclaimed first)


def _key_string(key: Any) -> str:
    """LMCache keys -> the tier's string keys (strings pass through)."""
    return key if isinstance(key, str) else key.to_string()


class SlotIndex:
    def __init__(self, max_slots: int, policy: EvictionPolicy, *, slot_size: int, pin_timeout_s: float,
                 layout_ok: Callable[[ChunkMeta], bool] | None = None,
                 on_slot_freed: Callable[[FreeRecord], None] | None = None,
                 stats: TierStats | None = None, clock: Callable[[], float] = time.monotonic,
                 own: Callable[[str], bool] | None = None) -> None:
        if max_slots < 1:
            raise ValueError("an SSD tier needs at least one slot")
        self.capacity = max_slots  #: configured slot budget
        self.limit = max_slots  #: effective budget (lower while the disk is full)
        self.slot_size = slot_size
        self.policy = policy
        self.pin_timeout_s = pin_timeout_s
        self.layout_ok = layout_ok or (lambda meta: True)
        #: whether a replayed key is of this tier's namespace; the others are foreign (`_foreign`)
        self.own = own or (lambda key: True)
        self.on_slot_freed = on_slot_freed or (lambda rec: None)
        self.stats = stats or TierStats()
        self.clock = clock
        self.lock = threading.RLock()
        self._entries: dict[str, Entry] = {}
        self._slot_owner: dict[int, str] = {}
        self._reserved: set[int] = set()
        self._free: list[int] = []  # heap of free slot numbers below _next_slot
        self._next_slot = 0
        self._gen = 0
        self._drop_listeners: list[Callable[[str, int, str], None]] = []
        #: committed chunks of another namespace, oldest first: outside the policy, the first to be reclaimed
        self._foreign: dict[str, None] = {}
        #: chunks evicted by `reserve()` whose slot is reserved but not yet written: slot -> (key, entry). Their
        #: drop is settled (listeners told) once the writer journaled their FREE records, or undone by
        #: `restore_victims` when it could not (a failed append costs no committed chunk).
        self._victims: dict[int, tuple[str, Entry]] = {}
        #: slots below the highest handed out that the disk had no room for (holes a slot file cut short leaves):
        #: kept out of use, and in `_reserved` so that every slot stays accounted for, until `restore_limit`
        self._parked: set[int] = set()
        policy.set_capacity(max_slots)
        from kvtier.storage_backends.eviction import session_signals

        session_signals.register(policy, _key_string, self.lock)

    # ------------------------------------------------------------------ journal replay
    def replay(self, records: Sequence[JournalRecord], *, max_nbytes: int,
               unallocated: Callable[[Iterable[int]], set[int]] = lambda slots: set()) -> ReplayReport:
        """Rebuild the index from journal records (file order = commit order). Records naming a slot beyond the
        capacity, not allocated on disk (`unallocated` names those among the slots it is given), a chunk larger
        than a slot or a generation at or above TRUSTED_GENERATION are skipped and counted (the generation
        counter resumes from the trusted ones only); per slot and per key the newest generation wins, whatever
        order the records come in; a FREE record frees only the generation it names."""
        with self.lock:
            entries, owner = self._entries, self._slot_owner
            invalid = stale = 0
            for rec in records:
                if rec.gen >= TRUSTED_GENERATION or (type(rec) is CommitRecord and rec.nbytes > max_nbytes):
                    invalid += 1
                    continue
                self._gen = max(self._gen, rec.gen)
                if type(rec) is CommitRecord:
                    old = owner.get(rec.slot)
                    prev = entries.get(rec.key)
                    # Generations only grow: a COMMIT older than what its slot or key already holds is a stale
                    # copy (a duplicated or replayed record), never newer truth.
                    if (old is not None and entries[old].gen >= rec.gen) or (prev is not None and prev.gen >= rec.gen):
                        stale += 1
                        continue
                    if old is not None:
                        del entries[old]
                    if prev is not None:
                        del entries[rec.key]
                        del owner[prev.slot]
                    entries[rec.key] = Entry(rec.slot, rec.gen, rec, rec.seg)
                    owner[rec.slot] = rec.key
                else:
                    key = owner.get(rec.slot)
                    if key is not None and entries[key].gen == rec.gen:
                        del entries[key]
                        del owner[rec.slot]
            # Capacity may have shrunk since the last run (or a file was cut short): drop what no longer fits,
            # oldest first.
            dropped = 0
            top = max(owner, default=-1)
            missing = unallocated(owner)
            if top >= self.capacity or len(entries) > self.capacity or missing:
                for key, e in list(entries.items()):
                    if e.slot >= self.capacity or len(entries) > self.capacity or e.slot in missing:
                        del entries[key]
                        del owner[e.slot]
                        dropped += 1
            self._next_slot = max(owner, default=-1) + 1
            self._free = sorted(set(range(self._next_slot)).difference(owner))
            for key, e in entries.items():  # oldest first, as LRU wants
                if self.own(key):
                    self.policy.on_insert(key, 1)
                else:
                    e.foreign = True
                    self._foreign[key] = None
            self.stats.journal_records_dropped += invalid + stale
            self._publish()
            return ReplayReport(len(entries), dropped, invalid, stale, self._gen, len(self._foreign))

    def live_records(self) -> list[CommitRecord]:
        """COMMIT records of every live chunk (a journal snapshot for compaction)."""
        with self.lock:
            out = []
            for key, e in self._entries.items():
                m = e.meta
                out.append(m if type(m) is CommitRecord else
                           CommitRecord(e.slot, e.gen, key, m.nbytes, m.shape, m.dtype, m.fmt, e.seg, m.extra))
            return out

    # ------------------------------------------------------------------ lookups and pins
    def _pinned(self, e: Entry, now: float) -> bool:
        if e.pins and e.pins[0] <= now:
            alive = [t for t in e.pins if t > now]
            self.stats.pins_expired += len(e.pins) - len(alive)
            e.pins = alive
        return bool(e.pins)

    def _usable(self, key: str) -> Entry | None:
        e = self._entries.get(key)
        if e is None or e.foreign:
            return None
        if not self.layout_ok(e.meta):  # type: ignore[arg-type]
            self._drop(key, e, "layout")
            return None
        return e

    def get(self, key: str) -> Entry | None:
        with self.lock:
            return self._entries.get(key)

    def contains(self, key: str, pin: bool = False) -> bool:
        with self.lock:
            e = self._usable(key)
            if e is None:
                return False
            if pin:
                e.pins.append(self.clock() + self.pin_timeout_s)
            return True

    def prefix_contains(self, keys: Sequence[str], pin: bool = False, *, request: bool = False) -> int:
        """How many leading keys are stored. `request=True` marks a request's lookup of its whole prefix chain,
        which session-aware policies use to infer conversations."""
        with self.lock:
            if request and keys:
                self.policy.on_request(list(keys), self.clock())
            n = 0
            for key in keys:
                if not self.contains(key, pin):
                    break
                n += 1
            return n

    def unpin(self, key: str) -> bool:
        with self.lock:
            e = self._entries.get(key)
            if e is None or not e.pins:
                return False
            e.pins.pop(0)
            return True

    def is_pinned(self, key: str) -> bool:
        with self.lock:
            e = self._entries.get(key)
            return e is not None and self._pinned(e, self.clock())

    def remove(self, key: str) -> bool:
        with self.lock:
            e = self._entries.get(key)
            if e is None:
                return False
            self._drop(key, e, None)
            return True

    def keys(self) -> list[str]:
        with self.lock:
            return list(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def used_bytes(self) -> int:
        return len(self._entries) * self.slot_size

    def add_drop_listener(self, fn: Callable[[str, int, str], None]) -> None:
        """Call `fn(key, nbytes, reason)` whenever a committed chunk leaves the tier (`reason`: evicted, removed,
        corrupt or layout). It runs under the index's lock: keep it short and never block in it."""
        with self.lock:
            self._drop_listeners.append(fn)

    # ------------------------------------------------------------------ reads
    def begin_read(self, keys: Sequence[str]) -> list[Entry | None]:
        """Entries to read (None: not stored); each returned entry counts a reader until `end_read`."""
        with self.lock:
            out = []
            for key in keys:
                e = self._usable(key)
                if e is not None:
                    e.readers += 1
                out.append(e)
            return out

    def end_read(self, keys: Sequence[str], entries: Sequence[Entry | None], verdicts: Sequence[str | None],
                 served: Sequence[bool]) -> None:
        """Close `begin_read`: a verdict (a corruption reason; not NOT_READ) drops the chunk; `served` chunks count
        as hits, the others as misses."""
        with self.lock:
            misses = 0
            for key, e, verdict, ok in zip(keys, entries, verdicts, served, strict=True):
                if e is None:
                    misses += 1
                    continue
                e.readers -= 1
                if verdict is not None and verdict != NOT_READ:
                    self._drop(key, e, verdict)
                elif e.removed and e.readers == 0:
                    self._release_slot(e)
                if ok and verdict is None:
                    self.stats.hits += 1
                    self.stats.bytes_read += e.meta.nbytes
                    M.SSD_HITS.inc()
                    M.SSD_BYTES_READ.inc(e.meta.nbytes)
                    if not e.removed:
                        self.policy.on_access(key)
                else:
                    misses += 1
            self.stats.misses += misses
            M.SSD_MISSES.inc(misses)

    # ------------------------------------------------------------------ writes
    def is_stored(self, key: str) -> bool:
        with self.lock:
            return key in self._entries

    def reserve(self) -> Reservation | None:
        """A slot for a new chunk, evicting if the budget is used up; None when every chunk is pinned or read."""
        with self.lock:
            slot = self._take_slot()
            if slot is None:
                return None
            self._reserved.add(slot)
            self._gen += 1
            return Reservation(slot, self._gen)

    def _take_slot(self) -> int | None:
        if self._free:
            return heapq.heappop(self._free)
        if self._next_slot < self.limit:
            self._next_slot += 1
            return self._next_slot - 1
        now = self.clock()

        def evictable(k: Hashable) -> bool:
            e = self._entries.get(k)  # type: ignore[call-overload]  # (the index's keys are str)
            return e is not None and e.readers == 0 and not self._pinned(e, now)

        foreign = next((k for k in self._foreign if evictable(k)), None)
        for victim in [foreign] if foreign is not None else self.policy.victims(1, evictable):
            e = self._entries.pop(victim)  # type: ignore[call-overload]
            if e.foreign:
                del self._foreign[victim]  # type: ignore[arg-type]
                self.stats.foreign_evicted += 1
            else:
                self.policy.on_remove(victim)
            del self._slot_owner[e.slot]
            e.removed = True
            self._victims[e.slot] = (victim, e)  # type: ignore[assignment]
            self.stats.evictions += 1
            M.SSD_EVICTIONS.inc()
            self._publish()
            return e.slot
        return None

    def victim_frees(self, reservations: Iterable[Reservation | None]) -> list[FreeRecord]:
        """FREE records of the chunks evicted to make these reservations (to journal before their slots are
        overwritten)."""
        with self.lock:
            return [FreeRecord(r.slot, self._victims[r.slot][1].gen) for r in reservations
                    if r is not None and r.slot in self._victims]

    def settle_victims(self, reservations: Iterable[Reservation | None], *, journaled: bool = True) -> None:
        """The evictions behind these reservations are final: drop listeners are told, and (unless their FREE
        records are `journaled` already) `on_slot_freed`."""
        with self.lock:
            for r in reservations:
                if r is None or r.slot not in self._victims:
                    continue
                key, e = self._victims.pop(r.slot)
                self._tell_listeners(key, e, "evicted")
                if not journaled:
                    self.on_slot_freed(FreeRecord(e.slot, e.gen))

    def restore_victims(self, reservations: Iterable[Reservation | None]) -> None:
        """End these reservations without writing: a chunk evicted for one is put back (its data was never
        overwritten), unless its key was stored again meanwhile; the others' slots are free again."""
        with self.lock:
            for r in reservations:
                if r is None:
                    continue
                victim = self._victims.pop(r.slot, None)
                if victim is None:
                    self.unreserve(r)
                    continue
                key, e = victim
                self._reserved.discard(r.slot)
                if key in self._entries:  # stored again since: this copy is obsolete
                    self._tell_listeners(key, e, "evicted")
                    heapq.heappush(self._free, r.slot)
                    self.on_slot_freed(FreeRecord(e.slot, e.gen))
                    continue
                e.removed = False
                self._entries[key] = e
                self._slot_owner[e.slot] = key
                if e.foreign:
                    self._foreign[key] = None
                    self.stats.foreign_evicted -= 1
                else:
                    self.policy.on_insert(key, 1)
                self.stats.evictions -= 1
            self._publish()

    def unreserve(self, res: Reservation) -> None:
        """The writer did not commit into `res`: the slot is free again (an eviction behind it stays final)."""
        with self.lock:
            self.settle_victims([res], journaled=False)
            self._reserved.discard(res.slot)
            heapq.heappush(self._free, res.slot)

    def commit(self, key: str, res: Reservation, meta: ChunkMeta, seg: int) -> None:
        """Make a chunk written to `res` visible. A key committed twice keeps the newer slot (the older one is
        freed, never leaked)."""
        with self.lock:
            self.settle_victims([res], journaled=False)
            self._reserved.discard(res.slot)
            old = self._entries.get(key)
            if old is not None:
                self._drop(key, old, None)
            self._entries[key] = Entry(res.slot, res.gen, meta, seg)
            self._slot_owner[res.slot] = key
            self.policy.on_insert(key, 1)
            self.stats.committed += 1
            self.stats.bytes_written += meta.nbytes
            M.SSD_PUTS.inc()
            M.SSD_BYTES_WRITTEN.inc(meta.nbytes)
            self._publish()

    # ------------------------------------------------------------------ the slot budget
    def disk_full(self, res: Reservation) -> None:
        """The disk had no room for slot `res`. The fresh slot (the highest handed out) is given back; any other
        (a hole below it) is kept out of use, so that the next reservation takes another slot instead of failing
        on the same one. Either way the budget stays at the slots that exist, evicting within them, until
        `restore_limit`."""
        with self.lock:
            if res.slot == self._next_slot - 1:
                self._reserved.discard(res.slot)
                self._next_slot -= 1
                self.limit = min(self.capacity, res.slot)
            else:
                self._parked.add(res.slot)
                self.limit = min(self.limit, self._next_slot)
            self.policy.set_capacity(max(1, self.limit - len(self._parked)))

    def restore_limit(self) -> None:
        """Try the configured capacity again (the disk may have room now): parked slots are free again."""
        with self.lock:
            for slot in self._parked:
                self._reserved.discard(slot)
                heapq.heappush(self._free, slot)
            self._parked.clear()
            self.limit = self.capacity
            self.policy.set_capacity(self.capacity)

    # ------------------------------------------------------------------ internals
    def _drop(self, key: str, e: Entry, reason: str | None) -> None:
        """Remove an entry; its slot is freed now, or when its last reader finishes."""
        if self._entries.get(key) is e:
            del self._entries[key]
            if e.foreign:
                del self._foreign[key]
            else:
                self.policy.on_remove(key)
            why = "removed" if reason is None else ("layout" if reason == "layout" else "corrupt")
            self._tell_listeners(key, e, why)
        e.removed = True
        if reason == "layout":
            self.stats.layout_mismatch += 1
            M.SSD_CORRUPT.labels("layout").inc()
        elif reason is not None:
            self.stats.corrupt += 1
            M.SSD_CORRUPT.labels(reason).inc()
        if e.readers == 0:
            self._release_slot(e)
        self._publish()

    def _tell_listeners(self, key: str, e: Entry, why: str) -> None:
        for fn in self._drop_listeners:
            try:
                fn(key, e.meta.nbytes, why)
            except Exception:
                logger.exception("SSD tier drop listener failed for %s", key)

    def _release_slot(self, e: Entry) -> None:
        owner = self._slot_owner.get(e.slot)
        if owner is not None and self._entries.get(owner) is not e:
            del self._slot_owner[e.slot]
            heapq.heappush(self._free, e.slot)
            self.on_slot_freed(FreeRecord(e.slot, e.gen))

    def _publish(self) -> None:
        M.SSD_USED_BYTES.set(len(self._entries) * self.slot_size)
        M.SSD_FOREIGN_CHUNKS.set(len(self._foreign))

    # ------------------------------------------------------------------ chunks of other namespaces
    def foreign_keys(self) -> list[str]:
        """Keys of the committed chunks of other namespaces, the next to be reclaimed first."""
        with self.lock:
            return list(self._foreign)

    def demote(self, keys: Iterable[str]) -> int:
        """Make these committed chunks foreign (their identity is found stale after the start): they leave the
        policy and are reclaimed first. Returns how many were."""
        n = 0
        with self.lock:
            for key in keys:
                e = self._entries.get(key)
                if e is None or e.foreign:
                    continue
                self.policy.on_remove(key)
                e.foreign = True
                self._foreign[key] = None
                n += 1
            self._publish()
        return n

    # ------------------------------------------------------------------ checks (tests and debugging)
    def check_invariants(self) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent (a leaked slot, reader or owner)."""
        with self.lock:
            owned = set(self._slot_owner)
            free = set(self._free)
            assert len(free) == len(self._free), "a slot is free twice"
            assert not owned & free, "a slot is both owned and free"
            assert not self._reserved & (owned | free), "a reserved slot is owned or free"
            assert all(getattr(self._entries.get(k), "slot", None) == s for s, k in self._slot_owner.items()), (
                "owner/entry mismatch")
            assert len(self._entries) == len(owned), "an entry without its slot"
            everything = owned | free | self._reserved
            assert everything == set(range(self._next_slot)), (
                f"slots below {self._next_slot} unaccounted for: {sorted(set(range(self._next_slot)) - everything)}")
            assert all(e.readers == 0 for e in self._entries.values()), "a reader never finished"
