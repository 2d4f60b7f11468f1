"""Answer-length-aware eviction (after Bidaw's previous-answer-based eviction) with a ghost cache, a reuse
predictor trained on the ghost's Belady labels (after Learning Relaxed Belady, NSDI'20) and a fallback.

What it evicts: the unit with the lowest *hit density* (LHD-style; `score="potential"` gives Bidaw's plain hit
potential instead): expected hits per byte-second it will still occupy the tier, from

    hits(e) = sum over reuse-time buckets b >= e of P(reuse in b | class, no reuse before e) * h(b)
    occupancy(e) = sum over b >= e of P(still waiting in b | ...) * h(b) * width(b)

where e is the bucket of the time waited so far.
- h(b) comes from the ghost cache (`ghost_cache.GhostBelady`): Belady replayed over a sampled sliding window of
  recent accesses gives, per reuse-time bucket, how often the optimum hits such a reuse (a soft horizon). It also
  stands for "still cached" in the occupancy.
- P(reuse in b | class, waited) comes from `reuse_model.ReuseModel`, a censoring-aware hazard per class, learned
  online from what already happened (family-pooled priors for sparse classes).
- Classes carry the signals that say *when*: history chunks of a session (the chain a follow-up turn would extend)
  by conversation depth and by how many chunks the latest turn added; a request's *tail* chunk (its last, usually
  partial chunk); shared chunks (read by more than one session) by how often they were read; orphan chunks
  (inserted without a request context). Timing rows: the previous answer's length and the user's pace (the time
  between the session's two latest turns) reshape a session's class hazards (observed / expected returns per
  timing key and bucket, shrunk towards 1 by `timing_strength`).
- The previous answer's length prunes: per answer-length bucket the policy learns a low quantile of the observed
  times to the next turn (a lower bound: a long answer takes long to read); a session whose next turn cannot have
  come yet is scored as if it had waited until that bound, and pays for the idle time until then.
- **Whether** the wait pays off at all (two thirds of all chunks are never read again) is where the class hazards
  are weakest. The reuse predictor (`reuse_predictor.ReusePredictor`) corrects them: a logistic regression over the
  features the traces carry (chunk kind, depth, new chunks in the turn, chain length, previous answer length, the
  user's pace, how much of the session's history the turn found resident, a shared chunk's read count), trained on
  the ghost's labels (for sampled past accesses: did the optimum, at this tier's capacity, hit the next access?),
  with the class model's own chance of such a hit as its offset. It learns only what the features add to the
  classes; its odds ratio scales each unit's hit chance (hits' = r h / (1 - h + r h)). Progressive validation
  gates it: each new label is first predicted with and without the correction, and the correction is applied
  only while it has predicted recent labels better by `gate_margin` nats (so it cannot make things worse where its
  features carry nothing the classes do not already say).

Optionally (`return_model`, off by default: it did not carry from the tuning half to the held-out half), a second
correction for sessions only: `return_model.ReturnModel`, an online logistic model of whether a follow-up's
conversation comes back within a horizon, from continuous values of its answer length, pace, depth and chunk
counts, labelled by what happened once the horizon has passed; its odds ratio scales the session's hit chance the
same way. `session_odds` is an analysis hook for the same slot (oracles and offline models,
`benchmarks/eviction_ceiling.py`).

Units: a session's resident history chunks are evicted together as one unit, deepest chunk first (the prefix
stays useful longest); tail/shared/orphan chunks are units of their own.

Cost: a unit's score only changes when it is touched, when the tables are refreshed, or when its age crosses a
reuse-time bucket edge. Units sit in a min-heap of scores and a second heap of bucket-crossing times re-scores
them lazily, so a decision is O(log units) plus the crossings that fell due, and an access is O(1) (plus a sampled
ghost record; Belady reruns and predictor refits are amortised over thousands of accesses).

Fallback (off by default; e.g. `fallback=("s3fifo",)` for traffic without session signals): shadow caches on a
hash-sampled subset of keys (SHARDS-style, capacity scaled by the sampling rate) replay this policy's own ordering
and each fallback baseline; when a baseline's decayed shadow hit count beats the current ordering's by more than
`fallback_margin`, eviction delegates to a real instance of that baseline, which is fed every call all along (and
back, with the same hysteresis).

Sessions come from `on_request(chain, now)` / `on_request_finished(chain, answer_tokens, now)` (the connector
calls them; in LMCache-only use the tier calls `on_request` with the prefix chain of a lookup, and sessions are
inferred from chains, see `sessions.py`). Without any request calls every chunk is an orphan, ordered by the
orphan class's learned density and recency.

No future information: every estimate comes from calls already made (the ghost's Belady sees only the window of
past accesses; a label is given only once the window has run `label delay` seconds past the access).

Memory bounds (all configurable): `max_sessions` session records, `ghost_window` sampled accesses per ghost
(`ghost_strata` ghosts, one by default),
`predictor_window` labelled samples, `max_items` waiting reuse items, `max_ghost_keys` remembered evicted chunk
items, `max_ctx` announced-but-not-inserted chunks, shadow caches of capacity/`shadow_sample_rate` chunks,
O(classes x buckets) counters.
"""

from __future__ import annotations

import heapq
from bisect import bisect_right
import itertools
import logging
import math
from collections import OrderedDict
from dataclasses import dataclass, fields, replace
from typing import Callable, Iterator, Sequence

import numpy as np

from kvtier.storage_backends.eviction.base import EvictionPolicy, Key, make_policy, register_policy
from kvtier.storage_backends.eviction.ghost_cache import _MASK, _MIX, GhostBelady, ReuseBuckets, key_hash
from kvtier.storage_backends.eviction.reuse_model import ReuseModel
from kvtier.storage_backends.eviction.return_model import ReturnModel
from kvtier.storage_backends.eviction.reuse_predictor import FeatureSpace, ReusePredictor
from kvtier.storage_backends.eviction.sessions import Session, SessionTracker

logger = logging.getLogger(__name__)

DEPTH_EDGES = (2, 3, 5, 9)  # turns: 1, 2, 3-4, 5-8, 9+
NEW_EDGES = (2, 5, 17)  # chunks the turn added: 1, 2-4, 5-16, 17+
CHAIN_EDGES = (3, 5, 9, 17, 33)  # chunks in the chain
ANSWER_EDGES = (30, 100, 250, 500, 1000)  # answer tokens: <30, <100, <250, <500, <1000, 1000+
GAP_EDGES = (45, 180)  # seconds between a session's two latest turns, after "first turn"
SHARE_EDGES = (3, 5, 9, 17)  # reads of a shared/orphan chunk: 1-2, 3-4, 5-8, 9-16, 17+

