"""Tier hints: where a waiting request's prefix KV lives, as published by the connector for the scheduler.

The kvtier connector (`kvtier.connector`) looks up a request's prefix across tiers as soon as the request is queued
(`on_new_request`), publishes a `TierHint`, and publishes a new one whenever data moves (an SSD prefetch lands in
host memory, a chunk is evicted, an in-flight computation commits). The scheduling policy
(`kvtier.scheduler_hooks.dual_queue_policy`) and the simulator consume the same type. Plain Python: no vLLM import.

Token counts describe the request's prompt prefix, walked from its first token, and are disjoint:

    gpu_tokens + host_tokens + ssd_tokens + remote_tokens + inflight_tokens <= prompt_tokens

`ssd_tokens` are tokens found only on the SSD tier (they must be read into host memory before the request can run
without stalling the GPU); `remote_tokens` are tokens found only in the tier shared by several engines (a Redis /
Valkey / Mooncake store: another engine computed them); `inflight_tokens` are tokens that are being computed or
loaded *by another in-flight request* right now and are resident nowhere yet (Strata's delay-hit case).

A request with shared-only tokens is in state REMOTE until its prefetch is issued (then LOADING): the scheduling
policy treats it like a PREPARING one (prefetch in disk-HRRN order by `prefetch_bytes`, never ahead of a
host-resident request).

`plan` is the load-or-recompute decision (`kvtier.scheduler_hooks.load_plan.LoadPlan`) when the hint was derived
with a planner (`kvtier.scheduler_hooks.hint_derivation.derive_tier_hint`): the state then follows the plan (a
request whose SSD part is to be recomputed is READY, not PREPARING), and `plan.use_tokens` is the prefix it uses.
Hints are derived in one place for production and the simulator: `hint_derivation`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvtier.scheduler_hooks.load_plan import LoadPlan

__all__ = ["TierHint", "TierState", "classify"]


class TierState(str, enum.Enum):
    """What the scheduler may do with a request right now."""

    READY = "ready"  #: everything cached is on the GPU or in host memory: schedulable now
    PREPARING = "preparing"  #: part of the prefix is only on SSD and waits for a prefetch into host memory
    REMOTE = "remote"  #: part of the prefix is only in the shared tier and waits for a prefetch into host memory
    LOADING = "loading"  #: its SSD (or shared-tier) prefetch has been issued and is in progress
    MISS = "miss"  #: nothing cached anywhere: schedulable now, computes everything

    @property
    def schedulable(self) -> bool:
        return self in (TierState.READY, TierState.MISS)

    @property
    def waits_for_prefetch(self) -> bool:
        """Queued for a prefetch that has not been issued yet (SSD or shared tier)."""
        return self in (TierState.PREPARING, TierState.REMOTE)


@dataclass(frozen=True, slots=True)
class TierHint:
    """Where one waiting request's prefix KV lives. Immutable: publish a new hint when data moves."""

    request_id: str
    #: tokens of the prompt prefix already in vLLM's GPU prefix cache
    gpu_tokens: int = 0
    #: tokens (after the GPU part) resident in kvtier's host-memory tier
    host_tokens: int = 0
    #: tokens resident only on the SSD tier
    ssd_tokens: int = 0
    #: bytes that must be read from the SSD to bring `ssd_tokens` into host memory
    ssd_bytes: int = 0
    state: TierState = TierState.MISS
    #: the request's original arrival time (seconds, same clock as the scheduler's `now`)
    arrival: float = 0.0
    #: prefix tokens being computed or loaded by another in-flight request (not resident anywhere yet)
    inflight_tokens: int = 0
    #: the request's prompt length (0: unknown)
    prompt_tokens: int = 0
    #: the load-or-recompute decision, when a planner made one
    plan: LoadPlan | None = None
    #: tokens (after the local tiers' part) found only in the shared tier
    remote_tokens: int = 0
    #: bytes that must be read from the shared tier to bring `remote_tokens` into host memory
    remote_bytes: int = 0

    def __post_init__(self) -> None:
        for name in ("gpu_tokens", "host_tokens", "ssd_tokens", "ssd_bytes", "inflight_tokens", "prompt_tokens",
                     "remote_tokens", "remote_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(f"TierHint.{name} must be >= 0, got {getattr(self, name)}")
        if not isinstance(self.state, TierState):
            object.__setattr__(self, "state", TierState(self.state))

    @property
    def cached_tokens(self) -> int:
        """Tokens the request will not have to compute if it waits for its SSD and shared-tier data."""
        return self.gpu_tokens + self.host_tokens + self.ssd_tokens + self.remote_tokens

    @property
    def needs_ssd(self) -> bool:
        return self.ssd_tokens > 0 or self.ssd_bytes > 0

    @property
    def use_tokens(self) -> int:
        """Prefix tokens the request will not compute: the plan's, else everything cached."""
        return self.plan.use_tokens if self.plan is not None else self.cached_tokens

    @property
    def uncached_tokens(self) -> int:
        """Prompt tokens the request computes (0 when the prompt length is unknown)."""
        return max(self.prompt_tokens - self.use_tokens, 0)

    @property
    def needs_remote(self) -> bool:
        return self.remote_tokens > 0 or self.remote_bytes > 0

    @property
    def prefetch_bytes(self) -> int:
        """Bytes its prefetch reads (SSD and shared tier): the size disk-HRRN orders by."""
        return self.ssd_bytes + self.remote_bytes

    def with_state(self, state: TierState) -> TierHint:
        return replace(self, state=state)


def classify(gpu_tokens: int, host_tokens: int, ssd_tokens: int, *, loading: bool = False,
             remote_tokens: int = 0) -> TierState:
    """The state a connector should publish for these token counts."""
    if remote_tokens > 0:
        return TierState.LOADING if loading else TierState.REMOTE
    if ssd_tokens > 0:
        return TierState.LOADING if loading else TierState.PREPARING
    if gpu_tokens + host_tokens > 0:
        return TierState.READY
    return TierState.MISS
