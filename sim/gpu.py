"""Admission and the GPU in the simulator: the methods of `Simulator` (`kvtier.sim.engine`) that admit the request
the policy picks (its prefix cut by the tiers, the load plan and the blocks still computing; recomputed tokens
counted by why), run its GPU job (a synchronous SSD or shared-tier read with the GPU stalled, the host->GPU load,
the prefill in chunks, its share of decode), land its computed blocks in the tiers and free its KV. The state they
use is made in `Simulator.__init__`.
"""

from __future__ import annotations

import time

from kvtier.scheduler_hooks.hint_derivation import PrefetchPhase
from kvtier.scheduler_hooks.load_plan import LoadAction
from kvtier.sim.base import EV_DECODE_DONE, EV_GPU_FREE, EV_LANDING, EV_PREFILL_DONE, GpuJob, SimRequest
from kvtier.storage_backends.admission.base import AdmissionQuery

__all__ = ["GpuModel"]


class GpuModel:
    """`Simulator`'s admission and GPU-job methods (a mixin: `Simulator` holds the state)."""

    def _admit_open(self) -> bool:
        if not self.jobs:
            return True
        return len(self.jobs) == 1 and self.now >= self.jobs[0].lc

    def _try_dispatch(self) -> bool:
        free = max(self.gpu_cap - self.held, 0)
        t0 = time.perf_counter()
        idle = not self.jobs and self.planner is not None and self.tiers
        if idle:  # nothing runs: the busy total is exact now (a job's busy time is booked when it starts computing)
            self.policy.observe_gpu_busy(self.now, self.gpu_busy_s)
        rid = self.policy.pick(self.now, free)
        if rid is None and idle:
            rid = self.policy.replan_idle(self._read_s, free)
            if rid is not None:
                self.phase[rid] = PrefetchPhase.NONE  # its prefetch is dropped: it recomputes the SSD part
        self._decision_s += time.perf_counter() - t0
        self._decisions += 1
        if rid is None:
            return False
        hint = self.policy.hint(rid)
        r = self.waiting.pop(rid)
        for b in r.blocks:
            ws = self.waiters_of.get(b)
            if ws is not None:
                ws.discard(rid)
                if not ws:
                    del self.waiters_of[b]
        self.policy.dispatched(rid, self.now)
        self.inflight_waiters.discard(rid)
        self.dispatch_order.append(rid)
        self.phase.pop(rid, None)
        plan = hint.plan
        use_host = plan is None or plan.host is not LoadAction.RECOMPUTE
        staged = self.staged.pop(rid, set())
        rstaged = self.remote_staged.pop(rid, set())
        kv = self.kv
        cached = host_b = sync_b = sync_rb = 0
        sync_blocks: list[int] = []
        sync_remote: list[int] = []
        stop = len(r.blocks)
        cut_by_plan = False
        for i, b in enumerate(r.blocks):
            if sync_remote and (b not in self.remote or b in self.gpu):  # the shared tier's part is a prefix tail
                stop = i
                break
            t = self._block_tokens(r, i)
            if b in self.gpu:
                self.tokens["gpu"] += t
                self.gpu.move_to_end(b)
            elif not use_host and (b in staged or b in self.host or b in self.ssd):
                stop, cut_by_plan = i, True
                break
            elif b in staged:
                self.tokens["remote" if b in rstaged else "ssd_prefetch"] += t
                host_b += t * kv
            elif b in self.host:
                self.tokens["host"] += t
                host_b += t * kv
                self.host_policy.on_access(b)
            elif b in self.computing:
                stop = i
                break
            elif b in self.ssd and self.sync_reads:
                self.tokens["ssd_sync"] += t
                sync_b += t * kv
                sync_blocks.append(b)
                self.ssd.move_to_end(b)
            elif self.sync_reads and self.remote is not None and b in self.remote:
                self.tokens["remote_sync"] += t
                sync_rb += t * kv
                sync_remote.append(b)
            else:
                stop = i
                cut_by_plan = b in self.ssd
                break
            cached += t
        if stop < len(r.blocks):  # blocks past the cut that existed are recomputed, for the cut's reason
            b0 = r.blocks[stop]
            loaded_by_other = self.loading.get(b0, rid) != rid  # another request's read was bringing it
            why = "inflight" if b0 in self.computing or loaded_by_other else ("plan" if cut_by_plan else (
                "inflight" if b0 in self.loading else "evicted"))
            for k, b in enumerate(r.blocks[stop:]):
                if b in self.seen or b in self.computing or b in self.loading or b in staged:
                    self.recomputed[why] += self._block_tokens(r, stop + k)
        new = max(r.input_tokens - cached, 1 if r.input_tokens else 0)
        self.tokens["computed"] += new
        affected: set[str] = set()
        for b in r.blocks[stop:]:
            if self.computing.setdefault(b, rid) == rid:
                affected |= self.waiters_of.get(b, set())
        for w in affected:  # production's hints count in-flight chunks live: theirs change now
            self._publish(w)
        self.held += self._need(r)
        self._gpu_trim()
        # computed blocks land when the last chunk starts (those before it) and when the prefill ends (the rest)
        chunk = self.cost.prefill_chunk_tokens
        before_last = cached + chunk * ((new - 1) // chunk) if new > 0 else cached
        split = stop
        while split < len(r.blocks) and (split + 1) * self.config.block_tokens <= before_last:
            split += 1
        job = GpuJob(r, stop, split, cached, new, host_b, sync_b, sync_blocks, sync_rb, sync_remote)
        adm = self.ssd_admission  # depth: the blocks its prompt found cached at admission
        job.ssd = adm.decide(AdmissionQuery(stop, r.blocks if adm.needs_keys else ()))
        job.estimate_s = self.cost.ssd_read_time(sync_b) + self.cost.host_to_gpu_time(host_b + sync_b + sync_rb) + \
            (self.remote.read_time(sync_rb) if sync_rb else 0.0) + \
            self.cost.prefill_time(new, cached) + self.cost.decode_gpu_time(r.output_tokens, r.input_tokens)
        self.jobs.append(job)
        if len(self.jobs) == 1:
            self._start(job)
        return True

    def _start(self, job: GpuJob) -> None:
        r = job.r
        job.start = self.now
        self.queue[r.rid] = self.now - r.arrival * self.config.time_scale
        self._unpin_all(r.rid)
        if job.sync_bytes:
            self.dev.submit_read(self.now, ("sync", job), job.sync_bytes)  # the GPU stalls until it is read
        else:
            self._after_sync_ssd(job)

    def _after_sync_ssd(self, job: GpuJob) -> None:
        if job.sync_remote_bytes:  # then the shared tier's part, still stalled (LMCache's synchronous retrieve)
            self.remote.read_sync(job)
        else:
            self._compute(job, self.now)

    def _compute(self, job: GpuJob, t0: float) -> None:
        r = job.r
        cost = self.cost
        load = cost.host_to_gpu_time(job.host_bytes + job.sync_bytes + job.sync_remote_bytes)
        prefill = cost.prefill_time(job.new, job.cached)
        job.compute_start = t0
        job.first = t0 + load + prefill
        job.lc = job.first - cost.last_chunk_time(job.new, job.cached)
        decode = cost.decode_gpu_time(r.output_tokens, r.input_tokens)
        job.end = job.first + decode
        self.gpu_busy_s += job.end - job.start
        self.gpu_compute_s += load + prefill + decode
        self.ttft[r.rid] = job.first - r.arrival * self.config.time_scale
        self._push(job.lc, EV_LANDING, job)
        self._push(job.first, EV_PREFILL_DONE, job)
        self._push(job.end, EV_GPU_FREE, job)
        self._push(job.first + cost.decode_wall_time(r.output_tokens), EV_DECODE_DONE, r)

    def _land(self, job: GpuJob, lo: int, hi: int) -> None:
        r = job.r
        for i in range(lo, hi):
            b = r.blocks[i]
            t = self._block_tokens(r, i)
            self._gpu_insert(b, t)
            if self.computing.get(b) == r.rid:
                del self.computing[b]
            self.seen.add(b)
            nbytes = t * self.kv
            if self.tiers and t == self.config.block_tokens:  # the connector stores full chunks only
                self._host_insert(b, nbytes)
                if job.ssd.admits(i):
                    self._ssd_write(b, nbytes)
                else:
                    self.ssd_refused_blocks += 1
                if self.remote is not None:  # `writes: all`: written through to the shared tier
                    self.remote.write(b, nbytes)

    def _on_landing(self, job: GpuJob) -> None:
        if job.split > job.stop:
            self._land(job, job.stop, job.split)
            self._refresh_inflight()

    def _on_prefill_done(self, job: GpuJob) -> None:
        r = job.r
        for i in range(job.stop):
            self._gpu_insert(r.blocks[i], self._block_tokens(r, i))
        for b in job.sync_blocks:  # read synchronously: now also in host memory
            if b not in self.host and b in self.ssd:
                self._host_insert(b, self.ssd[b])
        for b in job.sync_remote_blocks:
            self._host_insert(b, self._block_tokens(r, r.blocks.index(b)) * self.kv)
        self._land(job, job.split, len(r.blocks))
        self._refresh_inflight()

    def _on_gpu_free(self, job: GpuJob) -> None:
        if self.jobs and self.jobs[0] is job:
            self.jobs.popleft()
        if self.jobs:
            self._start(self.jobs[0])

    def _on_decode_done(self, r: SimRequest) -> None:
        self.held -= self._need(r)
        self.completed += 1
        self.host_policy.on_request_finished(r.blocks, r.output_tokens, self.now)