HIST, TAIL, SHARED, ORPHAN = 0, 1, 2, 3  # chunk kinds (HIST: a session's history chunks)
_PROTECT = 1e9  # added to a protected first turn's score: it goes after every unprotected unit

# Predictor features; value 0 of every group but "kind" means "not applicable / unknown".
FEATURES = FeatureSpace(
    groups=(
        ("kind", 4),
        ("depth", len(DEPTH_EDGES) + 2),
        ("new_chunks", len(NEW_EDGES) + 2),
        ("chain", len(CHAIN_EDGES) + 2),
        ("answer", len(ANSWER_EDGES) + 2),
        ("pace", len(GAP_EDGES) + 3),
        ("hits", 5),
        ("reads", len(SHARE_EDGES) + 2),
    ),
    crosses=(("answer", "pace"), ("depth", "new_chunks"), ("kind", "depth")),
)


def _bucket(value: float, edges: Sequence[float]) -> int:
    """Index of the first edge above value (len(edges) if none)."""
    return bisect_right(edges, value)


@dataclass(frozen=True)
class AnswerLengthConfig:
    """Knobs (and the ablation switches). The defaults were chosen on the first 15 minutes of the Mooncake
    conversation trace only (`benchmarks/eviction_replay.py` scores them on the second 15)."""

    use_answer_length: bool = True  #: previous answer length: a lower bound on the next turn's reuse time
    answer_timing: bool = True  #: ... and a reshaping of the session's reuse-time hazards (when, not whether)
    gap_timing: bool = True  #: the time between a session's two latest turns (the user's pace) reshapes them too
    timing_strength: float = 100.0  #: pseudo-items pulling a timing key's hazard ratios towards 1
    lb_quantile: float = 0.03  #: the lower bound is this quantile of the observed return times per answer bucket
    lb_min_samples: int = 20
    use_depth: bool = True  #: conversation depth in the session class
    use_new_blocks: bool = True  #: how many chunks the latest turn added, in the session class
    use_tail: bool = True  #: a request's last chunk is its own class
    use_shared: bool = True  #: chunks read by several sessions are their own class, by reuse count
    use_elapsed: bool = True  #: condition on the time waited so far (off: only class and recency)
    use_ghost: bool = True  #: weight reuse buckets by the ghost Belady hit probability (off: h = 1)
    score: str = "density"  #: "density": expected hits per byte-second held (LHD-like); "potential": P(hit)
    use_predictor: bool = True  #: the ghost-trained reuse predictor corrects the classes' hit chances
    use_chain: bool = True  #: predictor feature: chunks in the chain
    use_hit_history: bool = True  #: predictor feature: share of the session's history the turn found resident
    use_reads: bool = True  #: predictor feature: a shared/orphan chunk's read count
    #: the return model (`return_model.ReturnModel`): an online logistic model of whether a follow-up's session
    #: comes back within `return_horizon_s`, from its answer length, pace, depth and chunk counts; its odds ratio
    #: (to the power `return_strength`) scales the session's hit chance. Off: the horizon and strength below won
    #: on the tuning half, but on the held-out half it gained 0.25 points at 2% and lost 0.35 / 0.47 at 5% / 10%
    #: and a point on the Poisson trace (README, "Eviction")
    return_model: bool = False
    return_horizon_s: float = 120.0
    return_window: int = 4096  #: labelled waits it is fitted on (a sliding window)
    return_refit: int = 64  #: refit after this many new labels
    return_strength: float = 0.5
    #: label a return by the ghost's P(the optimum hits a reuse that late) instead of 1 (relaxed Belady labels)
    return_soft: bool = False
    l2: float = 1.0  #: predictor's L2 penalty (pulls the correction towards none)
    predictor_window: int = 16384  #: labelled samples it learns from (a sliding window)
    predictor_refit: int = 1024  #: refit after this many new labels
    max_label_delay: float = 3600.0  #: an access is labelled at most this long after it happened
    gate_margin: float = 0.005  #: the correction applies while it beats the class model by this many nats/label
    gate_min_labels: float = 500.0  #: ... measured on at least this many (decayed) fresh labels
    gate_decay: float = 0.999  #: weight of older labels in that comparison, per label
    fallback: tuple[str, ...] = ()  #: baselines the shadows compare against (e.g. ("s3fifo",)); () disables
    fallback_margin: float = 0.02  #: relative hit-count lead a baseline needs to take over
    shadow_sample_rate: int = 16
    shadow_window: int = 1024  #: sampled accesses per comparison round
    ghost_sample_rate: int = 0  #: one key in N is replayed by the ghost; 0: N = capacity / ghost_capacity (>= 1)
    ghost_capacity: int = 160  #: each ghost's sampled capacity when the rate is automatic (SHARDS, fixed size)
    ghost_window: int = 16384
    ghost_refresh: int = 2048
    ghost_salt: int = 0  #: which sampling hash the ghost (and shadows) use: 0 the default; others measure the spread
    #: stratified ghosts: residues 0..N-1 of the sampling hash, one Belady each at the same rate, h is their mean
    #: (labels come from the first); N times the ghost's cost and memory at the same `ghost_capacity`
    ghost_strata: int = 1
    #: first-turn probation: a new conversation's history is protected (evicted only after every unprotected
    #: unit) for `probation_s` seconds after its first turn, while the protected first turns hold at most this
    #: share of the capacity (the oldest leave first); 0 disables it. With `probation_adapt` > 0 this is the
    #: starting share and it adapts online (ARC-like), within [0, `probation_max_share`]
    probation_share: float = 0.0
    probation_s: float = 180.0  #: how long a first turn stays protected if no follow-up comes
    #: adaptation step per missed block: a first follow-up that misses history chunks of an unprotected first
    #: turn grows the share by this many blocks per missed chunk; a deeper turn's misses shrink it as much
    probation_adapt: float = 0.0
    probation_max_share: float = 0.5
    probation_max_blocks: int = 0  #: only first turns of at most this many chunks enter probation (0: all)
    probation_min_blocks: int = 0  #: ... and of at least this many
    max_sessions: int = 100_000
    max_items: int = 200_000
    max_ghost_keys: int = 200_000
    max_ctx: int = 100_000  #: announced-but-not-inserted chunks remembered (requests that never finish)
    prior_strength: float = 8.0  #: pseudo-counts pulling a class's hazards towards its family's
    refresh_requests: int = 64  #: recompute the tables (and re-score every unit) every N requests
    max_rescores_per_decision: int = 64  #: bucket crossings one eviction decision re-scores at most
    bucket_first_s: float = 2.0
    bucket_ratio: float = 1.5
    horizon_s: float = 3600.0


