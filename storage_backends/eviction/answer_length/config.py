"""The answer-length policy's knobs (and its ablation switches)."""

from __future__ import annotations

from dataclasses import dataclass


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
    ghost_sample_rate: int = 0  #: one key in N is replayed by the ghost; 0: N = capacity / ghost_capacity (>= 1)
    ghost_capacity: int = 160  #: the ghost's sampled capacity when the rate is automatic (SHARDS, fixed size)
    ghost_window: int = 16384
    ghost_refresh: int = 2048
    ghost_salt: int = 0  #: which sampling hash the ghost uses: 0 the default; others measure the spread over samples
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
