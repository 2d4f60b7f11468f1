"""A seeded, bursty synthetic trace family for eviction replays, in `TraceRequest` form (not production code).

Why: the Mooncake conversation trace is one sample of one service; a policy that wins there may lean on its
particular mix. This family varies the two things an eviction policy can exploit: bursty arrivals, and whether
session signals (answer length, depth) say anything about reuse. (`kvtier.sim.workloads` generates an agent-style
fan-out workload with Poisson arrivals for the scheduler; nothing there is bursty or session-shaped, so this is a
separate generator.)

Arrivals (both variants): a two-state Markov-modulated Poisson process. A calm state lasts Exp(mean `calm_s` [90 s])
and a burst state Exp(mean `burst_s` [20 s]); the burst state's rate is `burst_factor` [6] times the calm state's,
both chosen so that the long-run mean rate is `rate` per second. The trace covers [0, `duration_s`) [1800 s]; it
starts in the calm state. Timestamps are rounded to milliseconds (as the Mooncake files store them).

Every prompt starts with one shared system block (hash id 0), as in the Mooncake traces; blocks are 512 tokens.
Answer lengths (`output_length`) are log-normal with median `answer_median` [180] tokens and sigma `answer_sigma`
[1.0], clipped to [1, `answer_max` (2048)].

`sessions=True`, multi-turn conversations (arrivals are new conversations, `rate` [1.45/s]):
- A first turn is [0] + `first_min`..`first_max` [2..30] new blocks (uniform).
- After turn k, the conversation returns with probability min(`p_next_max` [0.7], `p_next` [0.3] + `p_next_step`
  [0.08] * (k - 1)) (deeper conversations return more often, as in the Mooncake conversation trace), at most
  `max_turns` [16] turns; the others never return.
- The next turn's prompt repeats the previous turn's hash_ids and appends ceil(answer / 512) blocks (the previous
  answer) plus `user_min`..`user_max` [1..6] blocks (the user's new message), all new.
- It arrives `gap_floor_s` [12 s] + `gap_per_token_s` [0.07 s] * previous answer tokens + a log-normal reading
  time (median `gap_median_s` [60 s], sigma `gap_sigma` [1.0]) after the previous turn: the previous answer's
  length sets a lower bound on the reading gap, as on the conversation trace.
- `session` is the index of the conversation's first request, `parent` the previous turn's index, `turn` its depth.
- Defaults: about 4,000 requests and 50,000 unique blocks in 30 minutes.

`sessions=False`, no session structure (arrivals are requests, `rate` [2.2/s]):
- `documents` [300] shared documents of `doc_min`..`doc_max` [4..40] blocks each, fixed for the trace; a request
  reads one of them with probability `p_document` [0.7], chosen Zipf-popular (probability of the i-th most popular
  proportional to 1 / i ** `zipf_s` [1.1]), as its prefix after block 0, then `suffix_min`..`suffix_max` [2..16]
  blocks of its own (new, never reused). Other requests are [0] + `first_min`..`first_max` new blocks.
- No request repeats another's whole prompt, the answer length is drawn independently of everything (it says
  nothing about reuse) and every request is a first turn (`parent` None, `session` its own index).
- Defaults: about 4,000 requests and 50,000 unique blocks in 30 minutes.

Seeds: `bursty_trace(BurstySpec(sessions=..., seed=s))` is the same trace for the same spec on every machine
(`random.Random(seed)`, no other source of randomness).
"""

from __future__ import annotations

import bisect
import itertools
import logging
import math
import random
from dataclasses import dataclass

from kvtier.replay.traces import TraceRequest

logger = logging.getLogger(__name__)

__all__ = ["BurstySpec", "bursty_trace", "mmpp_arrivals"]

BLOCK_TOKENS = 512


@dataclass(frozen=True, slots=True)
class BurstySpec:
    """Parameters of the bursty family (see the module docstring); `rate` None: the variant's default."""

    sessions: bool = True
    seed: int = 0
    duration_s: float = 1800.0
    rate: float | None = None
    burst_factor: float = 6.0
    calm_s: float = 90.0
    burst_s: float = 20.0
    answer_median: float = 180.0
    answer_sigma: float = 1.0
    answer_max: int = 2048
    first_min: int = 2
    first_max: int = 30
    # sessions=True
    p_next: float = 0.3
    p_next_step: float = 0.08
    p_next_max: float = 0.7
    max_turns: int = 16
    user_min: int = 1
    user_max: int = 6
    gap_floor_s: float = 12.0
    gap_per_token_s: float = 0.07
    gap_median_s: float = 60.0
    gap_sigma: float = 1.0
    # sessions=False
    documents: int = 300
    zipf_s: float = 1.1
    p_document: float = 0.7
    doc_min: int = 4
    doc_max: int = 40
    suffix_min: int = 2
    suffix_max: int = 16

    def __post_init__(self) -> None:
        if self.duration_s <= 0 or (self.rate is not None and self.rate <= 0):
            raise ValueError("duration_s and rate must be > 0")
        if self.burst_factor < 1 or self.calm_s <= 0 or self.burst_s <= 0:
            raise ValueError("burst_factor >= 1, calm_s > 0 and burst_s > 0 are required")
        for lo, hi in (("first_min", "first_max"), ("user_min", "user_max"), ("doc_min", "doc_max"),
                       ("suffix_min", "suffix_max")):
            if not 1 <= getattr(self, lo) <= getattr(self, hi):
                raise ValueError(f"{lo} must be >= 1 and <= {hi}")
        if self.suffix_min < 2:
            raise ValueError("suffix_min must be >= 2 (one own block would make a request look like a next turn)")
        if not (0 <= self.p_next <= 1 and 0 <= self.p_next_max <= 1 and 0 <= self.p_document <= 1):
            raise ValueError("probabilities must be in [0, 1]")
        if self.documents < 1 or self.max_turns < 1:
            raise ValueError("documents >= 1 and max_turns >= 1 are required")

    @property
    def mean_rate(self) -> float:
        """Long-run arrivals per second (conversations with sessions, requests without)."""
        if self.rate is not None:
            return self.rate
        return 1.45 if self.sessions else 2.2

    def state_rates(self) -> tuple[float, float]:
        """(calm, burst) arrival rates whose time-weighted mean is `mean_rate`."""
        calm = self.mean_rate * (self.calm_s + self.burst_s) / (self.calm_s + self.burst_s * self.burst_factor)
        return calm, calm * self.burst_factor