class Turn:
    """Feature values of one request; the ghost samples of its chunks point here, so the answer length, known
    when the request finishes, reaches their labels."""

    __slots__ = ("depth", "new", "chain", "answer", "pace", "hits")

    def __init__(self, depth: int, new: int, chain: int, pace: int, hits: int) -> None:
        self.depth, self.new, self.chain, self.pace, self.hits = depth, new, chain, pace, hits
        self.answer = 0


class KeyUnit:
    """A chunk evicted on its own (tail, shared, orphan)."""

    __slots__ = ("key", "size", "kind", "last_time", "item", "count", "cls", "seq", "owner", "lb", "x", "ver",
                 "filed", "entry", "until", "epoch")

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
        self.x: tuple | None = None
        self.ver = 0
        self.filed = False
        self.entry = None
        self.until = 0.0
        self.epoch = -1


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


def _log_loss(z: float, label: bool) -> float:
    """-log P(label) for log-odds z."""
    z = -z if label else z
    return z + math.log1p(math.exp(-z)) if z > 0 else math.log1p(math.exp(z))


def _with_odds(p: float, r: float) -> float:
    """Probability p with its odds scaled by r (r = 0: never)."""
    return r * p / (1.0 - p + r * p) if r > 0.0 else 0.0


def _logit(p: float) -> float:
    p = min(max(p, 1e-6), 1.0 - 1e-6)
    return math.log(p / (1.0 - p))


