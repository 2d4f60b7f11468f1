"""Answer-length-aware eviction (after Bidaw's previous-answer-based eviction), with a ghost cache and a fallback.

What it evicts: the unit with the lowest *hit density* (LHD-style; `score="potential"` gives Bidaw's plain hit
potential instead): expected hits per chunk-second it will still occupy the tier, from

    hits(e) = sum over reuse-time buckets b >= e of P(reuse in b | class, no reuse before e) * h(b)
    occupancy(e) = sum over b >= e of P(still waiting in b | ...) * h(b) * width(b)

where e is the bucket of the time waited so far.
- h(b) comes from the ghost cache (`ghost_cache.GhostBelady`): Belady replayed over a sampled sliding window of
  recent accesses gives, per reuse-time bucket, how often the optimum hits such a reuse (a soft horizon). It also
  stands for "still cached" in the occupancy.
- P(reuse in b | class, waited) comes from `reuse_model.ReuseModel`, a censoring-aware hazard per class, learned
  online from what already happened (family-pooled priors for sparse classes).
- Classes carry the signals the data supports:
  * history chunks of a session (the chain a follow-up turn would extend), by conversation depth (P(next turn)
    rises with depth) and by how many chunks the latest turn added;
  * a request's *tail* chunk (its last, usually partial chunk: the next turn does not extend it), its own class;
  * shared chunks (read by more than one session, e.g. a system prompt), by how often they were read;
  * orphan chunks (inserted without a request context), one class.
- The previous answer's length prunes: per answer-length bucket the policy learns a low quantile of the observed
  times to the next turn (a lower bound: a long answer takes long to read); a session whose next turn cannot have
  come yet is scored as if it had waited until that bound, and pays for the idle time until then.
- Timing rows: the answer length and the user's pace (the time between the session's two latest turns) say *when*
  the next turn comes, hardly *whether* (that is the class's business). A session's hazards are its class's
  hazards times a ratio per timing key (answer bucket x previous-gap bucket) and reuse-time bucket: the returns
  seen for that key over the returns its items' own classes expected (observed / expected, so a key gets no
  credit for its classes' depth), shrunk towards 1 by `timing_strength` pseudo-items.
- Units: a session's resident history chunks are evicted together as one unit, deepest chunk first (the prefix
  stays useful longest); tail/shared/orphan chunks are units of their own. Units are filed by (class, lower
  bound) in order of last activity; within such a group the score depends on the age alone, so one decision
  scores the oldest (`peek`) and the newest unit of each non-empty group: O(groups), not O(chunks).

Fallback: where the signals carry no information the density ordering can lose to plain baselines. Shadow caches
on a hash-sampled subset of keys (SHARDS-style, capacity scaled by the sampling rate) replay this policy's own
ordering and each fallback baseline (default: ARC and S3-FIFO); when a baseline's decayed shadow hit count beats
the current ordering's by more than `fallback_margin`, eviction delegates to a real instance of that baseline,
which is fed every call all along (and back, with the same hysteresis).

Sessions come from `on_request(chain, now)` / `on_request_finished(chain, answer_tokens, now)` (the connector
calls them; in LMCache-only use the tier calls `on_request` with the prefix chain of a lookup, and sessions are
inferred from chains, see `sessions.py`). Without any request calls every chunk is an orphan, ordered by the
orphan class's learned density and recency.

Memory bounds (all configurable): `max_sessions` session records, `ghost_window` sampled ghost accesses,
`max_items` waiting reuse items, `max_ghost_keys` remembered evicted chunk items, shadow caches of
capacity/`shadow_sample_rate` chunks, O(classes x buckets) counters.
"""

from __future__ import annotations

import itertools
import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

from kvtier.storage_backends.eviction.base import EvictionPolicy, Key, make_policy, register_policy
from kvtier.storage_backends.eviction.ghost_cache import GhostBelady, ReuseBuckets, key_sample
from kvtier.storage_backends.eviction.reuse_model import ReuseModel
from kvtier.storage_backends.eviction.sessions import Session, SessionTracker

logger = logging.getLogger(__name__)

