"""The scheduler side's prefetch queue: which waiting requests' SSD / shared-tier chunks are read into host memory,
in which order, and which reads are in flight on the worker ranks.

Queued prefetches go out in disk-HRRN order: the scheduling policy's (`SchedulingPolicy.next_prefetch`) once
kvtier's dual-queue scheduler has handed its policy over, else a local `DiskHRRNQueue`. The scheduler side issues
them (at most `concurrency` in flight) and polls the ranks, at most every `POLL_INTERVAL_S`; a prefetch is over
when every rank has reported it or after `timeout_s`. What the request does then (its new lookup and hint) is the
scheduler side's business (`SchedulerSide._prefetched`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping

from kvtier.connector.rpc import Poll, Prefetch, RPCClient, RPCError
from kvtier.connector.scheduler_state import RequestState
from kvtier.scheduler_hooks.base import SchedulingPolicy
from kvtier.scheduler_hooks.hrrn import DiskHRRNQueue
from kvtier.scheduler_hooks.tier_hint import TierHint

logger = logging.getLogger(__name__)

__all__ = ["PrefetchQueue"]


class PrefetchQueue:
    #: vLLM steps in a tight loop while requests wait for prefetches: poll the worker ranks at most this often
    POLL_INTERVAL_S = 0.002

    def __init__(self, client: RPCClient, concurrency: int, timeout_s: float) -> None:
        self.client = client
        self.concurrency = concurrency
        self.timeout_s = timeout_s
        #: the order of queued prefetches, once kvtier's scheduler hands it over (else `local`)
        self.policy: SchedulingPolicy | None = None
        self.local = DiskHRRNQueue()
        self.inflight: dict[str, float] = {}  # request -> when its prefetch was issued (time.time())
        self._last_poll = 0.0

    def hand_over(self, policy: SchedulingPolicy) -> list[str]:
        """The policy orders prefetches from now on; returns the requests queued locally, in their order (the
        caller queues them with the policy)."""
        self.policy = policy
        moved = self.local.ordered(time.time())
        for rid in moved:
            self.local.remove(rid)
        return moved

    def push(self, rid: str, arrival: float, hint: TierHint) -> None:
        """Queue a request's prefetch (`hint`: its state as it waits for it)."""
        if self.policy is not None:
            self.policy.update(hint)
        else:
            self.local.push(rid, arrival, hint.prefetch_bytes)

    def unqueue(self, rid: str) -> None:
        """A queued prefetch is no longer wanted (a policy drops it when the request's hint says so)."""
        self.local.remove(rid)

    def forget(self, rid: str) -> None:
        """The request is gone: neither queued nor in flight any more."""
        self.local.remove(rid)
        self.inflight.pop(rid, None)

    def queued_locally(self) -> int:
        return len(self.local)

    def has_room(self) -> bool:
        return len(self.inflight) < self.concurrency

    def next(self, now: float) -> str | None:
        """The request whose prefetch goes out next (None: nothing queued)."""
        if self.policy is not None:
            return self.policy.next_prefetch(now)
        return self.local.pop(now)

    def issue(self, rid: str, tokens: list[int], now: float, tag: str = "") -> None:
        """Start a request's prefetch on every rank (RPCError: it did not start); `tokens`: its key tokens, `tag`:
        its identity tag."""
        self.client.call(Prefetch(rid=rid, tokens=tokens, tag=tag))
        self.inflight[rid] = now

    def finished(self, rid: str) -> None:
        self.inflight.pop(rid, None)

    def poll(self, now: float, reqs: Mapping[str, RequestState]) -> list[tuple[RequestState, bool]]:
        """Collect what the ranks finished (into each request's `partial`) and return the prefetches now over, in
        the order they were issued: (request, whether every rank read it all). A prefetch past `timeout_s`
        counts as failed; requests no longer known are dropped."""
        if not self.inflight or time.monotonic() - self._last_poll < self.POLL_INTERVAL_S:
            return []
        self._last_poll = time.monotonic()
        try:
            reps = self.client.call(Poll(rids=list(self.inflight)))
        except RPCError as e:
            logger.warning("kvtier: prefetch poll failed (%s)", e)
            reps = []
        for rank, rep in enumerate(reps):
            for rid, res in rep.done.items():
                st = reqs.get(rid)
                if st is not None:
                    st.partial[rank] = res
        over = []
        for rid, issued in list(self.inflight.items()):
            st = reqs.get(rid)
            if st is None:
                del self.inflight[rid]
                continue
            if len(st.partial) == len(self.client.addresses):
                over.append((st, all(r.ok for r in st.partial.values())))
            elif now - issued > self.timeout_s:
                logger.warning("kvtier: prefetch of %s timed out after %.0f s; its SSD part is recomputed",
                               rid, now - issued)
                over.append((st, False))
        return over
