"""Answer-length-aware eviction (after Bidaw's previous-answer-based eviction) with a ghost cache that replays
Belady over a sample of recent accesses.

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
- **Whether** the wait pays off at all (two thirds of all chunks are never read again) is the class hazards' to
  say too: surviving every bucket to the horizon is the class's chance of no reuse at all. (A reuse predictor
  trained on the ghost's Belady labels, after Learning Relaxed Belady, once corrected the classes' hit chances; it
  added nothing on any rolling fold and was removed: docs/results/2026-12-03-eviction-rolling-folds.md.)

Units: a session's resident history chunks are evicted together as one unit, deepest chunk first (the prefix
stays useful longest); tail/shared/orphan chunks are units of their own.

Cost: a unit's score only changes when it is touched, when the tables are refreshed, or when its age crosses a
reuse-time bucket edge. Units sit in a min-heap of scores and a second heap of bucket-crossing times re-scores
them lazily, so a decision is O(log units) plus the crossings that fell due, and an access is O(1) (plus a sampled
ghost record; Belady reruns are amortised over thousands of accesses).

Sessions come from `on_request(chain, now)` / `on_request_finished(chain, answer_tokens, now)` (the connector
calls them; in LMCache-only use the tier calls `on_request` with the prefix chain of a lookup, and sessions are
inferred from chains, see `sessions.py`). Without any request calls every chunk is an orphan, ordered by the
orphan class's learned density and recency.

No future information: every estimate comes from calls already made (the ghost's Belady sees only the window of
past accesses).

Memory bounds (all configurable): `max_sessions` session records, `ghost_window` sampled accesses, `max_items`
waiting reuse items, `max_ghost_keys` remembered evicted chunk items, `max_ctx` announced-but-not-inserted chunks,
O(classes x buckets) counters.

Modules: `config` (the knobs), `features` (bucket edges, chunk kinds, the units), `scoring` (score tables and the
score heap), `learning` (the ghost's sample), `policy` (the policy: the tier contract and the session signals).
"""

from kvtier.storage_backends.eviction.answer_length.config import AnswerLengthConfig
from kvtier.storage_backends.eviction.answer_length.features import KeyUnit
from kvtier.storage_backends.eviction.answer_length.policy import AnswerLengthPolicy

__all__ = ["AnswerLengthConfig", "AnswerLengthPolicy", "KeyUnit"]