DEPTH_EDGES = (1, 2, 3, 5, 9)  # depth buckets: 1, 2, 3-4, 5-8, 9+
ANSWER_EDGES = (30, 100, 250, 500, 1000)  # answer buckets after "unknown": <30, <100, <250, <500, <1000, 1000+
NEW_EDGES = (2, 5, 17)  # chunks the turn added: 1, 2-4, 5-16, 17+
SHARE_EDGES = (3, 5, 9, 17)  # shared chunks by accesses: 2, 3-4, 5-8, 9-16, 17+
GAP_EDGES = (45, 180)  # seconds between a session's two latest turns, after "first turn"

TAIL, SHARED, ORPHAN = 1, 2, 3  # KeyUnit kinds; sessions are kind 0


def _bucket(value: int, edges: Sequence[int]) -> int:
    for i, e in enumerate(edges):
        if value < e:
            return i
    return len(edges)


@dataclass(frozen=True)
class AnswerLengthConfig:
    """Knobs (and the ablation switches)."""

    use_answer_length: bool = True  #: previous answer length: a lower bound on the next turn's reuse time
    answer_timing: bool = True  #: ... and a reshaping of the session's reuse-time hazards (when, not whether)
    gap_timing: bool = True  #: the time between a session's two latest turns (the user's pace) reshapes them too
    timing_strength: float = 100.0  #: pseudo-items pulling a timing key's hazard ratios towards 1
    answer_in_class: bool = False  #: also split session classes by answer length (sparser; off by default)
    lb_quantile: float = 0.05  #: the lower bound is this quantile of the observed return times per answer bucket
    lb_min_samples: int = 20
    use_depth: bool = True  #: conversation depth in the session class
    use_new_blocks: bool = True  #: how many chunks the latest turn added, in the session class
    use_tail: bool = True  #: a request's last chunk is its own class
    use_shared: bool = True  #: chunks read by several sessions are their own class, by reuse count
    use_elapsed: bool = True  #: condition on the time waited so far (off: only class and recency)
    use_ghost: bool = True  #: weight reuse buckets by the ghost Belady hit probability (off: h = 1)
    own_residency: bool = False  #: occupancy uses this tier's own eviction-age curve (else the ghost's)
    score: str = "density"  #: "density": expected hits per chunk-second held (LHD-like); "potential": P(hit)
    fallback: tuple[str, ...] = ("arc", "s3fifo")  #: baselines the shadows compare against; () disables
    start_with_fallback: bool = False  #: evict like the last fallback baseline until the shadows say otherwise
    fallback_margin: float = 0.02  #: relative hit-count lead a baseline needs to take over
    shadow_sample_rate: int = 16
    shadow_window: int = 1024  #: sampled accesses per comparison round
    ghost_sample_rate: int = 8
    ghost_window: int = 16384
    ghost_refresh: int = 2048
    max_sessions: int = 100_000
    max_items: int = 200_000
    max_ghost_keys: int = 200_000
    max_ctx: int = 100_000  #: announced-but-not-inserted chunks remembered (requests that never finish)
    chunk_weighted: bool = False  #: a session's wait counts once per history chunk (hazards per chunk)
    peek: int = 1  #: oldest units scored per group and decision (the newest one is always scored too)
    prior_strength: float = 8.0  #: pseudo-counts pulling a class's hazards towards its family's
    refresh_requests: int = 32  #: recompute the potential table every N requests
    bucket_first_s: float = 2.0
    bucket_ratio: float = 1.35
    horizon_s: float = 3600.0


class KeyUnit:
    """A chunk evicted on its own (tail, shared, orphan)."""

    __slots__ = ("key", "size", "kind", "last_time", "item", "count", "cls", "seq", "owner", "lb", "g")

    def __init__(self, key: Key, size: int, kind: int, now: float, owner: Session | None = None) -> None:
        self.key = key
        self.size = size
        self.kind = kind
        self.last_time = now
        self.item = None
        self.count = 1
        self.cls = -1
        self.seq = -1
        self.owner = owner
        self.lb = 0
        self.g = None


class _Shadow:
    """A tiny simulated cache on sampled keys, to compare orderings."""

    def __init__(self, policy: EvictionPolicy) -> None:
        self.policy = policy
        self.used = 0
        self.hits = 0.0

    def access(self, key: Key, capacity: int) -> None:
        p = self.policy
        if key in p:
            self.hits += 1
            p.on_access(key)
            return
        if self.used + 1 > capacity:
            for v in p.victims(self.used + 1 - capacity, _always):
                p.on_remove(v)
                self.used -= 1
        if self.used + 1 <= capacity:
            p.on_insert(key, 1)
            self.used += 1


