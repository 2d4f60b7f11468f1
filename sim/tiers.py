"""The simulator's tiers and the hints derived over them: the methods of `Simulator` (`kvtier.sim.engine`) that
place blocks in vLLM's GPU prefix cache, kvtier's host tier (with the pins of waiting requests) and its SSD tier,
and that derive what the connector would publish for a waiting request (`derive_tier_hint` over those tiers, with
the load plan's context). The state they use is made in `Simulator.__init__`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

from kvtier.scheduler_hooks.hint_derivation import (
    HOST,
    SSD,
    PrefetchPhase,
    PrefixResidency,
    count_inflight,
    derive_tier_hint,
    walk_prefix,
)
from kvtier.scheduler_hooks.load_plan import PlanContext
from kvtier.scheduler_hooks.tier_hint import TierHint, TierState
from kvtier.sim.base import SimRequest

__all__ = ["TierModel"]


class TierModel:
    """`Simulator`'s tier and hint methods (a mixin: `Simulator` holds the state)."""

    def seed(self, blocks: Sequence[int], tier: str, tokens: int | None = None) -> None:
        """Place blocks in a tier before `run()` (hand-built scenarios): "ssd", "host" (+SSD) or "gpu" (+host+SSD).
        Seeded blocks count as computed before (a recompute of them is a recompute)."""
        if tier not in ("ssd", "host", "gpu"):
            raise ValueError(f"unknown tier {tier!r}")
        t = tokens or self.config.block_tokens
        for b in blocks:
            self.seen.add(b)
            if self.tiers and b not in self.ssd:
                self.ssd[b] = t * self.kv
                self.ssd_used += t * self.kv
            if tier in ("host", "gpu"):
                self._host_insert(b, t * self.kv)
            if tier == "gpu":
                self._gpu_insert(b, t)

    # --- small helpers -------------------------------------------------------------------------------------------
    def _block_tokens(self, r: SimRequest, i: int) -> int:
        b = self.config.block_tokens
        return max(1, min(b, r.input_tokens - i * b))

    def _need(self, r: SimRequest) -> int:
        return r.input_tokens + r.output_tokens

    # --- hints: the production derivation over the simulator's tiers --------------------------------------------
    def _walk(self, r: SimRequest) -> tuple[int, PrefixResidency, int]:
        """(vLLM's GPU hit, the storage side's prefix walk, index of the first block resident nowhere)."""
        gpu = 0
        gpu_run = True
        staged = self.staged.get(r.rid, ())
        chunks: list[tuple[str | None, int, int]] = []
        stop = len(r.blocks)
        for i, b in enumerate(r.blocks):
            t = self._block_tokens(r, i)
            if b in self.gpu:
                if gpu_run:
                    gpu += t
                chunks.append((HOST, t, 0))
                continue
            gpu_run = False
            if b in staged or b in self.host:
                chunks.append((HOST, t, 0))
            elif b in self.ssd:
                chunks.append((SSD, t, self.ssd[b]))
            else:
                stop = i
                break
        res = walk_prefix(chunks)
        if self.remote is not None and stop < len(r.blocks):
            res, stop = self.remote.extend_walk(r, res, stop, staged)
        return gpu, res, stop

    def _running_s(self) -> float:
        """GPU seconds left of the admitted jobs."""
        return sum(max(j.end - self.now, 0.0) if j.end < math.inf else j.estimate_s for j in self.jobs)

    def _plan_context(self, rid: str) -> PlanContext:
        pol = self.policy
        running = self._running_s()
        share = self.dev.current_read_share()
        ssd_ahead = self.dev.read_backlog + pol.ssd_backlog_bytes(rid)
        estimate = pol.gpu_wait_estimate
        return PlanContext(gpu_wait_s=running + pol.gpu_backlog_s(rid),
                           gpu_wait_fn=lambda service: running + estimate(service, rid),
                           ssd_wait_s=ssd_ahead / (self.cost.ssd_read_bytes_per_s * share), ssd_read_share=share)

    def _read_s(self, hint: TierHint) -> float:
        """Seconds until `hint`'s SSD part lands: its read's remainder if issued (or if another request's read in
        flight brings all of it), else if it were issued next."""
        rate = self.cost.ssd_read_bytes_per_s * self.dev.current_read_share()
        r = self.waiting.get(hint.request_id)
        riding = r is not None and self._ssd_part_loading(r)[1]
        if hint.state is TierState.LOADING or riding:
            return self.dev.read_backlog / rate
        return (self.dev.read_backlog + hint.ssd_bytes) / rate

    def _ssd_part_loading(self, r: SimRequest) -> tuple[int, bool]:
        """(tokens of `r`'s SSD-only prefix blocks that another request's read in flight is bringing into host
        memory, whether that is all of its SSD part): Strata's delay hit covers loads as well as computations."""
        if not self.loading:
            return 0, False
        n, whole = 0, True
        staged = self.staged.get(r.rid, ())
        for i, b in enumerate(r.blocks):
            if b in self.gpu or b in self.host or b in staged:
                continue
            if b not in self.ssd:
                break
            owner = self.loading.get(b)
            if owner is not None and owner != r.rid:
                n += self._block_tokens(r, i)
            else:
                whole = False
        return n, whole and n > 0

    def _hint(self, r: SimRequest) -> TierHint:
        """What the connector would publish for `r` now (`derive_tier_hint` over the simulator's tiers)."""
        gpu, res, stop = self._walk(r)
        owners = ((self.computing.get(b), self._block_tokens(r, stop + k)) for k, b in enumerate(r.blocks[stop:]))
        inflight = count_inflight(owners, r.rid) + self._ssd_part_loading(r)[0]
        phase = self.phase.get(r.rid, PrefetchPhase.NONE)
        planner = self.planner if self.tiers else None
        t0 = time.perf_counter()
        hint = derive_tier_hint(r.rid, r.arrival * self.config.time_scale, gpu_tokens=gpu, residency=res,
                                prefetch=phase, inflight_tokens=inflight, prompt_tokens=r.input_tokens,
                                planner=planner, context=self._plan_context(r.rid) if planner else None)
        self._decision_s += time.perf_counter() - t0
        self._decisions += 1
        return hint

    def _publish(self, rid: str, new: bool = False) -> TierHint:
        r = self.waiting[rid]
        hint = self._hint(r)
        if self.prefetching and hint.state.waits_for_prefetch and \
                self.phase.get(rid, PrefetchPhase.NONE) is PrefetchPhase.NONE:
            self.phase[rid] = PrefetchPhase.QUEUED  # the connector queues its prefetch
        if hint.inflight_tokens > 0:
            self.inflight_waiters.add(rid)
        else:
            self.inflight_waiters.discard(rid)
        if new:
            self.policy.add(hint, self._need(r))
        else:
            self.policy.update(hint)
        return hint

    # --- pins and tiers ------------------------------------------------------------------------------------------
    def _pin(self, rid: str, b: int) -> None:
        mine = self.pinned_by.setdefault(rid, set())
        if b in mine:
            return
        mine.add(b)
        self.pins[b] = self.pins.get(b, 0) + 1

    def _pin_prefix(self, r: SimRequest) -> None:
        """Pin the host-resident part of the prefix until the request runs (prefetching schedulers)."""
        staged = self.staged.get(r.rid, ())
        for b in r.blocks:
            if b in self.host and b not in staged:
                self._pin(r.rid, b)
            elif b not in self.gpu and b not in staged:
                break

    def _unpin_all(self, rid: str) -> None:
        for b in self.pinned_by.pop(rid, ()):
            n = self.pins[b] - 1
            if n:
                self.pins[b] = n
            else:
                del self.pins[b]

    def _host_insert(self, b: int, nbytes: int) -> bool:
        if b in self.host:
            self.host_policy.on_access(b)
            return True
        if nbytes > self.host_cap:
            return False
        need = self.host_used + nbytes - self.host_cap
        if need > 0:
            pins = self.pins
            for v in list(self.host_policy.victims(need, lambda k: pins.get(k, 0) == 0)):
                if need <= 0:
                    break
                n = self.host.pop(v, None)
                if n is None:
                    continue
                self.host_used -= n
                need -= n
                self.host_policy.on_remove(v)
            if need > 0:
                return False  # everything else is pinned: the SSD copy serves
        self.host[b] = nbytes
        self.host_used += nbytes
        self.host_policy.on_insert(b, nbytes)
        return True

    def _ssd_write(self, b: int, nbytes: int) -> None:
        if not self.tiers or b in self.ssd or b in self.ssd_queued:
            return
        if self.dev.submit_write(self.now, b, nbytes):
            self.ssd_queued[b] = nbytes

    def _ssd_insert(self, b: int, nbytes: int) -> None:
        if b in self.ssd:
            self.ssd.move_to_end(b)
            return
        self.ssd[b] = nbytes
        self.ssd_used += nbytes
        self.ssd_write_bytes += nbytes
        while self.ssd_used > self.ssd_cap and self.ssd:
            _, n = self.ssd.popitem(last=False)
            self.ssd_used -= n

    def _gpu_insert(self, b: int, tokens: int) -> None:
        if b in self.gpu:
            self.gpu.move_to_end(b)
        else:
            self.gpu[b] = tokens
            self.gpu_tokens += tokens
        self._gpu_trim()

    def _gpu_trim(self) -> None:
        room = max(self.gpu_cap - self.held, 0)
        while self.gpu_tokens > room and self.gpu:
            _, t = self.gpu.popitem(last=False)
            self.gpu_tokens -= t

