"""Tier hints derived in one place: the connector's scheduler side (production) and `kvtier simulate` both call
`derive_tier_hint`, so the simulated scheduler sees exactly the hints production publishes.

Inputs, all about one waiting request at one moment:
- `gpu_tokens`: vLLM's own prefix-cache hit.
- a `PrefixResidency` (`prefix_walk`: the connector's `LookupResult`, `Residency`): the storage side's walk of the
  prompt, chunk by chunk from its first token. `walk_prefix` builds one from per-chunk residency with the same
  rule as the worker's lookups (`prefix_walk.walk_chunks`): `host_end` ends the run of host-resident chunks,
  `hit_end` the run of chunks resident in host or SSD (or the shared tier); `ssd_tokens`/`ssd_bytes` count the
  SSD-only chunks of `[0, hit_end)`, `remote_tokens`/`remote_bytes` the shared-tier-only ones (a request with
  such a part waits for its prefetch: state REMOTE, no load plan; the plan models local tiers only).
- the request's SSD prefetch phase (`PrefetchPhase`): while the prefetch is not done the SSD part is pending
  (PREPARING, LOADING once issued); once done (or failed) only what is in host memory counts.
- `inflight_tokens` (`count_inflight`): prompt chunks right after the resident prefix that *another* admitted
  request is computing now (Strata's delay hit).
- optionally a `LoadPlanner` and its `PlanContext`: the hint then carries the load-or-recompute plan, and its
  state follows the plan (an SSD part to be recomputed does not make the request wait: READY).

Plain Python: no vLLM import.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable

from kvtier.scheduler_hooks.load_plan import LoadAction, PlanContext, PlanSource
from kvtier.scheduler_hooks.prefix_walk import HOST, SSD, PrefixResidency, Residency, walk_prefix
from kvtier.scheduler_hooks.tier_hint import TierHint, TierState, classify

__all__ = [
    "HOST",
    "SSD",
    "PrefetchPhase",
    "PrefixResidency",
    "Residency",
    "count_inflight",
    "derive_tier_hint",
    "walk_prefix",
]


class PrefetchPhase(str, enum.Enum):
    """Where a request's SSD -> host prefetch stands."""

    NONE = "none"  #: not queued (nothing on SSD, or not yet asked)
    QUEUED = "queued"  #: waiting for its turn (disk-HRRN order)
    INFLIGHT = "inflight"  #: its read is issued
    DONE = "done"  #: its chunks are in host memory (pinned for it)
    FAILED = "failed"  #: the read failed or timed out: its SSD part is recomputed


def count_inflight(owners: Iterable[tuple[str | None, int]], request_id: str) -> int:
    """Tokens of the leading `(owner, tokens)` chunks that another request is computing (`owner` not None and not
    `request_id`): the chunks right after a request's resident prefix, in prompt order."""
    n = 0
    for owner, tokens in owners:
        if owner is None or owner == request_id:
            break
        n += tokens
    return n


def derive_tier_hint(
    request_id: str,
    arrival: float,
    *,
    gpu_tokens: int,
    residency: PrefixResidency,
    prefetch: PrefetchPhase | str = PrefetchPhase.NONE,
    inflight_tokens: int = 0,
    prompt_tokens: int = 0,
    planner: PlanSource | None = None,
    context: PlanContext | None = None,
) -> TierHint:
    """The `TierHint` to publish for one waiting request (see the module docstring)."""
    phase = PrefetchPhase(prefetch)
    gpu = max(int(gpu_tokens), 0)
    pending = phase in (PrefetchPhase.NONE, PrefetchPhase.QUEUED, PrefetchPhase.INFLIGHT)
    ssd = residency.ssd_tokens if pending else 0
    ssd_bytes = residency.ssd_bytes if ssd else 0
    remote = residency.remote_tokens if pending else 0
    remote_bytes = residency.remote_bytes if remote else 0
    host = (max(0, residency.hit_end - residency.ssd_tokens - remote - gpu) if ssd or remote
            else max(0, residency.host_end - gpu))
    if remote:  # the load plan does not model the shared tier: the request waits for its whole prefetch
        return TierHint(request_id, gpu_tokens=gpu, host_tokens=host, ssd_tokens=ssd, ssd_bytes=ssd_bytes,
                        state=classify(gpu, host, ssd, loading=phase is PrefetchPhase.INFLIGHT, remote_tokens=remote),
                        arrival=arrival, inflight_tokens=max(int(inflight_tokens), 0),
                        prompt_tokens=max(int(prompt_tokens), 0), remote_tokens=remote, remote_bytes=remote_bytes)
    plan = None
    if planner is not None:
        hit_end = residency.hit_end if ssd else max(residency.host_end, gpu)
        plan = planner.plan(prompt_tokens=max(prompt_tokens, hit_end), gpu_tokens=gpu,
                            host_end=max(residency.host_end, gpu), hit_end=hit_end, ssd_tokens=ssd,
                            ssd_bytes=ssd_bytes, context=context or PlanContext(),
                            ssd_committed=phase is PrefetchPhase.INFLIGHT)
    waits_for_ssd = ssd > 0 and (plan is None or plan.ssd is LoadAction.PREFETCH)
    if waits_for_ssd:
        state = classify(gpu, host, ssd, loading=phase is PrefetchPhase.INFLIGHT)
    elif plan is not None:
        state = TierState.READY if plan.use_tokens > 0 else TierState.MISS
    else:
        state = classify(gpu, host, 0)
    return TierHint(request_id, gpu_tokens=gpu, host_tokens=host, ssd_tokens=ssd, ssd_bytes=ssd_bytes, state=state,
                    arrival=arrival, inflight_tokens=max(int(inflight_tokens), 0),
                    prompt_tokens=max(int(prompt_tokens), 0), plan=plan)