def _always(_k) -> bool:
    return True


@register_policy
class AnswerLengthPolicy(EvictionPolicy):
    name = "answer-length"

    def __init__(self, clock=None, capacity: int | None = None, config: AnswerLengthConfig | None = None, **kw):
        super().__init__(clock)
        cfg = config or AnswerLengthConfig()
        if kw:
            cfg = AnswerLengthConfig(**{**cfg.__dict__, **kw})
        self.cfg = cfg
        self.capacity = capacity
        self.buckets = ReuseBuckets.geometric(cfg.bucket_first_s, cfg.horizon_s, cfg.bucket_ratio)
        nd = len(DEPTH_EDGES) + 1 if cfg.use_depth else 1
        na = len(ANSWER_EDGES) + 2 if (cfg.use_answer_length and cfg.answer_in_class) else 1
        nz = len(NEW_EDGES) + 1 if cfg.use_new_blocks else 1
        self._nd, self._na, self._nz = nd, na, nz
        self.C_TAIL = nd * na * nz
        self.C_SHARED0 = self.C_TAIL + 1
        self.C_ORPHAN = self.C_SHARED0 + len(SHARE_EDGES) + 1
        n_classes = self.C_ORPHAN + 1
        self._family = [0] * self.C_TAIL + [1] + [2] * (len(SHARE_EDGES) + 1) + [3]
        # Timed session rows: session class x timing key (answer bucket x previous-gap bucket), after the classes.
        self._n_base = n_classes
        self._na_t = len(ANSWER_EDGES) + 1 if (cfg.use_answer_length and cfg.answer_timing) else 1
        self._ng_t = len(GAP_EDGES) + 2 if cfg.gap_timing else 1
        self._n_timing = self._na_t * self._ng_t if self._na_t * self._ng_t > 1 else 0
        self.reuse = ReuseModel(self.buckets, n_classes, prior_of=self._family.__getitem__, max_items=cfg.max_items,
            prior_strength=cfg.prior_strength, n_timing=self._n_timing,
        )
        self.ghost = GhostBelady(self.buckets, cfg.ghost_sample_rate, cfg.ghost_window, cfg.ghost_refresh)
        self.sessions = SessionTracker(cfg.max_sessions)
        self._keys: dict[Key, Session | KeyUnit] = {}  # resident key -> its unit
        # (class, lower-bound bucket) -> units, least recently active first; only non-empty groups are kept
        self._groups: dict[tuple[int, int], OrderedDict] = {}
        self._ctx: dict[Key, tuple[Session, bool]] = {}  # in-flight chain key -> (session, is tail)
        self._ghost_items: OrderedDict[Key, tuple] = OrderedDict()  # evicted chunk -> (item, kind, count)
        self._limbo: dict[Key, tuple[Session | KeyUnit, int]] = {}  # yielded by victims(), not removed yet
        self._table: list[list[float]] = []
        self._occ: list[list[float]] | None = None
        # answer bucket -> histogram of observed next-turn reuse-time buckets; -> lower-bound bucket
        self._lb_hist = [[0] * (len(self.buckets) + 1) for _ in range(len(ANSWER_EDGES) + 1)]
        self._lb_bucket = [0] * (len(ANSWER_EDGES) + 1)
        self._evict_ages = [0.0] * (len(self.buckets) + 1)  # decayed histogram of eviction ages (bucketed)
        self._req_seq = 0
        self._answers = 0
        self._since_refresh = 0
        self._used = 0
        self._hwm = 0
        self._size_sum = 0
        self._refresh()
        # fallback machinery
        self.mode = self.name  #: which ordering evicts now: "answer-length" or a fallback baseline's name
        self._fallbacks: dict[str, EvictionPolicy] = {}
        self._shadows: dict[str, _Shadow] = {}
        self._shadow_n = 0
        self._shadow_rate = 0
        self._switches = 0
        if cfg.fallback:
            if cfg.start_with_fallback:  # cold start: nothing learned yet; the shadows decide when to switch
                self.mode = cfg.fallback[-1]
            for fb in cfg.fallback:
                self._fallbacks[fb] = make_policy(fb, clock=clock)
                self._shadows[fb] = _Shadow(make_policy(fb, clock=clock))
            scale = cfg.shadow_sample_rate
            own_cfg = AnswerLengthConfig(
                **{
                    **cfg.__dict__,
                    "fallback": (),
                    "ghost_sample_rate": max(1, cfg.ghost_sample_rate // scale),
                    "ghost_window": max(1024, cfg.ghost_window * cfg.ghost_sample_rate // scale),
                    "ghost_refresh": max(256, cfg.ghost_refresh * cfg.ghost_sample_rate // scale),
                }
            )
            own = AnswerLengthPolicy(clock=clock, config=own_cfg)
            self._shadows[self.name] = _Shadow(own)

    def set_capacity(self, capacity: int) -> None:
        super().set_capacity(capacity)
        for fb in self._fallbacks.values():  # the real fallback instances size their queues from it
            fb.set_capacity(capacity)

    # ------------------------------------------------------------------ classes and potentials
    def _stay(self) -> list[float] | None:
        """P(a chunk is still resident at the start of bucket b), from this tier's own eviction ages."""
        n = sum(self._evict_ages)
        if not self.cfg.own_residency or n < 100:
            return None
        out, left = [], float(n)
        for c in self._evict_ages[: len(self.buckets)]:
            out.append(left / n)
            left -= c
        return out

    def _h(self) -> list[float]:
        return self.ghost.hit_prob if self.cfg.use_ghost else [1.0] * len(self.buckets)

    def _hist_class(self, depth: int, answer: int | None, new_blocks: int = 0) -> int:
        d = min(_bucket(depth, DEPTH_EDGES) - 1, self._nd - 1) if self.cfg.use_depth else 0
        if not (self.cfg.use_answer_length and self.cfg.answer_in_class) or answer is None:
            a = 0
        else:
            a = 1 + _bucket(answer, ANSWER_EDGES)
        z = _bucket(new_blocks, NEW_EDGES) if self.cfg.use_new_blocks else 0
        return (max(d, 0) * self._na + a) * self._nz + z

    def _timing_key(self, answer_bucket: int, prev_gap: float | None) -> int:
        a = answer_bucket if self._na_t > 1 else 0
        g = 0 if (self._ng_t == 1 or prev_gap is None) else 1 + _bucket(int(prev_gap), GAP_EDGES)
        return a * self._ng_t + g

    def _shared_class(self, count: int) -> int:
        return self.C_SHARED0 + _bucket(count, SHARE_EDGES)

    def _capacity_blocks(self) -> int:
        cap = self.capacity or self._hwm
        mean = self._size_sum / len(self._keys) if self._keys else 1.0
        return max(1, int(cap / max(mean, 1e-9)))

    def _refresh(self) -> None:
        tot = sum(self._evict_ages)
        if tot > 20_000:
            self._evict_ages = [x / 2 for x in self._evict_ages]
        if self.cfg.use_answer_length:
            for a, hist in enumerate(self._lb_hist):
                n = sum(hist)
                if n < self.cfg.lb_min_samples:
                    self._lb_bucket[a] = 0
                    continue
                acc, target = 0, self.cfg.lb_quantile * n
                for b, c in enumerate(hist):
                    acc += c
                    if acc > target:
                        self._lb_bucket[a] = b
                        break
        rows = None
        if self._n_timing:
            rows = self.reuse.hazards()
            ratios = self.reuse.timing_ratios(rows, self.cfg.timing_strength)
            for c in range(self.C_TAIL):
                for t in range(self._n_timing):
                    rows.append([min(1.0, lam * r) for lam, r in zip(rows[c], ratios[t])])
        if self.cfg.score == "density":
            self._table, self._occ = self.reuse.density_tables(self._h(), self._stay(), rows)
        else:
            self._table = self.reuse.potential_table(self._h(), rows)
            self._occ = None
        self._since_refresh = 0

    def score(self, unit: Session | KeyUnit, now: float) -> float:
        """The eviction score of a unit now (lowest goes first); victims() inlines the same arithmetic."""
        age = now - unit.last_time
        e = self.buckets.index(age) if self.cfg.use_elapsed else 0
        if e >= unit.lb:
            return self._table[unit.cls][e]
        e = unit.lb
        p = self._table[unit.cls][e]
        if self._occ is not None and p > 0.0:
            o = self._occ[unit.cls][e]
            p = p * o / (o + (self.buckets.lower(e) - age) * self._h()[e])
        return p

    # ------------------------------------------------------------------ unit bookkeeping
    def _place(self, unit: Session | KeyUnit, cls: int) -> None:
        """(Re)file a unit under class `cls` (and its lower bound), as the most recently active."""
        self._unfile(unit)
        unit.cls = cls
        if isinstance(unit, KeyUnit) or unit.keys:
            self._file(unit)

    def _file(self, unit: Session | KeyUnit) -> None:
        """Make sure a unit with resident chunks is filed (keeps its place if it already is)."""
        g = (unit.cls, unit.lb)
        if unit.g is not None:
            if unit.g == g:
                return
            self._unfile(unit)
        grp = self._groups.get(g)
        if grp is None:
            grp = self._groups[g] = OrderedDict()
        grp[unit] = None
        unit.g = g

    def _unfile(self, unit: Session | KeyUnit) -> None:
        g = unit.g
        if g is None:
            return
        grp = self._groups.get(g)
        if grp is not None:
            grp.pop(unit, None)
            if not grp:
                del self._groups[g]
        unit.g = None

    def _touch_key_unit(self, u: KeyUnit, now: float) -> None:
        """A tail/shared/orphan chunk was read again: close its wait, start the next one."""
        self.reuse.returned(u.item, now)
        u.count += 1
        u.last_time = now
        u.seq = self._req_seq
        if u.kind == TAIL:  # read again: no longer a dead tail
            u.kind = SHARED if self.cfg.use_shared else ORPHAN
        cls = self._shared_class(u.count) if u.kind == SHARED else self.C_ORPHAN
        u.item = self.reuse.start(cls, now)
        self._place(u, cls)

    def _remember_evicted(self, key: Key, u: KeyUnit) -> None:
        if u.item is None:
            return
        self._ghost_items[key] = (u.item, u.kind, u.count)
        while len(self._ghost_items) > self.cfg.max_ghost_keys:
            _, (item, _, _) = self._ghost_items.popitem(last=False)
            self.reuse.cancel(item)

    # ------------------------------------------------------------------ session signals
    def on_request(self, chain: Sequence[Key], now: float | None = None) -> None:
        if not chain:
            return
        now = self.now() if now is None else now
        self._req_seq += 1
        self.reuse.advance(now)
        self._since_refresh += 1
        if self._since_refresh >= self.cfg.refresh_requests:
            self._refresh()
        s, follow_up = self.sessions.begin(chain, now)
        if follow_up:
            self.reuse.returned(s.item, now)
            if s.item is not None and s.item.cls >= 0 and getattr(s.item, "answer", None) is not None:
                hist = self._lb_hist[s.item.answer]
                hist[min(self.buckets.index(now - s.item.start), len(hist) - 1)] += 1
        s.lb = 0
        s.item = None
        self._place(s, self._hist_class(s.depth, None, s.new_blocks))
        last = len(chain) - 1
        keys = self._keys
        for i, k in enumerate(chain):
            u = keys.get(k)
            if u is None:
                self._ctx[k] = (s, i == last and self.cfg.use_tail)
                continue
            if u is s:
                continue
            if isinstance(u, KeyUnit):
                if u.kind == TAIL and u.owner is s and i < last:
                    # the parent's last chunk was a full one: the follow-up extends it, it is history now
                    self.reuse.returned(u.item, now)
                    self._unfile(u)
                    s.keys[k] = u.size
                    keys[k] = s
                elif u.seq != self._req_seq:
                    self._touch_key_unit(u, now)
            elif isinstance(u, Session):
                # another conversation's chunk read by this one: shared from now on
                size = u.keys.pop(k, None)
                if size is None:
                    continue
                if not u.keys:
                    self._unfile(u)
                ku = KeyUnit(k, size, SHARED if self.cfg.use_shared else ORPHAN, now)
                ku.count = 2
                ku.seq = self._req_seq
                cls = self._shared_class(2) if ku.kind == SHARED else self.C_ORPHAN
                ku.item = self.reuse.start(cls, now)
                keys[k] = ku
                self._place(ku, cls)
        if len(self._ctx) > self.cfg.max_ctx:  # chunks announced but never inserted: forget the oldest half
            for k in list(itertools.islice(self._ctx, len(self._ctx) // 2)):
                del self._ctx[k]
        if self._shadows:
            own = self._shadows[self.name].policy
            own.on_request(chain, now)

    def on_request_finished(self, chain: Sequence[Key], answer_tokens: int, now: float | None = None) -> None:
        if not chain:
            return
        now = self.now() if now is None else now
        for k in chain:
            ctx = self._ctx.get(k)
            if ctx is not None:
                del self._ctx[k]
        s = self.sessions.session_of_chain(chain)
        if s is not None:
            self._answers += 1
            s.answer_tokens = int(answer_tokens)
            cls = self._hist_class(s.depth, s.answer_tokens, s.new_blocks)
            self.reuse.cancel(s.item)
            s.item = self.reuse.start(cls, s.last_time, max(1, s.chain_len - 1) if self.cfg.chunk_weighted else 1.0)
            a = _bucket(s.answer_tokens, ANSWER_EDGES)
            if self.cfg.use_answer_length:
                if s.item is not None:
                    s.item.answer = a
                s.lb = self._lb_bucket[a]
            if self._n_timing:
                t = self._timing_key(a, s.prev_gap)
                if s.item is not None:
                    s.item.timing = t
                cls = self._n_base + cls * self._n_timing + t  # its timed row of the tables
            self._place(s, cls)
        if self._shadows:
            self._shadows[self.name].policy.on_request_finished(chain, answer_tokens, now)

    # ------------------------------------------------------------------ tier contract
    def on_insert(self, key: Key, size: int = 1) -> None:
        now = self.now()
        if key in self._keys:
            self.on_access(key)
            return
        ctx = self._ctx.pop(key, None)
        old = self._ghost_items.pop(key, None)
        if old is not None:  # an evicted tail/shared/orphan chunk came back: that was a reuse
            self.reuse.returned(old[0], now)
        if ctx is not None and not ctx[1]:
            s = ctx[0]
            s.keys[key] = size
            self._keys[key] = s
            if s.cls >= 0:
                self._file(s)
        else:
            if ctx is not None:
                u = KeyUnit(key, size, TAIL, now, owner=ctx[0])
                cls = self.C_TAIL
            elif old is not None and old[1] == SHARED and self.cfg.use_shared:
                u = KeyUnit(key, size, SHARED, now)
                u.count = old[2] + 1
                cls = self._shared_class(u.count)
            else:
                u = KeyUnit(key, size, ORPHAN, now)
                cls = self.C_ORPHAN
            u.seq = self._req_seq
            u.item = self.reuse.start(cls, now)
            self._keys[key] = u
            self._place(u, cls)
        self._used += size
        self._size_sum += size
        self._hwm = max(self._hwm, self._used)
        self._observe(key, now)
        for fb in self._fallbacks.values():
            fb.on_insert(key, size)

    def on_access(self, key: Key) -> None:
        u = self._keys.get(key)
        if u is None:
            return
        now = self.now()
        if isinstance(u, KeyUnit) and u.seq != self._req_seq:
            self._touch_key_unit(u, now)
        self._observe(key, now)
        for fb in self._fallbacks.values():
            fb.on_access(key)

    def _observe(self, key: Key, now: float) -> None:
        if self.cfg.use_ghost and self.ghost.record(key, now, self._capacity_blocks()):
            self._refresh()
        if not self._shadows:
            return
        rate = self._shadow_rate
        if rate == 0:  # fixed at first use: small tiers sample more keys so the shadows stay meaningful
            rate = self._shadow_rate = max(1, min(self.cfg.shadow_sample_rate, self._capacity_blocks() // 128))
        if key_sample(key, rate):
            cap = max(1, self._capacity_blocks() // rate)
            for sh in self._shadows.values():
                sh.access(key, cap)
            self._shadow_n += 1
            if self._shadow_n >= self.cfg.shadow_window:
                self._decide_mode()

    def _decide_mode(self) -> None:
        """Switch orderings when another one's shadow clearly hits more (hysteresis: the current one keeps its
        place unless beaten by `fallback_margin`)."""
        hits = {n: sh.hits for n, sh in self._shadows.items()}
        cur = hits[self.mode]
        best = max(hits, key=lambda n: (hits[n], n == self.name))
        if best != self.mode and hits[best] > cur * (1.0 + self.cfg.fallback_margin) + 2:
            logger.debug("answer-length: ordering %s -> %s (shadow hits %s)", self.mode, best, hits)
            self.mode = best
            self._switches += 1
        for sh in self._shadows.values():
            sh.hits *= 0.5  # keep half of the history: an exponential window
        self._shadow_n = 0

    def on_remove(self, key: Key) -> None:
        u = self._keys.pop(key, None)
        if u is None:
            return
        self._limbo.pop(key, None)
        if isinstance(u, Session):
            size = u.keys.pop(key, None)
            if size is None:
                size = 1
            if not u.keys:
                self._unfile(u)
        else:
            size = u.size
            self._unfile(u)
            self._remember_evicted(key, u)
        self._used -= size
        self._size_sum -= size
        for fb in self._fallbacks.values():
            fb.on_remove(key)

    def victims(self, need: int, evictable: Callable[[Key], bool]) -> Iterator[Key]:
        self._reattach_limbo()
        if self.mode != self.name:
            yield from self._fallbacks[self.mode].victims(need, evictable)
            return
        now = self.now()
        freed = 0
        skip: set = set()
        bidx = self.buckets.index
        table = self._table
        use_elapsed = self.cfg.use_elapsed
        occ = self._occ
        lower = self.buckets.lower
        h = self._h()
        peek = self.cfg.peek
        while freed < need:
            best = None
            best_p = 0.0
            for (cls, lb), grp in self._groups.items():
                # Within a group the score depends on the age only: it falls with age once the lower bound is
                # past and rises with age before it (less idle wait), so the oldest few and the newest unit
                # are the candidates.
                n = 0
                cands = []
                for unit in grp:
                    if unit in skip:
                        continue
                    cands.append(unit)
                    n += 1
                    if n >= peek:
                        break
                if len(grp) > n:
                    last = next(reversed(grp))
                    if last not in skip:
                        cands.append(last)
                row = table[cls]
                for unit in cands:
                    age = now - unit.last_time
                    e = bidx(age) if use_elapsed else 0
                    if e < lb:  # the next turn cannot come before the answer-length lower bound
                        e = lb
                        p = row[e]
                        if occ is not None and p > 0.0:  # ...and the chunk sits idle until then
                            o = occ[cls][e]
                            p = p * o / (o + (lower(e) - age) * h[e])
                    else:
                        p = row[e]
                    if best is None or p < best_p or (p == best_p and unit.last_time < best.last_time):
                        best, best_p = unit, p
            if best is None:
                return
            key = None
            if isinstance(best, Session):
                for k in reversed(best.keys):
                    if evictable(k):
                        key = k
                        break
                if key is None:
                    skip.add(best)
                    continue
                size = best.keys.pop(key)
                if not best.keys:
                    self._unfile(best)
            else:
                if not evictable(best.key):
                    skip.add(best)
                    continue
                key, size = best.key, best.size
                self._unfile(best)
            self._limbo[key] = (best, size)
            self._evict_ages[bidx(now - best.last_time)] += size
            freed += size
            yield key

    def _reattach_limbo(self) -> None:
        """Keys a previous victims() yielded that the caller kept: back into their units."""
        if not self._limbo:
            return
        for key, (unit, size) in list(self._limbo.items()):
            if self._keys.get(key) is not unit:
                continue
            if isinstance(unit, Session):
                unit.keys[key] = size
            if unit.cls >= 0:
                self._file(unit)
        self._limbo.clear()

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: Key) -> bool:
        return key in self._keys

    # ------------------------------------------------------------------ introspection
    def memory_items(self) -> dict[str, int]:
        """Sizes of the bounded learning state (tests check they stay within the configured bounds)."""
        return {
            "sessions": len(self.sessions),
            "ghost_trace": self.ghost.memory_items(),
            "reuse_items": self.reuse.items,
            "ghost_keys": len(self._ghost_items),
            "ctx": len(self._ctx),
        }

    def stats(self) -> dict:
        return {
            "mode": self.mode,
            "answers": self._answers,  #: finished requests whose answer length reached a known session
            "mode_switches": self._switches,
            "ghost_runs": self.ghost.runs,
            "ghost_hit_prob": [round(x, 3) for x in self.ghost.hit_prob],
            "sessions": len(self.sessions),
            "shadow_hits": {n: round(s.hits, 1) for n, s in self._shadows.items()},
        }
