"""The connector's scheduler side: tier hints, eager SSD prefetch in disk-HRRN order, load/save planning.

- `on_new_request`: looks the prompt up across tiers (RPC to the worker ranks), publishes a `TierHint`
  (`tier_hint(request_id)`) and, when part of the prefix is only on SSD or only in the shared tier (state REMOTE),
  queues a prefetch into host memory.
- Prefetches are issued at most `prefetch_concurrency` at a time, in disk-HRRN order (the scheduling policy's
  `next_prefetch` when kvtier's dual-queue scheduler hands its policy over, else a local `DiskHRRNQueue`).
- `get_num_new_matched_tokens` answers `None` while the request's SSD data is being prefetched (the request waits
  without GPU blocks; others run), then the host-resident prefix (chunk-aligned) beyond vLLM's own cache hit:
  `(n, False)` (loaded inside the step, before its forward pass) or `(n, True)` (the request waits in
  WAITING_FOR_REMOTE_KVS holding its blocks while the worker loads it off the step), as `load_placement` says.
  SSD chunks the prefetch found no host room for extend the match too: the load streams them from the SSD tier
  (`LoadSpec.stream_from`, always off the step), so the host tier's free room never caps a request's SSD hits.
- Load or recompute: with kvtier's dual-queue scheduler the hints carry the policy planner's `LoadPlan`
  (`derive_tier_hint(..., planner=policy.planner)`; re-planned when the request's residency or prefetch phase
  changes, not every step). An SSD part the plan recomputes is not prefetched and only the host prefix is
  matched; on a step where nothing runs or is admitted, `policy.replan_idle` may recompute the SSD part of a
  request still waiting for its read. Prefetch byte counts and durations calibrate the planner's SSD bandwidth.
- `build_connector_meta` turns admitted loads, newly completed chunks (save jobs, numbered), requests preempted
  this step, finished requests whose blocks are held, and finished requests (answer length and token chain) into
  the step's `KVTierConnectorMetadata`, marked `idle` when the step schedules no token (the worker then waits,
  bounded, for its transfers instead of letting the engine spin). `update_connector_output` collects the save jobs
  the workers finished.
- `request_finished` keeps a finished request's blocks (delay_free_blocks) while one of its saves is not done;
  the worker reports it in `finished_sending` once they are.
- Hints count `inflight_tokens`: an admitted request's prompt chunks are *computing* until their save is done; a
  waiting request whose prefix continues into them sees them in flight (kvtier's dual-queue policy defers it
  rather than recomputing them: while the policy `holds` it, `get_num_new_matched_tokens` answers "not yet").
- Identity: every lookup, prefetch, load, save and finished request names the request's key tokens and identity
  tag (`kvtier.identity.request.RequestIdentity`: cache salt, LoRA adapter, multimodal items, prompt embeddings),
  as do its computing chunks: no request reads, waits for or is hinted about another identity's chunks. A request
  whose identity cannot be read neither reads nor writes kvtier's tiers (logged).

The policy is typed by its contract (`kvtier.scheduler_hooks.base.SchedulingPolicy`, checked when it is handed
over). Kept apart: the prefetch queue (`connector/scheduler_prefetch.py`), the per-request, computing-chunk and
save-job bookkeeping (`connector/scheduler_state.py`) and the lost-hit accounting (`scheduler_accounting.py`: each
admission against an engine cache that held everything, the shortfall by reason); the workers answer over `rpc.py`.
"""

from __future__ import annotations

import collections
import logging
import time
from dataclasses import replace
from typing import Any

import msgspec