def mmpp_arrivals(rng: random.Random, spec: BurstySpec) -> list[float]:
    """Arrival times in [0, duration_s) of the two-state Markov-modulated Poisson process, calm state first."""
    rates = spec.state_rates()
    means = (spec.calm_s, spec.burst_s)
    out: list[float] = []
    t, state = 0.0, 0
    state_end = rng.expovariate(1.0 / means[0])
    while t < spec.duration_s:
        nxt = t + rng.expovariate(rates[state])
        if nxt >= state_end:  # memoryless: restart the clock at the switch in the other state's rate
            t, state = state_end, 1 - state
            state_end = t + rng.expovariate(1.0 / means[state])
            continue
        t = nxt
        if t < spec.duration_s:
            out.append(t)
    return out


class _Blocks:
    """Fresh block ids (0 is the shared system block)."""

    def __init__(self) -> None:
        self.next = 1

    def new(self, n: int) -> tuple[int, ...]:
        out = tuple(range(self.next, self.next + n))
        self.next += n
        return out


def _answer(rng: random.Random, spec: BurstySpec) -> int:
    return max(1, min(spec.answer_max, int(round(rng.lognormvariate(math.log(spec.answer_median),
                                                                     spec.answer_sigma)))))


def _input_tokens(rng: random.Random, blocks: int) -> int:
    return BLOCK_TOKENS * (blocks - 1) + rng.randint(1, BLOCK_TOKENS)  # the last block is partial


@dataclass(frozen=True, slots=True)
class _Draft:
    t: float
    order: int  #: creation order: ties in t keep it
    hash_ids: tuple[int, ...]
    output_length: int
    parent: int | None  #: the parent's creation order
    turn: int


def _sessions(rng: random.Random, spec: BurstySpec) -> list[_Draft]:
    blocks = _Blocks()
    drafts: list[_Draft] = []
    for start in mmpp_arrivals(rng, spec):
        t, parent, turn = start, None, 1
        chain = (0,) + blocks.new(rng.randint(spec.first_min, spec.first_max))
        while True:
            answer = _answer(rng, spec)
            drafts.append(_Draft(round(t, 3), len(drafts), chain, answer, parent, turn))
            p = min(spec.p_next_max, spec.p_next + spec.p_next_step * (turn - 1))
            if turn >= spec.max_turns or rng.random() >= p:
                break
            t += (spec.gap_floor_s + spec.gap_per_token_s * answer
                  + rng.lognormvariate(math.log(spec.gap_median_s), spec.gap_sigma))
            if t >= spec.duration_s:
                break
            parent = drafts[-1].order
            turn += 1
            chain = chain + blocks.new(-(-answer // BLOCK_TOKENS) + rng.randint(spec.user_min, spec.user_max))
    return drafts


def _no_sessions(rng: random.Random, spec: BurstySpec) -> list[_Draft]:
    blocks = _Blocks()
    docs = [blocks.new(rng.randint(spec.doc_min, spec.doc_max)) for _ in range(spec.documents)]
    cum = list(itertools.accumulate(1.0 / (i + 1) ** spec.zipf_s for i in range(spec.documents)))
    drafts: list[_Draft] = []
    for t in mmpp_arrivals(rng, spec):
        if rng.random() < spec.p_document:
            doc = docs[min(bisect.bisect_right(cum, rng.random() * cum[-1]), spec.documents - 1)]
            chain = (0,) + doc + blocks.new(rng.randint(spec.suffix_min, spec.suffix_max))
        else:
            chain = (0,) + blocks.new(rng.randint(spec.first_min, spec.first_max))
        drafts.append(_Draft(round(t, 3), len(drafts), chain, _answer(rng, spec), None, 1))
    return drafts


def bursty_trace(spec: BurstySpec | None = None) -> list[TraceRequest]:
    """The trace of `spec` (the defaults when None), in arrival order, indexes 0..n-1."""
    spec = BurstySpec() if spec is None else spec
    rng = random.Random(spec.seed)
    drafts = _sessions(rng, spec) if spec.sessions else _no_sessions(rng, spec)
    drafts.sort(key=lambda d: (d.t, d.order))
    index = {d.order: i for i, d in enumerate(drafts)}
    out: list[TraceRequest] = []
    for i, d in enumerate(drafts):
        parent = None if d.parent is None else index[d.parent]
        session = i if parent is None else out[parent].session
        out.append(TraceRequest(index=i, timestamp=d.t, hash_ids=d.hash_ids,
                                input_length=_input_tokens(rng, len(d.hash_ids)), output_length=d.output_length,
                                session=session, parent=parent, turn=d.turn))
    logger.debug("bursty trace (sessions=%s, seed %d): %d requests", spec.sessions, spec.seed, len(out))
    return out