@register_policy
class AnswerLengthPolicy(EvictionPolicy):
    name = "answer-length"

    def __init__(self, clock=None, capacity: int | None = None, config: AnswerLengthConfig | None = None, **kw):
        super().__init__(clock)
        cfg = config or AnswerLengthConfig()
        if kw:
            known = {f.name for f in fields(AnswerLengthConfig)}
            bad = sorted(set(kw) - known)
            if bad:
                raise ValueError(f"answer-length: unknown option(s) {bad}; known: {sorted(known)}")
            cfg = replace(cfg, **{k: tuple(v) if k == "fallback" else v for k, v in kw.items()})
        if cfg.score not in ("density", "potential"):
            raise ValueError(f"answer-length: score must be 'density' or 'potential', not {cfg.score!r}")
        self.cfg = cfg
        #: Analysis hook, never set in serving: called when a turn finishes with (its chain, its answer tokens);
        #: a number it returns is an odds ratio on that session's next-turn hit chance until its next turn
        #: (0: it will not return; None: no opinion). `benchmarks/eviction_ceiling.py` feeds it oracles and offline
        #: models to bound what a better "whether" predictor could gain.
        self.session_odds: Callable[[Sequence[Key], int], float | None] | None = None
        self.capacity = capacity
        self.buckets = ReuseBuckets.geometric(cfg.bucket_first_s, cfg.horizon_s, cfg.bucket_ratio)
        self._edges = self.buckets.edges
        self._lower = [self.buckets.lower(k) for k in range(len(self._edges))]
        self._use_elapsed = cfg.use_elapsed
        self._use_ghost = cfg.use_ghost
        self._ghost_rate_fixed = cfg.ghost_sample_rate > 0
        self._n_edges = len(self._edges) if cfg.use_elapsed else 0  # no crossings without elapsed time
        nd = len(DEPTH_EDGES) + 1 if cfg.use_depth else 1
        nz = len(NEW_EDGES) + 1 if cfg.use_new_blocks else 1
        self._nd, self._nz = nd, nz
        self.C_TAIL = nd * nz
        self.C_SHARED0 = self.C_TAIL + 1
        self.C_ORPHAN = self.C_SHARED0 + len(SHARE_EDGES) + 1
        n_classes = self.C_ORPHAN + 1
        self._family = [0] * self.C_TAIL + [1] + [2] * (len(SHARE_EDGES) + 1) + [3]
        # Timed session rows: session class x timing key (answer bucket x previous-gap bucket), after the classes.
        self._n_base = n_classes
        self._na_t = len(ANSWER_EDGES) + 1 if (cfg.use_answer_length and cfg.answer_timing) else 1
        self._ng_t = len(GAP_EDGES) + 2 if cfg.gap_timing else 1
        self._n_timing = self._na_t * self._ng_t if self._na_t * self._ng_t > 1 else 0
        self.reuse = ReuseModel(
            self.buckets, n_classes, prior_of=self._family.__getitem__, max_items=cfg.max_items,
            prior_strength=cfg.prior_strength, n_timing=self._n_timing,
        )
        self.predictor = ReusePredictor(
            FEATURES, offset_of=self._offset_of, window=cfg.predictor_window, refit_every=cfg.predictor_refit,
            l2=cfg.l2,
        )
        self.returns = (ReturnModel(cfg.return_horizon_s, cfg.return_window, cfg.return_refit,
                                    label_of=self._return_label if cfg.return_soft else None)
                        if cfg.return_model else None)
        self.ghost = GhostBelady(
            self.buckets, cfg.ghost_sample_rate or 8, cfg.ghost_window, cfg.ghost_refresh,
            label_sink=self._on_label if cfg.use_predictor else None,
        )
        self.ghost.max_label_horizon = cfg.max_label_delay
        self._salt = int(cfg.ghost_salt)
        if cfg.ghost_strata < 1:
            raise ValueError(f"answer-length: ghost_strata must be >= 1, not {cfg.ghost_strata!r}")
        self._strata: list[GhostBelady] = []  # the other strata's ghosts (no labels), made in `_fix_rates`
        self._n_strata = 1
        self.sessions = SessionTracker(cfg.max_sessions)
        self._keys: dict[Key, Session | KeyUnit] = {}  # resident key -> its unit
        self._heap: list = []  # (score, last_time, seq, unit, ver)
        self._cross: list = []  # (time of the unit's next bucket crossing, seq, unit, ver)
        self._seq = itertools.count()
        self._units: dict[int, Session | KeyUnit] = {}  # units with resident chunks (filed in the heap), by id
        self._epoch = 0  # bumped by every table refresh (scores computed before are stale)
        self._ctx: dict[Key, tuple[Session, bool]] = {}  # in-flight chain key -> (session, is tail)
        self._ghost_items: OrderedDict[Key, tuple] = OrderedDict()  # evicted chunk -> (item, kind, count)
        self._limbo: dict[Key, tuple[Session | KeyUnit, int]] = {}  # yielded by victims(), not removed yet
        self._off_cache: dict[tuple, float] = {}  # feature tuple -> _offset_of, for one (epoch, ghost version)
        self._off_stamp: tuple | None = None
        self._hits = np.zeros((0, 0))  # per table row and elapsed bucket: expected hits from there on
        self._occ: np.ndarray | None = None  # ... and expected occupancy (density score only)
        self._surv = np.zeros((0, 0))  # ... and P(no reuse before the bucket)
        self._h: list[float] = []
        # answer bucket -> histogram of observed next-turn reuse-time buckets; -> lower-bound bucket
        self._lb_hist = [[0] * (len(self.buckets) + 1) for _ in range(len(ANSWER_EDGES) + 1)]
        self._lb_bucket = [0] * (len(ANSWER_EDGES) + 1)
        # progressive validation of the predictor: decayed log-loss gain over the class model on new labels
        self._gate_gain = 0.0
        self._gate_n = 0.0
        self._gate_open = False
        self._req_seq = 0
        self._answers = 0
        self._since_refresh = 0
        self._used = 0
        self._hwm = 0
        # first-turn probation: protected sessions in first-turn order; the share they may hold (bytes; < 0:
        # not set yet, fixed from the capacity at first use)
        self._prob: OrderedDict[int, Session] = OrderedDict()
        self._prob_on = cfg.probation_share > 0.0 or cfg.probation_adapt > 0.0
        self._prob_target = -1.0
        self._missing = 0  # history chunks of the latest follow-up that were not resident (set by `_turn`)
        self._refresh()
        # fallback machinery
        self.mode = self.name  #: which ordering evicts now: "answer-length" or a fallback baseline's name
        self._fallbacks: dict[str, EvictionPolicy] = {}
        self._shadows: dict[str, _Shadow] = {}
        self._shadow_n = 0
        self._shadow_rate = 0
        self._live_hits = 0.0  # this tier's own hits on the shadow-sampled keys (decayed like the shadows')
        self._sub_of: tuple | None = None
        self._switches = 0
        if cfg.fallback:
            for fb in cfg.fallback:
                self._fallbacks[fb] = make_policy(fb, clock=clock)
                self._shadows[fb] = _Shadow(make_policy(fb, clock=clock))
            # this policy's own shadow is built once the sampling rates are known (`_fix_shadow_rate`)
        self._fallback_list = list(self._fallbacks.values())
        self._ghost_rate = 0  # fixed by _fix_rates() at the first request or chunk

    def set_capacity(self, capacity: int) -> None:
        super().set_capacity(capacity)
        for fb in self._fallbacks.values():  # the real fallback instances size their queues from it
            fb.set_capacity(capacity)
        if not self._ghost_rate:
            self._fix_rates()

    # ------------------------------------------------------------------ classes and tables
    def _hist_class(self, depth: int, new_blocks: int = 0) -> int:
        d = _bucket(depth, DEPTH_EDGES) if self.cfg.use_depth else 0
        z = _bucket(new_blocks, NEW_EDGES) if self.cfg.use_new_blocks else 0
        return d * self._nz + z

    def _timing_key(self, answer_bucket: int, prev_gap: float | None) -> int:
        a = answer_bucket if self._na_t > 1 else 0
        g = 0 if (self._ng_t == 1 or prev_gap is None) else 1 + _bucket(prev_gap, GAP_EDGES)
        return a * self._ng_t + g

    def _timed_row(self, cls: int, t: int) -> int:
        return self._n_base + cls * self._n_timing + t

    def _shared_class(self, count: int) -> int:
        return self.C_SHARED0 + _bucket(count, SHARE_EDGES)

    def _capacity_blocks(self) -> int:
        cap = self.capacity or self._hwm
        mean = self._used / len(self._keys) if self._keys else 1.0
        return max(1, int(cap / max(mean, 1e-9)))

    def _refresh(self) -> None:
        cfg = self.cfg
        if cfg.use_answer_length:
            for a, hist in enumerate(self._lb_hist):
                n = sum(hist)
                if n < cfg.lb_min_samples:
                    self._lb_bucket[a] = 0
                    continue
                acc, target = 0, cfg.lb_quantile * n
                for b, c in enumerate(hist):
                    acc += c
                    if acc > target:
                        self._lb_bucket[a] = b
                        break
        rows = self.reuse.hazards_array()
        if self._n_timing:
            ratios = self.reuse.timing_ratios_array(rows, cfg.timing_strength)
            timed = np.minimum(1.0, rows[: self.C_TAIL, None, :] * ratios[None, :, :])
            rows = np.vstack([rows, timed.reshape(-1, rows.shape[1])])  # row n_base + cls * n_timing + t
        if not cfg.use_ghost:
            self._h = [1.0] * len(self.buckets)
        elif self._strata:
            gs = [self.ghost] + self._strata
            self._h = [sum(c) / len(gs) for c in zip(*(g.hit_prob for g in gs))]
        else:
            self._h = self.ghost.hit_prob
        self._hits, occ, self._surv = self.reuse.tables(self._h, rows, with_survival=True)
        self._occ = occ if cfg.score == "density" else None
        self._since_refresh = 0
        self._epoch += 1
        if self._units:  # every score may have moved: rebuild both heaps from fresh scores
            self._heap, self._cross = [], []
            now = self.now()
            for u in list(self._units.values()):
                self._rescore(u, now, push=False)
            heapq.heapify(self._heap)
            heapq.heapify(self._cross)

    # ------------------------------------------------------------------ predictor
    def _turn(self, s: Session, chain: Sequence[Key], follow_up: bool) -> Turn:
        hits = 1
        self._missing = 0
        if follow_up:
            repeated = len(chain) - s.new_blocks
            keys = self._keys
            n = sum(1 for k in itertools.islice(chain, repeated) if k in keys)
            hits = 2 if n == 0 else (4 if n >= repeated else 3)
            self._missing = max(0, repeated - n)
        return self.turn_features(s.depth, s.new_blocks, len(chain), s.prev_gap, hits)

    def turn_features(self, depth: int, new_blocks: int, chain_len: int, prev_gap: float | None,
                      hits: int = 1) -> Turn:
        """The predictor's view of a turn (`hits`: 1 first turn, 2 none / 3 part / 4 all of its history was
        resident); the answer is added when the turn finishes."""
        cfg = self.cfg
        pace = 0
        if cfg.gap_timing:
            pace = 1 if prev_gap is None else 2 + _bucket(prev_gap, GAP_EDGES)
        return Turn(
            1 + _bucket(depth, DEPTH_EDGES) if cfg.use_depth else 0,
            1 + _bucket(new_blocks, NEW_EDGES) if cfg.use_new_blocks else 0,
            1 + _bucket(chain_len, CHAIN_EDGES) if cfg.use_chain else 0,
            pace,
            hits if cfg.use_hit_history else 0,
        )

    def session_features(self, turn: Turn, answer_tokens: int | None) -> tuple[int, ...]:
        """Features of a session's history chunks after `turn` (with its answer length, if known)."""
        if answer_tokens is not None and self.cfg.use_answer_length:
            turn.answer = 1 + _bucket(answer_tokens, ANSWER_EDGES)
        return self._features(turn, HIST, 0)

    def _features(self, turn: Turn | None, kind: int, reads: int) -> tuple[int, ...]:
        r = 1 + _bucket(reads, SHARE_EDGES) if (reads and self.cfg.use_reads) else 0
        if turn is None:
            return (kind, 0, 0, 0, 0, 0, 0, r)
        return (kind, turn.depth, turn.new, turn.chain, turn.answer, turn.pace, turn.hits, r)

    def _row_of(self, x: tuple[int, ...]) -> int:
        """The score-table row of a unit with features x (the class model's view of it)."""
        kind = x[0]
        if kind == HIST:
            cls = max(0, x[1] - 1) * self._nz + max(0, x[2] - 1)
            if self._n_timing and x[4] > 0:
                a = (x[4] - 1) if self._na_t > 1 else 0
                g = max(0, x[5] - 1) if self._ng_t > 1 else 0
                return self._timed_row(cls, a * self._ng_t + g)
            return cls
        if kind == TAIL:
            return self.C_TAIL
        if kind == SHARED:
            return self._shared_class(max(2, self._reads_of(x[7])))
        return self.C_ORPHAN

    @staticmethod
    def _reads_of(value: int) -> int:
        return (1, 1, 3, 5, 9, 17)[value]  # smallest read count of a "reads" feature value

    def _offset_of(self, x: tuple[int, ...]) -> float:
        """The class model's log-odds for what a label says: a hit on a reuse within the ghost's label horizon
        (cached per feature tuple until the tables or the ghost change)."""
        ghost = self.ghost
        stamp = (self._epoch, ghost._version)
        if self._off_stamp != stamp:
            self._off_stamp = stamp
            self._off_cache.clear()
        z = self._off_cache.get(x)
        if z is not None:
            return z
        row = self._row_of(x)
        b = bisect_right(self._edges, ghost.label_horizon())
        h = self._hits.item(row, 0)
        if b < len(self._edges):  # minus the hits after the horizon: survival to bucket b times hits from b on
            h -= self._surv.item(row, b) * self._hits.item(row, b)
        z = _logit(h)
        if len(self._off_cache) < 65536:
            self._off_cache[x] = z
        return z

    def _on_label(self, ctx: tuple, label: bool, gap: float | None) -> None:
        """The ghost labelled a sampled past access: score the predictor on it (before it learns from it:
        progressive validation), then train it on it."""
        turn, kind, reads = ctx
        x = self._features(turn, kind, reads)
        if self.predictor.fits:
            # the intercept absorbs how the labels' horizon differs from the class model's; what counts is
            # whether the features' corrections predict better than the recalibrated class model alone
            base = self._offset_of(x) + self.predictor.bias
            full = base + self.predictor.shift(x) - self.predictor.bias
            gain = _log_loss(base, label) - _log_loss(full, label)  # > 0: the corrections predicted better
            d = self.cfg.gate_decay
            self._gate_gain = d * self._gate_gain + gain
            self._gate_n = d * self._gate_n + 1.0
            self._gate_open = (self._gate_n >= self.cfg.gate_min_labels
                               and self._gate_gain > self.cfg.gate_margin * self._gate_n)
        self.predictor.add(x, label)

    def _ghost_ctx(self, u: Session | KeyUnit) -> tuple:
        if isinstance(u, Session):
            return (u.turn, HIST, 0)
        if u.kind == TAIL:
            return (u.owner.turn if u.owner is not None else None, TAIL, 0)
        return (None, u.kind, u.count)

    def _odds(self, x: tuple[int, ...] | None) -> float:
        """The predictor's odds ratio for a unit with features x (1: no correction)."""
        if x is None:
            return 1.0
        return math.exp(max(-20.0, min(20.0, self.predictor.shift(x) - self.predictor.bias)))

    def _return_label(self, gap: float) -> float:
        """The return model's label for a session back after `gap` seconds: how often the optimum, at this tier's
        capacity, hits a reuse that far apart (the ghost's h of its bucket)."""
        k = self.buckets.index(gap)
        return self._h[k] if k < len(self._h) else 0.0

    # ------------------------------------------------------------------ scores
    def _rescore(self, u: Session | KeyUnit, now: float, push: bool = True) -> None:
        """Compute u's score now and (re)file it in the eviction heap; schedule its next bucket crossing
        (`push=False`: append to the heaps' lists, the caller heapifies)."""
        age = now - u.last_time
        e = bisect_right(self._edges, age) if self._use_elapsed else 0
        cls = u.cls
        occ = self._occ
        if e < u.lb:  # the next turn cannot come before the answer-length lower bound
            e2 = u.lb
            H = self._hits.item(cls, e2)
            if occ is not None:
                o = occ.item(cls, e2) + (self._lower[e2] - age) * self._h[e2]  # ... and it sits idle until then
        else:
            H = self._hits.item(cls, e)
            if occ is not None:
                o = occ.item(cls, e)
        if self._gate_open and H > 0.0 and u.x is not None:
            H = _with_odds(H, self._odds(u.x))
        if u.__class__ is Session and u.odds is not None and H > 0.0:  # the return model's (or the hook's) odds
            H = _with_odds(H, u.odds)
        if occ is not None:
            score = H / o if o > 0.0 else 0.0
        else:
            score = H
        if u.__class__ is KeyUnit:
            size = u.size
        else:
            n = len(u.keys)
            size = u.nbytes / n if n else 1.0
            if u.prot:
                score += _PROTECT
        if size != 1 and self._keys:
            score *= self._used / (len(self._keys) * size)  # per byte (relative to the mean chunk)
        u.ver += 1
        if not u.filed:
            u.filed = True
            self._units[id(u)] = u
        seq = next(self._seq)
        entry = (score, u.last_time, seq, u, u.ver)
        u.entry = entry
        u.epoch = self._epoch
        u.until = u.last_time + self._edges[e] if e < self._n_edges else math.inf
        if push:
            heapq.heappush(self._heap, entry)
            if e < self._n_edges:
                heapq.heappush(self._cross, (u.until, seq, u, u.ver))
        else:
            self._heap.append(entry)
            if e < self._n_edges:
                self._cross.append((u.until, seq, u, u.ver))

    def _unfile(self, u: Session | KeyUnit) -> None:
        """Out of the heap (its entries are skipped while it is not filed; `_refile` may put it back)."""
        if u.filed:
            u.filed = False
            del self._units[id(u)]

    def _refile(self, u: Session | KeyUnit, now: float) -> None:
        """File a unit that has resident chunks again: with its last score when nothing it depends on changed
        since (no touch, no table refresh, no bucket crossing), else with a fresh one."""
        entry = u.entry
        if entry is not None and entry[4] == u.ver and u.epoch == self._epoch and now < u.until:
            u.filed = True
            self._units[id(u)] = u
            heapq.heappush(self._heap, entry)
        else:
            self._rescore(u, now)

    def _compact(self) -> None:
        self._heap = [x for x in self._heap if x[3].filed and x[4] == x[3].ver]
        heapq.heapify(self._heap)
        self._cross = [x for x in self._cross if x[2].filed and x[3] == x[2].ver]
        heapq.heapify(self._cross)

    def _advance(self, now: float, budget: int = -1) -> None:
        """Re-score the units whose age crossed a bucket edge since the last call (at most `budget` of them when
        it is >= 0: a decision's latency stays bounded; the rest wait for the next call)."""
        cross = self._cross
        while cross and cross[0][0] <= now and budget != 0:
            _, _, u, ver = heapq.heappop(cross)
            if u.filed and u.ver == ver:
                self._rescore(u, now)
                budget -= 1

    def score(self, unit: Session | KeyUnit) -> float | None:
        """The unit's current score (lowest goes first); None when it is not filed (tests and reports)."""
        if not unit.filed:
            return None
        return next((x[0] for x in self._heap if x[3] is unit and x[4] == unit.ver), None)

    # ------------------------------------------------------------------ first-turn probation
    def _probation(self, s: Session, follow_up: bool, now: float) -> None:
        """First-turn probation at a request's arrival (`s`: its session, already begun): a new conversation
        enters the protected queue; a follow-up leaves it (and adapts the share from whether its history was
        resident); then first turns older than the window, and the oldest beyond the share, are released to
        the normal ordering."""
        cfg = self.cfg
        cap = float(self.capacity or self._hwm)
        if self._prob_target < 0.0 and cap > 0:
            self._prob_target = cfg.probation_share * cap
        if follow_up:
            if s.prot:
                s.prot = False
                s.ver += 1
                self._prob.pop(s.sid, None)
            elif cfg.probation_adapt > 0.0 and self._missing:
                step = cfg.probation_adapt * self._missing * (self._used / len(self._keys) if self._keys else 1.0)
                t = self._prob_target + (step if s.depth == 2 else -step)
                self._prob_target = min(max(t, 0.0), cfg.probation_max_share * cap)
        elif (cfg.probation_min_blocks <= s.chain_len
              and (not cfg.probation_max_blocks or s.chain_len <= cfg.probation_max_blocks)):
            s.prot = True
            self._prob[s.sid] = s
        prob = self._prob
        if not prob:
            return
        total = 0.0
        for p in prob.values():
            total += p.nbytes
        limit = self._prob_target if self._prob_target >= 0.0 else math.inf
        oldest = now - cfg.probation_s
        while prob:
            p = next(iter(prob.values()))
            if p.last_time >= oldest and total <= limit:
                break
            del prob[p.sid]
            p.prot = False
            total -= p.nbytes
            if p.filed:
                self._rescore(p, now)
            else:
                p.ver += 1  # a kept score of it was a protected one

    # ------------------------------------------------------------------ unit bookkeeping
    def _set_session(self, s: Session, cls: int, now: float) -> None:
        s.cls = cls
        if s.keys:
            self._rescore(s, now)

    def _set_key_unit(self, u: KeyUnit, cls: int, now: float) -> None:
        u.cls = cls
        turn = u.owner.turn if (u.kind == TAIL and u.owner is not None) else None
        u.x = self._features(turn, u.kind, u.count)
        self._rescore(u, now)

    def _touch_key_unit(self, u: KeyUnit, now: float) -> None:
        """A tail/shared/orphan chunk was read again: close its wait, start the next one."""
        self.reuse.returned(u.item, now)
        u.count += 1
        u.last_time = now
        u.seq = self._req_seq
        if u.kind == TAIL:  # read again: no longer a dead tail
            u.kind = SHARED if self.cfg.use_shared else ORPHAN
            u.owner = None
        cls = self._shared_class(u.count) if u.kind == SHARED else self.C_ORPHAN
        u.item = self.reuse.start(cls, now)
        self._set_key_unit(u, cls, now)

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
        self._advance(now)
        if len(self._heap) > 4 * len(self._units) + 4096 or len(self._cross) > 4 * len(self._units) + 4096:
            self._compact()
        s, follow_up = self.sessions.begin(chain, now)
        if self.returns is not None:
            if follow_up:
                self.returns.returned(s.wait, now)
            else:
                self.returns.expire(now)
            s.wait = None
        if follow_up:
            self.reuse.returned(s.item, now)
            if s.item is not None and getattr(s.item, "answer", None) is not None:
                hist = self._lb_hist[s.item.answer]
                hist[min(self.buckets.index(now - s.item.start), len(hist) - 1)] += 1
        s.lb = 0
        s.item = None
        s.odds = None
        s.turn = self._turn(s, chain, follow_up)
        if self._prob_on:
            self._probation(s, follow_up, now)
        s.x = self._features(s.turn, HIST, 0)
        self._set_session(s, self._hist_class(s.depth, s.new_blocks), now)
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
                    s.nbytes += u.size
                    keys[k] = s
                    if not s.filed:
                        self._refile(s, now)
                elif u.seq != self._req_seq:
                    self._touch_key_unit(u, now)
            elif isinstance(u, Session):
                # another conversation's chunk read by this one: shared from now on
                size = u.keys.pop(k, None)
                if size is None:
                    continue
                u.nbytes -= size
                if not u.keys:
                    self._unfile(u)
                ku = KeyUnit(k, size, SHARED if self.cfg.use_shared else ORPHAN, now)
                ku.count = 2
                ku.seq = self._req_seq
                cls = self._shared_class(2) if ku.kind == SHARED else self.C_ORPHAN
                ku.item = self.reuse.start(cls, now)
                keys[k] = ku
                self._set_key_unit(ku, cls, now)
        if len(self._ctx) > self.cfg.max_ctx:  # chunks announced but never inserted: forget the oldest half
            for k in list(itertools.islice(self._ctx, len(self._ctx) // 2)):
                del self._ctx[k]
        if self._shadows:
            if not self._ghost_rate:
                self._fix_rates()
            sub = self._shadow_chain(chain)
            if sub:
                self._shadows[self.name].policy.on_request(sub, now)

    def on_request_finished(self, chain: Sequence[Key], answer_tokens: int, now: float | None = None) -> None:
        if not chain:
            return
        now = self.now() if now is None else now
        ctx = self._ctx
        for k in chain:
            if k in ctx:
                del ctx[k]
        s = self.sessions.session_of_chain(chain)
        if s is not None:
            self._answers += 1
            s.answer_tokens = int(answer_tokens)
            cls = self._hist_class(s.depth, s.new_blocks)
            self.reuse.cancel(s.item)
            s.item = self.reuse.start(cls, s.last_time)
            a = _bucket(s.answer_tokens, ANSWER_EDGES)
            if self.cfg.use_answer_length:
                if s.item is not None:
                    s.item.answer = a
                s.lb = self._lb_bucket[a]
                if s.turn is not None:
                    s.turn.answer = 1 + a
            if self._n_timing:
                t = self._timing_key(a, s.prev_gap)
                if s.item is not None:
                    s.item.timing = t
                cls = self._timed_row(cls, t)
            if s.turn is not None:
                s.x = self._features(s.turn, HIST, 0)
            if self.returns is not None and s.depth >= 2 and s.prev_gap is not None:
                self.returns.cancel(s.wait)
                s.wait = self.returns.start(s.last_time, ReturnModel.features(
                    s.answer_tokens, s.prev_gap, s.depth, s.new_blocks, s.chain_len))
                r = self.returns.odds_ratio(s.wait.x)
                s.odds = None if r is None else r ** self.cfg.return_strength
            if self.session_odds is not None:
                r = self.session_odds(chain, s.answer_tokens)
                s.odds = None if r is None or not r >= 0.0 else float(r)  # NaN or negative: no opinion
            self._set_session(s, cls, now)
        if self._shadows and self._shadow_rate:
            sub = self._shadow_chain(chain)
            if sub:
                self._shadows[self.name].policy.on_request_finished(sub, answer_tokens, now)

    # ------------------------------------------------------------------ tier contract
    def on_insert(self, key: Key, size: int = 1) -> None:
        keys = self._keys
        if key in keys:
            self.on_access(key)
            return
        now = self._clock()
        ctx = self._ctx.pop(key, None)
        old = self._ghost_items.pop(key, None) if self._ghost_items else None
        if old is not None:  # an evicted tail/shared/orphan chunk came back: that was a reuse
            self.reuse.returned(old[0], now)
        self._used += size
        if self._used > self._hwm:
            self._hwm = self._used
        if ctx is not None and not ctx[1]:
            u: Session | KeyUnit = ctx[0]
            u.keys[key] = size
            u.nbytes += size
            keys[key] = u
            if not u.filed and u.cls >= 0:
                self._refile(u, now)
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
            keys[key] = u
            self._set_key_unit(u, cls, now)
        hv = key_hash(key, self._salt) if self._salt else ((hash(key) * _MIX) & _MASK) >> 40  # key_hash, inlined
        if not self._ghost_rate:
            self._fix_rates()
        if hv % self._ghost_rate < self._n_strata or (self._shadow_rate and hv % self._shadow_rate == 0):
            self._observe(key, u, now, hv)
        for fb in self._fallback_list:
            fb.on_insert(key, size)

    def on_access(self, key: Key) -> None:
        u = self._keys.get(key)
        if u is None:
            return
        now = self._clock()
        if u.__class__ is KeyUnit and (u.seq != self._req_seq or not self._req_seq):
            self._touch_key_unit(u, now)
        hv = key_hash(key, self._salt) if self._salt else ((hash(key) * _MIX) & _MASK) >> 40  # key_hash, inlined
        if not self._ghost_rate:
            self._fix_rates()
        if hv % self._ghost_rate < self._n_strata or (self._shadow_rate and hv % self._shadow_rate == 0):
            self._observe(key, u, now, hv, True)
        for fb in self._fallback_list:
            fb.on_access(key)

    def _observe(self, key: Key, u: Session | KeyUnit, now: float, hv: int, hit: bool = False) -> None:
        """A sampled access: the ghost's and/or the shadows' (`hv`: the key's sampling hash; `hit`: it was a hit
        in this tier)."""
        ghost = self.ghost
        if self._use_ghost:
            r = hv % ghost.sample_rate
            if r == 0:
                if ghost.record_sampled(key, now, self._capacity_blocks(), self._ghost_ctx(u)):
                    self._refresh()
            elif r < self._n_strata:  # another stratum: its estimate joins h at the next table refresh
                self._strata[r - 1].record_sampled(key, now, self._capacity_blocks())
        rate = self._shadow_rate
        if rate and hv % rate == 0:
            cap = max(1, self._capacity_blocks() // rate)
            for sh in self._shadows.values():
                sh.access(key, cap)
            if hit:
                self._live_hits += 1
            self._shadow_n += 1
            if self._shadow_n >= self.cfg.shadow_window:
                self._decide_mode()

    def _fix_rates(self) -> None:
        """Sampling rates, fixed at the first call that needs them (the capacity is known by then, if ever)."""
        if not self._ghost_rate_fixed:
            self._fix_ghost_rate()
        self._ghost_rate = self.ghost.sample_rate if self._use_ghost else 1 << 62
        if self._use_ghost and self.cfg.ghost_strata > 1 and not self._strata:
            g = self.ghost
            for _ in range(min(self.cfg.ghost_strata, g.sample_rate) - 1):
                o = GhostBelady(self.buckets, g.sample_rate, g.window, g.refresh)
                o.first_run = g.first_run
                self._strata.append(o)
            self._n_strata = 1 + len(self._strata)
        if self._fallbacks and not self._shadow_rate:
            self._fix_shadow_rate()

    def _fix_ghost_rate(self) -> None:
        """Automatic ghost sampling, fixed at first use: about `ghost_capacity` sampled chunks of capacity (a
        larger tier samples fewer keys, so its window spans longer reuse times at the same cost); 8 when the
        tier never said its capacity. At a rate above 8, Belady first runs after as many accesses (of all keys)
        as it would at rate 8, so the first estimates come no later than at rate 8; later runs keep the
        `ghost_refresh` cadence of sampled accesses."""
        self._ghost_rate_fixed = True
        if self.capacity:
            rate = max(1, round(self._capacity_blocks() / max(1, self.cfg.ghost_capacity)))
            g = self.ghost
            g.sample_rate = rate
            g.first_run = max(64, min(g.first_run, round(g.first_run * 8 / rate)))

    def _fix_shadow_rate(self) -> int:
        """The shadows' sampling rate, fixed at first use (small tiers sample more keys so the shadows stay
        meaningful), and this policy's own shadow: the same policy on the sampled stream, its ghost sampling the
        rest of the main ghost's rate so that its window spans the same reuse times."""
        cfg = self.cfg
        rate = self._shadow_rate = max(1, min(cfg.shadow_sample_rate, self._capacity_blocks() // 128))
        g = max(1, self.ghost.sample_rate // rate)
        span = cfg.ghost_window * self.ghost.sample_rate // (rate * g)  # sampled accesses of the shadow's ghost
        own = replace(cfg, fallback=(), use_predictor=False, ghost_sample_rate=g, ghost_window=max(1024, span),
                      ghost_refresh=max(256, span // 8))
        self._shadows[self.name] = _Shadow(AnswerLengthPolicy(clock=self._clock, config=own))
        return rate

    def _shadow_chain(self, chain: Sequence[Key]) -> list:
        """The shadows' view of a request: its sampled keys, in order (cached for the request's finish)."""
        if self._sub_of is not None and self._sub_of[0] is chain:
            return self._sub_of[1]
        rate = self._shadow_rate
        salt = self._salt
        sub = [k for k in chain if key_hash(k, salt) % rate == 0]
        self._sub_of = (chain, sub)
        return sub

    def _decide_mode(self) -> None:
        """Switch orderings when another one's shadow clearly hits more than the ordering in charge (hysteresis:
        it keeps its place unless beaten by `fallback_margin`). The ordering in charge is measured on this tier
        itself (its hits on the sampled keys, which SHARDS makes comparable to the shadows' hit counts), the
        others by their shadows."""
        hits = {n: sh.hits for n, sh in self._shadows.items()}
        hits[self.mode] = self._live_hits
        cur = hits[self.mode]
        best = max(hits, key=lambda n: (hits[n], n == self.name))
        if best != self.mode and hits[best] > cur * (1.0 + self.cfg.fallback_margin) + 2:
            logger.debug("answer-length: ordering %s -> %s (shadow hits %s)", self.mode, best, hits)
            self.mode = best
            self._switches += 1
        for sh in self._shadows.values():
            sh.hits *= 0.5  # keep half of the history: an exponential window
        self._live_hits *= 0.5
        self._shadow_n = 0

    def on_remove(self, key: Key) -> None:
        u = self._keys.pop(key, None)
        if u is None:
            return
        lim = self._limbo.pop(key, None)
        if isinstance(u, Session):
            size = u.keys.pop(key, None)
            if size is None:  # victims() already took it out of the unit
                size = lim[1] if lim is not None else 0
            else:
                u.nbytes -= size
            if not u.keys:
                self._unfile(u)
        else:
            size = u.size
            self._unfile(u)
            self._remember_evicted(key, u)
        self._used -= size
        for fb in self._fallbacks.values():
            fb.on_remove(key)

    def victims(self, need: int, evictable: Callable[[Key], bool]) -> Iterator[Key]:
        if self._limbo:
            self._reattach_limbo()
        if self.mode != self.name:
            return self._fallbacks[self.mode].victims(need, evictable)
        cross = self._cross
        if cross:
            now = self._clock()
            if cross[0][0] <= now:
                self._advance(now, self.cfg.max_rescores_per_decision)
        heap = self._heap
        pop = heapq.heappop
        limbo = self._limbo
        freed = 0
        out = []
        skipped = []
        while freed < need and heap:
            entry = heap[0]
            u = entry[3]
            if not u.filed or u.ver != entry[4]:
                pop(heap)
                continue
            if u.__class__ is KeyUnit:
                key = u.key
                pop(heap)
                if not evictable(key):
                    skipped.append(entry)
                    continue
                size = u.size
                self._unfile(u)
            else:  # a session: its deepest evictable chunk; the unit stays on top while it has chunks
                key = None
                for k in reversed(u.keys):
                    if evictable(k):
                        key = k
                        break
                if key is None:
                    skipped.append(pop(heap))
                    continue
                size = u.keys.pop(key)
                u.nbytes -= size
                if not u.keys:
                    pop(heap)
                    self._unfile(u)
            limbo[key] = (u, size)
            freed += size
            out.append(key)
        for entry in skipped:
            heapq.heappush(heap, entry)
        return iter(out)

    def _reattach_limbo(self) -> None:
        """Keys a previous victims() yielded that the caller kept: back into their units."""
        if not self._limbo:
            return
        now = self.now()
        for key, (unit, size) in list(self._limbo.items()):
            if self._keys.get(key) is not unit:
                continue
            if isinstance(unit, Session):
                unit.keys[key] = size
                unit.nbytes += size
            if not unit.filed:
                self._refile(unit, now)
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
            "ghost_trace": max(g.memory_items() for g in [self.ghost, *self._strata]),  # per ghost
            "reuse_items": self.reuse.items,
            "predictor_samples": len(self.predictor),
            **(self.returns.memory_items() if self.returns is not None else {}),
            "ghost_keys": len(self._ghost_items),
            "ctx": len(self._ctx),
            "units": len(self._units),
            "heap": max(len(self._heap), len(self._cross)),
        }

    def stats(self) -> dict:
        return {
            "mode": self.mode,
            "answers": self._answers,  #: finished requests whose answer length reached a known session
            "mode_switches": self._switches,
            "ghost_runs": self.ghost.runs,
            "labels": self.ghost.labels,
            "predictor_fits": self.predictor.fits,
            "return_labels": self.returns.labels if self.returns is not None else 0,
            "return_fits": self.returns.fits if self.returns is not None else 0,
            "predictor_on": self._gate_open,
            "predictor_gain_nats": round(self._gate_gain / self._gate_n, 4) if self._gate_n else 0.0,
            "label_base_rate": round(self.predictor.base_rate(), 3),
            "label_delay_s": round(self.ghost.label_horizon(), 1),
            "sessions": len(self.sessions),
            "shadow_hits": {n: round(s.hits, 1) for n, s in self._shadows.items()},
            "live_hits": round(self._live_hits, 1),
        }