from kvtier.compat.vllm_hit_sources import hit_source_labels
from kvtier.connector import metrics as M
from kvtier.connector.config import ConnectorConfig
from kvtier.connector.load_placement import LoadPlacement, sync_budget_tokens
from kvtier.connector.messages import (
    FinishedSpec,
    KVTierConnectorMetadata,
    KVTierWorkerMetadata,
    LoadSpec,
    LookupResult,
    SaveSpec,
)
from kvtier.connector.rpc import Flush, Lookup, Release, RPCClient, RPCError, Stats, endpoint
from kvtier.connector.scheduler_accounting import LostHitFeed
from kvtier.connector.scheduler_admission import WriteAdmission
from kvtier.connector.scheduler_prefetch import PrefetchQueue
from kvtier.connector.scheduler_state import ComputingChunks, FixedPlan, RequestState, SaveJobs
from kvtier.identity.request import RequestIdentity
from kvtier.scheduler_hooks.base import SchedulingPolicy
from kvtier.scheduler_hooks.hint_derivation import derive_tier_hint
from kvtier.scheduler_hooks.kv_cache_size import kv_bytes_per_token
from kvtier.scheduler_hooks.load_plan import LoadAction, LoadPlanner, PlanContext
from kvtier.scheduler_hooks.prefix_walk import overlap
from kvtier.scheduler_hooks.tier_hint import TierHint

logger = logging.getLogger(__name__)


class SchedulerSide:
    def __init__(self, vllm_config: Any, cfg: ConnectorConfig, kv_cache_config: Any = None) -> None:
        self.cfg = cfg
        self.chunk = cfg.chunk_size
        self.block_size = int(vllm_config.cache_config.block_size)
        world = int(vllm_config.parallel_config.world_size)
        engine_id = str(vllm_config.kv_transfer_config.engine_id)
        self.client = RPCClient([endpoint(engine_id, r) for r in range(world)], cfg.options.rpc_timeout_s)
        self.reqs: dict[str, RequestState] = {}
        self.hints: dict[str, TierHint] = {}
        #: prompt chunks that admitted requests are computing right now (not yet saved)
        self.computing = ComputingChunks(self.chunk)
        self.admission = WriteAdmission(cfg.shared, cfg.ssd_admission, self.chunk)
        self.prefetches = PrefetchQueue(self.client, cfg.options.prefetch_concurrency, cfg.options.prefetch_timeout_s)
        self.finished: list[FinishedSpec] = []
        #: recent admissions (first prompt tokens, tokens loaded, of which from SSD, of which from the shared
        #: tier), oldest first
        self.admitted: collections.deque[tuple[list[int], int, int, int]] = collections.deque(maxlen=4096)
        self.counters = {"lookups": 0, "rpc_errors": 0, "prefetches": 0, "prefetch_failures": 0, "none_answers": 0,
                         "delay_hit_waits": 0, "async_loads": 0, "sync_loads": 0, "delayed_frees": 0,
                         "plan_recompute_ssd": 0, "idle_replans": 0, "ssd_observations": 0,
                         "steps_during_async_loads": 0, "tokens_during_async_loads": 0, "idle_steps": 0,
                         "identity_errors": 0}
        self.world = world
        self.saves = SaveJobs(world)
        #: the limit (an engine cache holding everything computed) and where each request's shortfall went
        self.lost = LostHitFeed(self.block_size, self.chunk)
        self._async_loads: list[LoadSpec] = []  # allocated this step, go out with the next metadata
        #: the GPU's busy seconds (time from a step that scheduled tokens to the next step), for the policy's
        #: idle-GPU re-plan (`DualQueuePolicy.observe_gpu_busy`)
        self._busy_s = 0.0
        self._step_t: float | None = None
        self._step_busy = False
        opts = cfg.options  # loads inside or off the engine step
        self.placement = LoadPlacement(sync_budget_tokens(opts.sync_load_budget_mb, opts.sync_load_budget_tokens,
                                                          kv_bytes_per_token(kv_cache_config)))
        logger.info("kvtier: loads of up to %d tokens per engine step run inside it", self.placement.budget_tokens)

    # ------------------------------------------------------------------ hints
    @property
    def policy(self) -> SchedulingPolicy | None:
        """The scheduling policy kvtier's dual-queue scheduler handed over (None: none was)."""
        return self.prefetches.policy

    def set_scheduling_policy(self, policy: SchedulingPolicy) -> None:
        """kvtier's dual-queue scheduler hands over its policy: prefetches then follow its disk-HRRN order, hints
        carry its planner's plans."""
        if not isinstance(policy, SchedulingPolicy):
            raise TypeError(f"kvtier: {type(policy).__name__} does not implement the SchedulingPolicy contract "
                            "(kvtier.scheduler_hooks.base)")
        for rid in self.prefetches.hand_over(policy):  # move what is already queued
            st = self.reqs.get(rid)
            if st is not None:
                policy.update(self._publish(st))

    def tier_hint(self, request_id: str) -> TierHint | None:
        """The request's latest hint, with `inflight_tokens` counted now: prompt tokens past its resident
        prefix that another admitted request is computing at this moment (Strata's delay hit: they land in the
        host tier once that request saves them, so waiting beats recomputing them)."""
        hint = self.hints.get(request_id)
        st = self.reqs.get(request_id)
        if hint is None or st is None:
            return hint
        resident = hint.gpu_tokens + hint.host_tokens + hint.ssd_tokens + hint.remote_tokens
        n = self.computing.inflight_tokens(st, resident)
        return hint if n == hint.inflight_tokens else replace(hint, inflight_tokens=n)

    def _planner(self) -> LoadPlanner | None:
        policy = self.policy
        return policy.planner if policy is not None else None

    def _residency(self, st: RequestState) -> LookupResult:
        """The lookup the hint is derived from: without its SSD part once that is to be recomputed."""
        r = st.lookup
        if st.recompute_ssd and r.ssd_tokens:
            return LookupResult(r.host_end, r.host_end, 0, 0, r.chunk_size)
        return r

    @staticmethod
    def _plan_context(policy: SchedulingPolicy, planner: LoadPlanner, rid: str) -> PlanContext:
        """What the policy knows of the engine: ready work queued ahead (the GPU wait; vLLM's running requests are
        not counted) and SSD reads queued ahead."""
        return PlanContext(gpu_wait_s=policy.gpu_backlog_s(rid),
                           gpu_wait_fn=lambda service: policy.gpu_wait_estimate(service, rid),
                           ssd_wait_s=policy.ssd_backlog_bytes(rid) / planner.cost.ssd_read_bytes_per_s)

    def _publish(self, st: RequestState) -> TierHint:
        rid = st.rid
        res = self._residency(st)
        policy = self.policy
        planner = policy.planner if policy is not None else None
        plan_src: LoadPlanner | FixedPlan | None = None
        context = None
        if policy is not None and planner is not None:
            # the SSD read's phase matters to the plan only once it has landed (or failed)
            landed = st.prefetch in ("done", "failed")
            key = (st.gpu_tokens, res, landed)
            if key == st.plan_key and st.plan is not None:
                plan_src = FixedPlan(st.plan)
            else:
                plan_src, context = planner, self._plan_context(policy, planner, rid)
            st.plan_key = key
        hint = derive_tier_hint(rid, st.arrival, gpu_tokens=st.gpu_tokens, residency=res,
                                prefetch="none" if st.recompute_ssd else st.prefetch,
                                prompt_tokens=int(st.request.num_prompt_tokens), planner=plan_src, context=context)
        st.plan = hint.plan
        self.hints[rid] = hint
        if hint.plan is not None and hint.plan.ssd is LoadAction.RECOMPUTE and st.prefetch == "queued":
            st.prefetch = "none"  # no longer worth its read
            self.prefetches.unqueue(rid)
        return hint

    def _wants_prefetch(self, st: RequestState, hint: TierHint) -> bool:
        """Whether the request should wait for a prefetch into host memory rather than recompute: for a part only
        in the shared tier always (the load plan does not model the shared tier: such a hint carries no plan), for
        an SSD part when the plan says so."""
        if st.recompute_ssd:
            return False
        if st.lookup.remote_tokens > 0:
            return True
        return st.lookup.ssd_tokens > 0 and (hint.plan is None or hint.plan.waits_for_ssd)

    def _state(self, request: Any) -> RequestState:
        """A new request's state, with its identity (None, logged, when it cannot be read)."""
        st = RequestState(request, float(request.arrival_time or time.time()))
        try:
            st.identity = RequestIdentity.of(request)
        except Exception:  # noqa: BLE001 - never into the engine; the request then bypasses kvtier's tiers
            st.identity = None
            self.counters["identity_errors"] += 1
            logger.exception("kvtier: cannot read the identity (cache salt, LoRA adapter, multimodal items) of "
                             "request %s; it neither reads nor writes kvtier's tiers", request.request_id)
        return st

    def _lookup(self, st: RequestState, tokens: list[int], pin: bool, first: bool = False) -> LookupResult:
        if st.identity is None:
            return LookupResult()
        self.counters["lookups"] += 1
        # Answers of requests finished since the last engine step travel ahead of a new request's first lookup:
        # on an idle engine the next step only comes with the next request, and a conversation's next turn must
        # not reach the eviction policies before the answer of the turn it follows.
        sent, self.finished = (self.finished, []) if first else ([], self.finished)
        t0 = time.monotonic()
        try:
            reps = self.client.call(Lookup(rid=st.rid, tokens=st.key_tokens(tokens), tag=st.tag, pin=pin, first=first,
                                           finished=sent))
        except RPCError as e:
            self.counters["rpc_errors"] += 1
            self.finished = sent + self.finished  # they go with the next step's metadata instead
            logger.warning("kvtier: lookup failed (%s); treated as a miss", e)
            return LookupResult()
        finally:
            M.LOOKUP_SECONDS.observe(time.monotonic() - t0)
        return LookupResult.combine([r.result for r in reps])

    def _release(self, rid: str) -> None:
        try:
            self.client.call(Release(rid=rid))
        except RPCError as e:
            logger.warning("kvtier: release of %s failed (%s)", rid, e)

    # ------------------------------------------------------------------ prefetch
    def _enqueue(self, st: RequestState) -> None:
        st.prefetch = "queued"
        st.prefetch_from = st.lookup.host_end
        st.prefetch_ssd_tokens = st.lookup.ssd_tokens
        st.prefetch_remote_tokens = st.lookup.remote_tokens
        self.prefetches.push(st.rid, st.arrival, self._publish(st))

    def pump(self) -> None:
        """Collect finished prefetches and issue queued ones (at most `prefetch_concurrency` in flight)."""
        now = time.time()
        for st, ok in self.prefetches.poll(now, self.reqs):
            self._prefetched(st, ok, now)
        while self.prefetches.has_room():
            rid = self.prefetches.next(now)
            if rid is None:
                break
            queued = self.reqs.get(rid)
            if queued is None or queued.prefetch != "queued":
                continue
            try:
                self.prefetches.issue(rid, queued.key_tokens(), now, queued.tag)
            except RPCError as e:
                logger.warning("kvtier: cannot issue the prefetch of %s (%s)", rid, e)
                self._prefetched(queued, False, now)
                continue
            queued.prefetch = "inflight"
            self.counters["prefetches"] += 1
            self._publish(queued)
        M.PREFETCH_INFLIGHT.set(len(self.prefetches.inflight))
        M.PREFETCH_QUEUE.set(self.prefetches.queued_locally() if self.policy is None else
                             sum(1 for s in self.reqs.values() if s.prefetch == "queued"))

    def _prefetched(self, st: RequestState, ok: bool, now: float) -> None:
        rid = st.rid
        self.prefetches.finished(rid)
        st.prefetch = "done" if ok else "failed"
        if not ok:
            self.counters["prefetch_failures"] += 1
        planner = self._planner()
        reads = [r for r in st.partial.values() if r.ok and r.nbytes > 0 and r.seconds > 0]
        if ok and planner is not None and reads:  # the slowest rank decides when the request can run
            slowest = max(reads, key=lambda r: r.seconds)
            planner.observe_ssd_read(slowest.nbytes, slowest.seconds)
            self.counters["ssd_observations"] += 1
        M.PREFETCH_WAIT.observe(max(0.0, now - st.arrival))
        st.lookup = self._lookup(st, list(st.request.all_token_ids), pin=False)
        hint = self._publish(st)
        if self.policy is not None:
            self.policy.prefetch_done(rid, now, hint=hint)

    # ------------------------------------------------------------------ vLLM scheduler hooks
    def on_new_request(self, request: Any) -> None:
        st = self._state(request)
        self.reqs[request.request_id] = st
        st.lookup = self._lookup(st, list(request.all_token_ids), pin=False, first=True)
        hint = self._publish(st)
        if self._wants_prefetch(st, hint):
            self._enqueue(st)
        elif st.lookup.ssd_tokens > 0:
            self.counters["plan_recompute_ssd"] += 1
        self.pump()

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        rid = request.request_id
        st = self.reqs.get(rid)
        if st is None:  # not seen by on_new_request (e.g. created before the connector)
            st = self.reqs[rid] = self._state(request)
        st.gpu_tokens = num_computed_tokens
        self.pump()
        if st.prefetch in ("queued", "inflight") and not st.recompute_ssd:
            self.counters["none_answers"] += 1
            self._publish(st)
            return None, False
        policy = self.policy
        if num_computed_tokens == 0 and policy is not None and policy.holds(rid, time.time()):
            self.counters["delay_hit_waits"] += 1  # its prefix is being computed by another request: wait
            return None, False
        tokens = list(request.all_token_ids)
        res = st.lookup = self._lookup(st, tokens, pin=True)
        hint = self._publish(st)
        if res.hit_end > max(num_computed_tokens, res.host_end) and st.prefetch == "none":
            if self._wants_prefetch(st, hint):
                self._enqueue(st)  # SSD / shared data would lengthen the hit: wait for it in host memory
                self.pump()
                if st.prefetch in ("queued", "inflight"):
                    self.counters["none_answers"] += 1
                    return None, False
                res = st.lookup
                hint = self.hints[rid]
            elif res.ssd_tokens and not st.recompute_ssd:
                self.counters["plan_recompute_ssd"] += 1
        st.saved_upto = max(st.saved_upto, res.hit_end // self.chunk * self.chunk)
        plan = hint.plan
        load_host = plan is None or plan.host is not LoadAction.RECOMPUTE
        hit = res.host_end if load_host else 0
        stream_from = None
        if load_host and self._streams(st, res):
            # what the prefetch could not bring into host memory comes straight from the SSD tier with the load
            stream_from, hit = res.host_end, res.hit_end - res.remote_tokens
        end = min(hit, request.num_tokens - 1)
        ext = end - num_computed_tokens
        if ext <= 0:
            if res.host_end:
                self._release(rid)
            st.pending_load = None
            return 0, False
        st.pending_load = (num_computed_tokens, hit, stream_from)
        disk = remote = 0
        if st.prefetch in ("done", "failed"):  # what lies past the host prefix the prefetch started from
            ssd_end = st.prefetch_from + st.prefetch_ssd_tokens
            disk = overlap(num_computed_tokens, end, st.prefetch_from, ssd_end)
            remote = overlap(num_computed_tokens, end, ssd_end, ssd_end + st.prefetch_remote_tokens)
        st.sources = {"host": ext - disk - remote, "disk": disk, "remote": remote}
        # inside the step while the step's budget has room for it (`load_placement`); every SSD stream off it
        sync = stream_from is None and self.placement.inside(ext)
        st.async_answer = not sync
        return ext, not sync

    def _streams(self, st: RequestState, res: LookupResult) -> bool:
        """Whether a load extends past the host-resident prefix through the SSD stream: its prefetch ran (so the
        plan wanted the SSD part) and left SSD-only chunks behind (the host tier had no room for them)."""
        return (self.cfg.options.ssd_stream_chunks > 0 and st.prefetch in ("done", "failed")
                and not st.recompute_ssd and res.ssd_tokens > 0 and res.hit_end - res.remote_tokens > res.host_end)

    def get_external_cache_hit_sources(self, request: Any, num_external_tokens: int) -> dict[Any, int]:
        """The host/SSD split of an admission's external hits, under vLLM's labels (vLLM >= 0.32 asks; 0.31
        never does and has no labels: `kvtier.compat.vllm_hit_sources`)."""
        labels = hit_source_labels()
        if num_external_tokens <= 0 or labels is None:
            return {}
        st = self.reqs.get(request.request_id)
        src = dict(st.sources) if st is not None and st.sources else {"host": num_external_tokens}
        disk = min(src.get("disk", 0), num_external_tokens)
        remote = min(src.get("remote", 0), num_external_tokens - disk)  # vLLM's name for a remote store
        out = {labels.host: num_external_tokens - disk - remote, labels.disk: disk, labels.remote: remote}
        return {k: v for k, v in out.items() if v > 0}

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        st = self.reqs.get(request.request_id)
        if st is None:
            return
        if st.reallocating:
            st.reallocating = False
            if num_external_tokens == 0:  # resumed after its asynchronous load: admitted (and counted) already
                return
        if num_external_tokens > 0 and st.pending_load is not None:
            gpu_cached, load_end, stream_from = st.pending_load
            block_ids = list(blocks.get_block_ids()[0])
            # vLLM keeps an asynchronous answer asynchronous unless it drops the external hit altogether
            is_async = st.async_answer
            if len(block_ids) * self.block_size < load_end:  # vLLM trimmed the hit: load what it expects
                load_end = gpu_cached + num_external_tokens
            if stream_from is not None and stream_from >= load_end:
                stream_from = None
            spec = LoadSpec(request.request_id, st.key_tokens()[:load_end], block_ids, gpu_cached,
                            load_end, is_async=is_async, stream_from=stream_from, tag=st.tag)
            if is_async:  # vLLM parks the request (WAITING_FOR_REMOTE_KVS): its blocks are final now
                self._async_loads.append(spec)
                st.loading = st.reallocating = True
                self.counters["async_loads"] += 1
            else:
                st.load_spec = spec
                self.counters["sync_loads"] += 1
            st.saved_upto = max(st.saved_upto, load_end // self.chunk * self.chunk)
            disk = st.sources.get("disk", 0)
            remote = st.sources.get("remote", 0)
            M.HIT_TOKENS.labels("host").inc(num_external_tokens - disk - remote)
            M.HIT_TOKENS.labels("ssd").inc(disk)
            M.HIT_TOKENS.labels("remote").inc(remote)
        self.admitted.append((list(request.prompt_token_ids[:4]), int(num_external_tokens),
                              int(st.sources.get("disk", 0)) if num_external_tokens else 0,
                              int(st.sources.get("remote", 0)) if num_external_tokens else 0))
        # shared-tier and SSD-tier writes (`kvtier.shared.writes`, `kvtier.ssd_admission`)
        self.admission.admit(st, max(st.lookup.hit_end, st.gpu_tokens + num_external_tokens),
                             lambda: self.computing.keys(st))
        M.HIT_TOKENS.labels("gpu").inc(st.gpu_tokens)
        M.HIT_TOKENS.labels("miss").inc(max(0, request.num_tokens - st.gpu_tokens - num_external_tokens))
        M.QUERY_TOKENS.inc(request.num_tokens)
        st.pending_load = None
        if st.identity is not None:
            if not st.accounted:
                st.accounted = True
                self.lost.admitted(st, num_external_tokens, len(blocks.get_block_ids()[0]) * self.block_size)
            self.computing.start(st, max(st.saved_upto, st.gpu_tokens + num_external_tokens))

    def build_connector_meta(self, so: Any) -> KVTierConnectorMetadata:
        self.pump()
        self._observe_busy(bool(so.num_scheduled_tokens))
        md = KVTierConnectorMetadata()
        # steps that run while an asynchronous load issued by an earlier step is still in flight (this step's own
        # new loads start after its forward pass), and the tokens they compute for other requests
        fresh = {spec.req_id for spec in self._async_loads}
        loading = {rid for rid, st in self.reqs.items() if st.loading and rid not in fresh}
        M.ENGINE_STEPS.labels("all").inc()
        if loading:
            M.ENGINE_STEPS.labels("during_async_load").inc()
            self.counters["steps_during_async_loads"] += 1
            self.counters["tokens_during_async_loads"] += sum(
                int(n) for rid, n in so.num_scheduled_tokens.items() if rid not in loading)
        for nr in so.scheduled_new_reqs:
            st = self.reqs.get(nr.req_id)
            if st is None:
                continue
            st.block_ids = list(nr.block_ids[0]) if nr.block_ids else []
            st.computed = int(nr.num_computed_tokens)
            if st.load_spec is not None:
                md.loads.append(replace(st.load_spec, block_ids=list(st.block_ids)))
                st.load_spec = None
        cached = so.scheduled_cached_reqs
        resumed = cached.resumed_req_ids
        for i, rid in enumerate(cached.req_ids):
            st = self.reqs.get(rid)
            if st is None:
                continue
            nb = cached.new_block_ids[i]
            if rid in resumed:
                st.block_ids = list(nb[0]) if nb else []
            elif nb:
                st.block_ids.extend(nb[0])
            st.computed = int(cached.num_computed_tokens[i])
            if st.load_spec is not None:
                md.loads.append(replace(st.load_spec, block_ids=list(st.block_ids)))
                st.load_spec = None
        for rid, n in so.num_scheduled_tokens.items():
            st = self.reqs.get(rid)
            if st is None or st.identity is None:
                continue
            toks = st.request.all_token_ids
            kv_end = min(st.computed + int(n), len(toks), len(st.block_ids) * self.block_size)
            self.lost.computed(st, toks, kv_end)
            save_end = kv_end // self.chunk * self.chunk
            if save_end > st.saved_upto:
                job = self.saves.issue(st, st.saved_upto, save_end)
                key_tokens = st.key_tokens(toks[:save_end])
                self.lost.save_issued(job, st, key_tokens, st.saved_upto, save_end)
                md.saves.append(SaveSpec(rid, key_tokens, list(st.block_ids), st.saved_upto,
                                         job_id=job, share=st.share, tag=st.tag,
                                         ssd_refused=self.admission.refused(st, st.saved_upto, save_end)))
                st.saved_upto = save_end
        for rid in so.preempted_req_ids or ():
            md.preempted.append(rid)  # the worker finishes their saves before this step's forward pass
            st = self.reqs.get(rid)
            if st is not None:
                st.pending_saves.clear()
        md.loads.extend(self._async_loads)
        self._async_loads = []
        md.held = self.saves.take_new_held()
        md.finished, self.finished = self.finished, []
        self.placement.new_step()
        if not so.num_scheduled_tokens:
            md.idle = True  # the worker waits (bounded) for its loads, prefetches or saves rather than spin
            self.counters["idle_steps"] += 1
            M.ENGINE_STEPS.labels("idle").inc()
            self._replan_idle()
        return md

    def update_connector_output(self, output: Any) -> None:
        """The workers' report of a step: save jobs done (on every rank: their chunks landed, so requests waiting
        for them stop counting them in flight), asynchronous loads ended, held requests freed."""
        meta = output.kv_connector_worker_meta
        if isinstance(meta, KVTierWorkerMetadata):
            self.lost.reported(meta)
            for job, st, end in self.saves.report(meta.completed_saves):
                self.computing.done(st, end)
                self.lost.save_done(job)
        for rid in output.finished_recving or ():
            loaded = self.reqs.get(rid)
            if loaded is not None:
                loaded.loading = False
        for rid in output.finished_sending or ():
            self.saves.released(rid)

    def has_pending_block_frees(self) -> bool:
        """Blocks of finished requests come back once their saves are done: vLLM waits for them rather than
        preempting a running request."""
        return self.saves.holding()

    # ------------------------------------------------------------------ load or recompute at an idle GPU
    def _observe_busy(self, busy: bool) -> None:
        """One scheduler step: the time since the previous one was busy if that one scheduled tokens; the total
        goes to the policy (its recent busy share is the load the idle-GPU re-plan charges a recompute with)."""
        now = time.monotonic()
        if self._step_t is not None and self._step_busy:
            self._busy_s += now - self._step_t
        self._step_t, self._step_busy = now, busy
        if self.policy is not None:
            self.policy.observe_gpu_busy(now, self._busy_s)

    def _read_s(self, hint: TierHint) -> float:
        """Seconds until `hint`'s SSD part is in host memory, at best: its read's remainder if issued, else the
        reads in flight and its own."""
        planner = self._planner()
        assert planner is not None  # asked by the idle re-plan only, which needs a planner
        bw = planner.cost.ssd_read_bytes_per_s
        now = time.time()
        inflight = self.prefetches.inflight
        issued = inflight.get(hint.request_id)
        if issued is not None:
            return max(hint.ssd_bytes / bw - (now - issued), 0.0)
        ahead = sum(h.ssd_bytes for r in inflight if (h := self.hints.get(r)) is not None)
        return (ahead + hint.ssd_bytes) / bw

    def _replan_idle(self) -> None:
        """Nothing ran or was admitted this step: let the policy recompute the SSD part of a request whose read has
        not landed, where that gives an earlier first token (its read, if issued, still lands in host memory)."""
        policy = self.policy
        if policy is None or policy.planner is None:
            return
        if not any(st.prefetch in ("queued", "inflight") and not st.recompute_ssd for st in self.reqs.values()):
            return
        rid = policy.replan_idle(self._read_s)
        st = self.reqs.get(rid) if rid is not None else None
        if st is None:
            return
        st.recompute_ssd = True
        if st.prefetch == "queued":
            st.prefetch = "none"
            self.prefetches.unqueue(st.rid)
        self.counters["idle_replans"] += 1
        policy.update(self._publish(st))

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """A finished request keeps its blocks (delay_free_blocks) while one of its saves is not done; the worker
        reports it in finished_sending when they are. Never for a request whose asynchronous load is in flight:
        vLLM frees those blocks itself when the load ends."""
        rid = request.request_id
        st = self.reqs.pop(rid, None)
        delay = False
        if st is not None:
            delay = bool(st.pending_saves) and not st.loading
            # chunks no pending save covers will never land: nobody waits for them any more
            self.computing.done(st, None, start=self.saves.pending_end(st))
        self.hints.pop(rid, None)
        self.prefetches.forget(rid)
        self.lost.forget(rid)
        known = st if st is not None else self._state(request)  # never seen: its identity for the feedback
        if known.identity is not None:  # (no identity: it took no pins and its answer concerns no chain here)
            self.finished.append(FinishedSpec(rid, known.key_tokens(), int(request.num_prompt_tokens),
                                              int(request.num_output_tokens), time.time(), known.tag))
        if delay:
            self.saves.hold(rid)
            self.counters["delayed_frees"] += 1
            M.DELAYED_FREES.inc()
        return delay, None

    def flush(self, timeout: float = 60.0) -> bool:
        """Wait until every rank's queued saves and SSD / shared-tier writes have landed (False: some had not
        within `timeout` seconds on some rank). Raises RPCError if a rank does not answer."""
        return all(r.ok for r in self.client.call(Flush(timeout=timeout)))

    def snapshot(self) -> dict[str, Any]:
        """Counters of this side and the workers' storage stats, after the workers' queued saves have landed."""
        self.flush(60)
        return {"counters": dict(self.counters), "admitted": [list(a) for a in self.admitted],
                "lost_hits": self.lost.snapshot(),
                "storage": msgspec.structs.asdict(self.client.call(Stats())[0]), "policy": type(self.policy).__name__}

    def close(self) -> None:
        self.client.close()
